"""The README's main job and the examples run against a real server and print what they claim (the README's
snippets: tests/test_readme.py)."""

from __future__ import annotations

import re
from pathlib import Path

from _scripts import run_script

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_main_job(tmp_path: Path) -> None:
    """examples/quickstart.py (the README's main job) starts its own server, gets right answers, stops it.

    Its server has the models the script uses (a script that asks for another fails here on "unknown model").
    """
    models = [
        "scale_fp32",
        "seq_stats_oldest",
        "chat",
        "chat_stateless",
        "minilm",
        "minilm_tokenizer",
        "minilm_encoder",
    ]
    code, out, err = run_script(ROOT / "examples" / "quickstart.py", tmp_path, models)
    assert code == 0, err[-3000:]
    assert "scale_fp32([0.0, 1.0, 2.0, 3.0]) = [0.0, 2.0, 4.0, 6.0]" in out
    assert "refused before sending: input 'INPUT0': expected FP32, given float64" in out
    assert "mean after 3 steps = [3.0, 4.0, 5.0, 6.0]" in out
    # The chat: five turns, each timed with the history kept and resent, the stateless twin agreeing.
    kept = [float(m) for m in re.findall(r"kept: +([\d.]+) ms to first token", out)]
    resent = [float(m) for m in re.findall(r"resent: +([\d.]+) ms to first token", out)]
    assert len(kept) == len(resent) == 5
    prefilled = [int(m) for m in re.findall(r"resent: .*?(\d+) tokens prefilled", out)]
    assert prefilled == sorted(prefilled)
    assert prefilled[-1] > prefilled[0]  # the stateless way prefills a growing history
    assert re.search(r"Turn 5: the first token came [\d.]+x sooner", out)
    # The scoring job: every sentence embedded, and the neighbours of the query ranked by similarity.
    assert re.search(r"scored 400 rows in [\d.]+ s \([\d,]+ rows/s\): 400 ok, 0 failed", out)
    similarities = [float(m) for m in re.findall(r"^  (0\.\d{3})  ", out, re.M)]
    assert len(similarities) == 5
    assert similarities == sorted(similarities, reverse=True)
    assert out.rstrip().endswith("server stopped")

