"""The README's main job, its tour and the examples run against a real server and print what they claim."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from triton_npu_client import default_model_repository
from triton_npu_client._local._server import temp_folder_prefix

ROOT = Path(__file__).resolve().parent.parent


# Runs a script as ``python script.py`` would, with LocalTriton's default repository narrowed to the folder in
# argv[1]: a server on all of server_models/ loads every model (several GPT-2 and MiniLM loads among them), which
# costs a script that uses two of them most of its run. The script's text is untouched.
_NARROWED = """
import runpy, sys
from pathlib import Path
import triton_npu_client._local._server as server
repository = Path(sys.argv[1])
server.default_model_repository = lambda: repository
sys.argv = sys.argv[2:]
sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _repository_of(folder: Path, models: list[str]) -> Path:
    """A model repository in ``folder`` holding links to these server_models/ models only."""
    folder.mkdir()
    for name in models:
        (folder / name).symlink_to(default_model_repository() / name, target_is_directory=True)
    return folder


def _run(script: Path, cwd: Path, models: list[str]) -> tuple[int, str, str]:
    """Run ``script`` with this interpreter, its LocalTriton() serving only ``models``; check it left no
    LocalTriton temp folder; return (code, out, err)."""
    repository = _repository_of(cwd / "models", models)
    with subprocess.Popen(
        [sys.executable, "-c", _NARROWED, str(repository), str(script)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            # A safety net only: each script starts one server and sends a handful of requests.
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    prefix = temp_folder_prefix(proc.pid)
    left = [p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefix)]
    assert left == [], f"{script.name} left temp folders behind: {left}"
    return proc.returncode, out, err


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
    code, out, err = _run(ROOT / "examples" / "quickstart.py", tmp_path, models)
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


def _tour_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## A short tour\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "no python block in the README's tour"
    return match.group(1)


def test_readme_tour_runs_as_written(tmp_path: Path) -> None:
    """The python block of the README's "A short tour", saved as a file, runs and prints what its comments say.

    Its server has the two models the tour uses (a tour that asks for another fails here on "unknown model").
    """
    script = tmp_path / "tour.py"
    script.write_text(_tour_snippet())
    code, out, err = _run(script, tmp_path, ["scale_fp32", "seq_stats_oldest"])
    assert code == 0, err[-3000:]
    lines = out.splitlines()
    assert lines[0] == "<ModelSpec scale_fp32(INPUT0: FP32[-1]) -> (OUTPUT0: FP32[-1]), max_batch_size=64>"
    assert lines[1] == "[[0. 2. 4. 6.]]"  # 2 * arange(4), batch dimension added
    assert lines[2].startswith("input 'INPUT0': expected FP32, given float64: ")
    assert lines[3] == "[[2. 3. 4. 5.]]"  # mean of [1, 2, 3, 4] and [3, 4, 5, 6]
    assert len(lines) == 4
