"""``triton-npu score`` as a person meets it (issue 25): mistakes the model's config shows, found at connect time
with ``--url`` before any file is opened; a summary that counts every failed row the exit code counts;
``--allow-lossy``; messages in flags, not keyword arguments; a complete job that tidies its checkpoint (kept with
``--keep-checkpoint``); ``--keep`` carrying input columns to the output.

The same mistakes without ``--url`` (found in the packaged repository's config before any server starts, shown by
the tripwire) are cases of ``test_each_cli_mistake_is_one_line_and_its_own_exit_code_before_any_server`` in
tests/test_score_safety.py. Everything here talks to the session's server.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_score_safety import PYTHON_WORDS

from triton_npu_client import Client, LocalTriton, UsageError, score
from triton_npu_client._jobs import OutputExistsError, plan_job
from triton_npu_client.cli import main
from triton_npu_client.cli._score import cli_words


def cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``triton-npu score ARGS`` run in this process (a fresh interpreter per command would cost seconds each):
    its exit code, stdout and stderr, as a subprocess would give them."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["score", *args])
        except SystemExit as exit:  # argparse's --help
            code = int(exit.code or 0)
    return subprocess.CompletedProcess(["triton-npu", "score", *args], code, out.getvalue(), err.getvalue())

SUMMARY = re.compile(r"^scored ([\d,]+) rows in .*: ([\d,]+) ok, ([\d,]+) failed", re.M)


def counts(stdout: str) -> tuple[int, int, int]:
    match = SUMMARY.search(stdout)
    assert match is not None, stdout
    rows, ok, failed = (int(g.replace(",", "")) for g in match.groups())
    return rows, ok, failed


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("triton-npu score: "), lines
    assert not PYTHON_WORDS.search(lines[0]), lines[0]
    return lines[0]


def probe_rows(path: Path, n: int, bad: frozenset[int] = frozenset()) -> None:
    path.write_text("".join(json.dumps({"X": [-1.0 if i in bad else float(i), 0.0]}) + "\n" for i in range(n)))


# -- mistakes the server's config shows, at connect time ------------------------------------------------------------


def connect_time_mistake(case: str, tmp: Path) -> tuple[list[str], str]:
    text = tmp / "sentences.txt"
    text.write_text("one\ntwo words\nthree words here\n")
    if case == "several outputs into one .npy":
        return ["--model", "minilm_tokenizer", "--input", str(text), "--output", str(tmp / "tok.npy")], \
            "gives 2 outputs (INPUT_IDS, ATTENTION_MASK) and a .npy file holds one: choose it with --output-name"
    if case == "a stateful model":
        return ["--model", "seq_stats_oldest", "--input", str(text), "--output", str(tmp / "o.jsonl")], "is stateful"
    if case == "batch size over the model's max":
        probe_rows(tmp / "rows.jsonl", 3)
        return ["--model", "score_probe", "--input", str(tmp / "rows.jsonl"), "--output", str(tmp / "o.jsonl"),
                "--batch-size", "17"], "--batch-size must be in [1, 16]"  # fmt: skip
    assert case == "a float64 .npy for an FP32 input"
    np.save(tmp / "x.npy", np.ones((3, 4)))
    return ["--model", "scale_fp32", "--input", str(tmp / "x.npy"), "--output", str(tmp / "o.jsonl")], \
        "cast it yourself or pass --allow-lossy"


@pytest.mark.parametrize("case", ["several outputs into one .npy", "a stateful model",
                                  "batch size over the model's max", "a float64 .npy for an FP32 input"])
def test_with_url_the_configs_mistakes_are_found_before_any_file_is_opened(
    triton_server: LocalTriton, tmp_path: Path, case: str
) -> None:
    args, phrase = connect_time_mistake(case, tmp_path)
    before = files(tmp_path)
    done = cli([*args, "--url", triton_server.grpc_url, "--no-progress"])
    assert phrase in one_line(done.stderr)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert files(tmp_path) == before  # no output, no checkpoint, no errors file


async def test_score_refuses_several_outputs_for_one_npy_before_any_file(
    triton_server: LocalTriton, tmp_path: Path
) -> None:
    """The SDK's own check (the CLI's translates it): before, the job wrote an empty .npy and its checkpoint, then
    raised a ValueError about a commit."""
    text = tmp_path / "s.txt"
    text.write_text("a\nb\n")
    async with Client(triton_server.grpc_url) as client:
        model = await client.model("minilm_tokenizer")
        with pytest.raises(UsageError, match=r"outputs=\[NAME\] \(--output-name\)"):
            await score(model, text, tmp_path / "tok.npy", progress=False)
        assert files(tmp_path) == ["s.txt"]
        summary = await score(model, text, tmp_path / "ids.npy", outputs=["INPUT_IDS"], progress=False)
        assert (summary.rows_ok, summary.rows_failed) == (2, 0)


# -- the summary counts what the exit code counts -------------------------------------------------------------------


def test_the_summary_counts_the_rows_the_output_file_refused(triton_server: LocalTriton, tmp_path: Path) -> None:
    """Rows of another shape than the first row's cannot go into one .npy: they are failed rows in the summary as in
    the errors file and the exit code (before: "200 ok, 0 failed" beside "136 of 200 rows failed", exit 3)."""
    source = tmp_path / "rows.jsonl"
    lengths = [2, 2, 3, 2, 4, 4, 2, 1]
    source.write_text("".join(json.dumps({"INPUT0": [1.0] * n}) + "\n" for n in lengths))
    out = tmp_path / "y.npy"
    done = cli(["--model", "scale_fp32", "--input", str(source), "--output", str(out), "--url",
                triton_server.grpc_url, "--no-progress"])  # fmt: skip
    refused = sum(n != lengths[0] for n in lengths)
    assert counts(done.stdout) == (8, 8 - refused, refused)
    assert f"{refused} of 8 rows failed" in one_line(done.stderr)
    assert done.returncode == 3
    errors = [json.loads(line) for line in Path(f"{out}.errors.jsonl").read_text().splitlines()]
    assert [e["row"] for e in errors] == [i for i, n in enumerate(lengths) if n != lengths[0]]
    assert {e["error"] for e in errors} == {"OutputShapeError"}
    y = np.load(out)
    assert y.shape == (8, 2)
    np.testing.assert_array_equal(y[[0, 1, 3, 6]], np.full((4, 2), 2.0, np.float32))


# -- --allow-lossy ---------------------------------------------------------------------------------------------------


def test_allow_lossy_casts_a_float64_npy(triton_server: LocalTriton, tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float64).reshape(3, 4) / 3
    np.save(tmp_path / "x.npy", x)
    args = ["--model", "scale_fp32", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy"),
            "--url", triton_server.grpc_url, "--no-progress"]  # fmt: skip
    refused = cli(args)
    assert refused.returncode == 2
    assert "pass --allow-lossy" in one_line(refused.stderr)
    assert files(tmp_path) == ["x.npy"]
    done = cli([*args, "--allow-lossy"])
    assert done.returncode == 0, done.stderr
    assert counts(done.stdout) == (3, 3, 0)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), 2 * x.astype(np.float32))


# -- flags, not keyword arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sdk", "cli_text"),
    [
        ("or pass overwrite=True (--overwrite) to replace it", "or pass --overwrite to replace it"),
        ("unless keep_checkpoint=True (--keep-checkpoint))", "unless --keep-checkpoint)"),
        ("choose it with outputs=[NAME] (--output-name), or", "choose it with --output-name, or"),
        ("the input columns of keep= (--keep): write", "the input columns of --keep: write"),
        ("loses precision; cast it yourself or pass allow_lossy=True", "loses precision; cast it yourself or pass "
         "--allow-lossy"),
        ("lossy cast (e.g. float to integer); pass allow_lossy=True", "lossy cast (e.g. float to integer); pass "
         "--allow-lossy"),
        ("from its suffix '.xlsx': pass format= one of jsonl, npy, parquet (--output-format on the command line)",
         "from its suffix '.xlsx': pass --output-format, one of jsonl, npy, parquet"),
        ("longer than 1,000 bytes (max_line_bytes): skipped", "longer than 1,000 bytes (--max-line-bytes): skipped"),
        ("batch_size must be in [1, 16]", "--batch-size must be in [1, 16]"),
        ("gives INPUT_IDS, ATTENTION_MASK: choose one (output=...)", "gives INPUT_IDS, ATTENTION_MASK: choose one "
         "(--output-name)"),
        ("unreachable for 121 s (patience_s=120); last error", "unreachable for 121 s (its patience, 120 s); last "
         "error"),
        ("is stateful: score() sends stateless requests", "is stateful: triton-npu score sends stateless requests"),
    ],
)
def test_cli_words_name_flags(sdk: str, cli_text: str) -> None:
    assert cli_words(sdk) == cli_text
    assert not PYTHON_WORDS.search(cli_words(sdk))


def test_the_sdk_keeps_its_python_words(tmp_path: Path) -> None:
    """The CLI translates; a Python caller still reads the keyword argument to pass."""
    source = tmp_path / "rows.jsonl"
    probe_rows(source, 2)
    (tmp_path / "out.jsonl").write_text("someone's\n")
    with pytest.raises(OutputExistsError, match=r"pass overwrite=True \(--overwrite\)"):
        plan_job(source, tmp_path / "out.jsonl", model="score_probe")


# -- a complete job tidies up ----------------------------------------------------------------------------------------


def test_a_complete_job_removes_its_checkpoint_and_an_empty_errors_file(
    triton_server: LocalTriton, tmp_path: Path
) -> None:
    source = tmp_path / "rows.jsonl"
    probe_rows(source, 20)
    base = ["--model", "score_probe", "--input", str(source), "--url", triton_server.grpc_url, "--no-progress"]
    done = cli([*base, "--output", str(tmp_path / "a.jsonl")])
    assert done.returncode == 0, done.stderr
    assert files(tmp_path) == ["a.jsonl", "rows.jsonl"]
    assert "no errors file (no row failed)" in done.stdout
    assert [json.loads(line)["Y"] for line in (tmp_path / "a.jsonl").read_text().splitlines()] == \
        [[3.0 * i] for i in range(20)]
    # Re-run: the output is no longer vouched for, and the one line says how to keep it next time.
    again = cli([*base, "--output", str(tmp_path / "a.jsonl")])
    assert again.returncode == 15
    line = one_line(again.stderr)
    assert "--keep-checkpoint" in line
    assert "--overwrite" in line
    # Failed rows: their errors file stays, the checkpoint goes.
    probe_rows(source, 6, bad=frozenset({2}))
    failed = cli([*base, "--output", str(tmp_path / "b.jsonl"), "--max-failed", "1"])
    assert failed.returncode == 0, failed.stderr
    assert files(tmp_path) == ["a.jsonl", "b.jsonl", "b.jsonl.errors.jsonl", "rows.jsonl"]
    # --keep-checkpoint: both stay, and a re-run of the finished job does nothing.
    kept = cli([*base, "--output", str(tmp_path / "c.jsonl"), "--keep-checkpoint", "--max-failed", "1"])
    assert kept.returncode == 0, kept.stderr
    assert {"c.jsonl.checkpoint.json", "c.jsonl.errors.jsonl"} <= set(files(tmp_path))
    rerun = cli([*base, "--output", str(tmp_path / "c.jsonl"), "--keep-checkpoint", "--max-failed", "1"])
    assert rerun.returncode == 0, rerun.stderr
    assert counts(rerun.stdout) == (0, 0, 0)
    assert "resumed after 6 rows" in rerun.stdout


def test_keep_checkpoint_is_in_help() -> None:
    done = cli(["--help"])
    assert done.returncode == 0
    assert "--keep-checkpoint" in done.stdout
    assert "--keep COLUMN" in done.stdout
    assert "--allow-lossy" in done.stdout


# -- --keep ----------------------------------------------------------------------------------------------------------


def test_keep_carries_input_columns_to_jsonl(triton_server: LocalTriton, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    rows = [{"id": "a", "X": [1.0, 0.0], "n": 1}, {"id": 7, "X": [2.0, 0.0], "n": 2}, {"X": [3.0, 0.0], "n": 3},
            {"id": "bad", "X": [-1.0, 0.0], "n": 4}, {"id": "e", "X": [5.0, 0.0], "n": 5}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    done = cli(["--model", "score_probe", "--input", str(source), "--output", str(out), "--keep", "id",
                "--keep", "n,id", "--max-failed", "1", "--url", triton_server.grpc_url, "--no-progress",
                "--batch-size", "2"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert counts(done.stdout) == (5, 4, 1)
    assert [json.loads(line) for line in out.read_text().splitlines()] == [
        {"row": 0, "id": "a", "n": 1, "Y": [3.0]},
        {"row": 1, "id": 7, "n": 2, "Y": [6.0]},
        {"row": 2, "id": None, "n": 3, "Y": [9.0]},  # a row without the field keeps null
        {"row": 4, "id": "e", "n": 5, "Y": [15.0]},
    ]


def test_keep_carries_csv_text_and_writes_parquet(triton_server: LocalTriton, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    source = tmp_path / "rows.csv"
    source.write_text('id,X\n007,"[1.0, 0.0]"\n8,"[2.0, 0.0]"\n')
    out = tmp_path / "out.parquet"
    done = cli(["--model", "score_probe", "--input", str(source), "--output", str(out), "--keep", "id",
                "--output-name", "Y", "--url", triton_server.grpc_url, "--no-progress"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out).to_pylist()
    assert table == [{"row": 0, "id": "007", "Y": [3.0]}, {"row": 1, "id": "8", "Y": [6.0]}]  # cells as written
