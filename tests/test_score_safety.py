"""Scoring never destroys data: paths checked before anything is opened, checkpoints that must agree with their
files, in-memory sources that resume only when asked, long lines as error rows, and a CLI whose every mistake is one
line on stderr with its own exit code, found before any server starts.

"No server started" is observed, not inferred: the CLI runs without ``--url`` with ``$TRITONSERVER`` pointing to a
tripwire script that records each start in a marker file (a control test shows the tripwire fires when the CLI does
start a server), or with ``--url`` pointing to a listening socket of the test's own, whose backlog shows any
connection the CLI made.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from triton_npu_client import Client, LocalTriton, RowParseError, ScoreSummary, score, score_sync
from triton_npu_client._jobs import (
    CheckpointFilesMismatch,
    CheckpointMismatch,
    OutputExistsError,
    ResumableOutput,
    ResumeNotConfirmed,
    SameFileError,
    plan_job,
)
from triton_npu_client._jobs.formats import BadRow, open_writer, read_rows
from triton_npu_client.cli._score import EXIT_CODES


def write_rows(path: Path, n: int, *, delay_ms: float = 0.0, bad: frozenset[int] | set[int] = frozenset()) -> None:
    lines = []
    for i in range(n):
        if i in bad:
            lines.append(json.dumps({"X": [-1.0, 0.0]}))  # the model refuses it
        else:
            lines.append(json.dumps({"X": [float(i), delay_ms]}))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    write_rows(path, 40)
    return path


async def run_score(server: LocalTriton, src: Any, out: Path, **options: Any) -> ScoreSummary:
    async with Client(server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        return await score(model, src, out, progress=False, **options)


def scored(out: Path) -> list[tuple[int, float]]:
    return [(r["row"], r["Y"][0]) for r in map(json.loads, out.read_text().splitlines())]


# -- 1. paths ------------------------------------------------------------------------------------------------------


def input_as_output(source: Path, how: str) -> tuple[Path, Path, dict[str, Any]]:
    """(input, output, options) where a job path is the input in the way ``how`` says."""
    out: Path = source
    options: dict[str, Any] = {}
    if how == "relative path":
        out = Path(os.path.relpath(source))
    elif how == "symlink":
        out = source.with_name("link.jsonl")
        out.symlink_to(source)
    elif how == "hard link":
        out = source.with_name("hard.jsonl")
        os.link(source, out)
    elif how == "as errors":
        out, options = source.with_name("out.jsonl"), {"errors": source}
    elif how == "as checkpoint":
        # An input named as this output's checkpoint would be.
        out = source.with_name("out.jsonl")
        source = source.rename(source.with_name("out.jsonl.checkpoint.json"))
        options = {"input_format": "jsonl"}
    return source, out, options


@pytest.mark.parametrize("how", ["same path", "relative path", "symlink", "hard link", "as errors", "as checkpoint"])
async def test_the_input_is_never_an_output(triton_server: LocalTriton, source: Path, how: str) -> None:
    source, out, options = input_as_output(source, how)
    before = source.read_bytes()
    for overwrite in (False, True):  # never the input, overwrite or not
        with pytest.raises(SameFileError, match="input") as info:
            await run_score(triton_server, source, out, overwrite=overwrite, **options)
        assert info.value.other_role == "input"
        assert source.read_bytes() == before


async def test_output_errors_and_checkpoint_are_three_files(triton_server: LocalTriton, source: Path) -> None:
    out = source.with_name("out.jsonl")
    with pytest.raises(SameFileError, match="errors file"):
        await run_score(triton_server, source, out, errors=out)
    with pytest.raises(SameFileError, match="checkpoint"):
        await run_score(triton_server, source, out, errors=source.with_name("out.jsonl.checkpoint.json"))
    assert not out.exists()


async def test_a_symlinked_output_never_truncates_its_target(triton_server: LocalTriton, source: Path) -> None:
    target = source.with_name("precious.jsonl")
    target.write_text("keep me\n")
    out = source.with_name("out.jsonl")
    out.symlink_to(target)
    with pytest.raises(OutputExistsError, match="symbolic link"):
        await run_score(triton_server, source, out)
    assert target.read_text() == "keep me\n"
    assert out.is_symlink()
    # overwrite replaces the link itself, never what it points to.
    summary = await run_score(triton_server, source, out, overwrite=True)
    assert summary.rows_ok == 40
    assert target.read_text() == "keep me\n"
    assert not out.is_symlink()
    assert scored(out) == [(i, 3.0 * i) for i in range(40)]


@pytest.mark.parametrize("which", ["output", "errors"])
async def test_an_existing_file_the_job_did_not_write_is_refused(
    triton_server: LocalTriton, source: Path, which: str
) -> None:
    out = source.with_name("out.jsonl")
    existing = out if which == "output" else source.with_name("out.jsonl.errors.jsonl")
    existing.write_text("someone's data\n")
    with pytest.raises(OutputExistsError, match="did not write it") as info:
        await run_score(triton_server, source, out)
    assert info.value.role == which
    assert existing.read_text() == "someone's data\n"
    assert not source.with_name("out.jsonl.checkpoint.json").exists()
    summary = await run_score(triton_server, source, out, overwrite=True)
    assert summary.rows_ok == 40
    assert scored(out) == [(i, 3.0 * i) for i in range(40)]


async def test_a_file_that_is_not_a_checkpoint_is_not_the_jobs(triton_server: LocalTriton, source: Path) -> None:
    out = source.with_name("out.jsonl")
    ckpt = source.with_name("out.jsonl.checkpoint.json")
    ckpt.write_text("[1, 2, 3]")
    with pytest.raises(OutputExistsError, match="not a scoring checkpoint"):
        await run_score(triton_server, source, out)
    assert ckpt.read_text() == "[1, 2, 3]"
    summary = await run_score(triton_server, source, out, overwrite=True)
    assert summary.complete


async def test_a_job_the_checkpoint_vouches_for_resumes_and_another_jobs_is_refused(
    triton_server: LocalTriton, source: Path
) -> None:
    out = source.with_name("out.jsonl")
    first = await run_score(triton_server, source, out)
    again = await run_score(triton_server, source, out)  # the files exist, and are this job's
    assert (first.rows_ok, again.rows, again.resumed_from) == (40, 0, 40)
    write_rows(source, 30)  # the input changed: another job
    with pytest.raises(CheckpointMismatch, match="another job"):
        await run_score(triton_server, source, out)
    redone = await run_score(triton_server, source, out, overwrite=True)
    assert redone.rows_ok == 30
    assert scored(out) == [(i, 3.0 * i) for i in range(30)]


# -- 2. a checkpoint that disagrees with its files ----------------------------------------------------------------


SLOW = {"batch_size": 4, "concurrency": 2}


async def interrupted_job(server: LocalTriton, source: Path, out: Path) -> None:
    """Start a slow job on ``source`` and cancel it once its checkpoint has committed some rows."""
    ckpt = out.with_name(out.name + ".checkpoint.json")
    task = asyncio.create_task(run_score(server, source, out, commit_every_s=0.02, **SLOW))
    deadline = time.monotonic() + 120
    while not task.done() and time.monotonic() < deadline:
        try:
            if json.loads(ckpt.read_text())["rows"] > 0:
                break
        except (FileNotFoundError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.01)  # polling the checkpoint for the event we wait for
    assert not task.done(), "the job finished before it could be interrupted"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert json.loads(ckpt.read_text())["rows"] > 0


@pytest.mark.parametrize("damage", ["deleted", "cut short"])
async def test_an_output_lost_after_an_interrupted_job_is_an_error_not_nul_padding(
    triton_server: LocalTriton, tmp_path: Path, damage: str
) -> None:
    source = tmp_path / "rows.jsonl"
    write_rows(source, 800, delay_ms=10.0)
    out = tmp_path / "out.jsonl"
    await interrupted_job(triton_server, source, out)
    committed = json.loads(out.with_name("out.jsonl.checkpoint.json").read_text())["out_bytes"]
    assert committed > 0
    if damage == "deleted":
        out.unlink()
    else:
        os.truncate(out, committed // 2)
    with pytest.raises(CheckpointFilesMismatch, match=r"delete out\.jsonl\.checkpoint\.json to start over") as info:
        await run_score(triton_server, source, out, **SLOW)
    assert "restore out.jsonl" in str(info.value)
    # Nothing was written: no NUL bytes, no file made.
    if damage == "deleted":
        assert not out.exists()
    else:
        assert b"\0" not in out.read_bytes()
        assert out.stat().st_size == committed // 2
    # The way out the message gives: start over (overwrite, or delete the checkpoint).
    done = await run_score(triton_server, source, out, overwrite=True, **SLOW)
    assert (done.rows_ok, done.resumed_from) == (800, 0)
    assert scored(out) == [(i, 3.0 * i) for i in range(800)]


def test_a_checkpoint_whose_row_counts_do_not_fit_its_bytes_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    writer = open_writer(out, fingerprint="f", errors_path=tmp_path / "e.jsonl")
    writer.open()
    writer.write_error(0, ValueError("bad"))
    writer.commit(1)
    writer.abandon()
    ckpt = tmp_path / "out.jsonl.checkpoint.json"
    state = json.loads(ckpt.read_text())
    state["err_bytes"] = 0  # one failed row counted in no bytes
    ckpt.write_text(json.dumps(state))
    with pytest.raises(CheckpointFilesMismatch, match="1 failed rows in 0 bytes"):
        open_writer(out, fingerprint="f", errors_path=tmp_path / "e.jsonl").open()
    # ResumableOutput alone never grows a file either.
    plain = tmp_path / "plain.txt"
    job = ResumableOutput(plain, fingerprint="g")
    job.open()
    job.write(b"abc\n")
    job.commit(1)
    job.abandon()
    plain.unlink()
    with pytest.raises(CheckpointFilesMismatch, match="missing"):
        ResumableOutput(plain, fingerprint="g").open()
    assert not plain.exists()


# -- 3. in-memory sources resume only when asked ----------------------------------------------------------------


def test_score_sync_with_changed_rows_is_not_resumed_silently(triton_server: LocalTriton, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    url = triton_server.grpc_url
    first = score_sync(url, "score_probe", [{"X": [float(i), 0.0]} for i in range(5)], out, progress=False)
    assert first.rows_ok == 5
    changed = [{"X": [float(10 + i), 0.0]} for i in range(7)]
    with pytest.raises(ResumeNotConfirmed, match="resume=True"):
        score_sync(url, "score_probe", changed, out, progress=False)
    assert scored(out) == [(i, 3.0 * i) for i in range(5)]  # untouched
    redone = score_sync(url, "score_probe", changed, out, progress=False, overwrite=True)
    assert (redone.rows_ok, redone.resumed_from) == (7, 0)
    assert scored(out) == [(i, 3.0 * (10 + i)) for i in range(7)]
    resumed = score_sync(url, "score_probe", changed, out, progress=False, resume=True)
    assert (resumed.rows, resumed.resumed_from, resumed.complete) == (0, 7, True)


# -- 5. long lines ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "txt"])
def test_a_line_longer_than_the_cap_is_an_error_row_read_in_bounded_memory(tmp_path: Path, fmt: str) -> None:
    huge = 24 << 20  # 24 MiB on one line; the cap is 64 KiB
    path = tmp_path / f"rows.{fmt}"
    with open(path, "wb") as f:
        if fmt == "csv":
            f.write(b"X\n1\n")
        elif fmt == "jsonl":
            f.write(b'{"X": 1}\n')
        else:
            f.write(b"one\n")
        f.write(b"7" * huge + b"\n")
        f.write(b"3\n" if fmt != "jsonl" else b'{"X": 3}\n')
    tracemalloc.start()
    try:
        rows = list(read_rows(path, input_names=["X"], max_line_bytes=64 << 10))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(rows) == 3
    assert isinstance(rows[1], BadRow)
    assert "longer than 65,536" in rows[1].reason
    assert "line 2" in rows[1].reason or "line 3" in rows[1].reason
    assert not isinstance(rows[0], BadRow)
    assert not isinstance(rows[2], BadRow)
    assert peak < 4 << 20, f"reading held {peak:,} bytes at once"
    assert read_rows(path, input_names=["X"], max_line_bytes=64 << 10).total == 3
    # Resuming after the long line counts it as the row it is.
    assert list(read_rows(path, input_names=["X"], start=2, max_line_bytes=64 << 10)) == [rows[2]]


async def test_score_records_a_long_line_as_an_error_row(triton_server: LocalTriton, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    lines = [json.dumps({"X": [float(i), 0.0]}) for i in range(6)]
    lines[2] = json.dumps({"X": [2.0, 0.0], "pad": "x" * 5000})
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    summary = await run_score(triton_server, source, out, max_line_bytes=1000)
    assert (summary.rows_ok, summary.rows_failed) == (5, 1)
    (error,) = map(json.loads, summary.errors.read_text().splitlines())
    assert (error["row"], error["error"]) == (2, RowParseError.__name__)
    assert "longer than 1,000 bytes" in error["message"]


# -- 4. the CLI -------------------------------------------------------------------------------------------------


TRIPWIRE = """#!/bin/sh
echo started >> "$TNC_TEST_TRIPWIRE"
exit 1
"""


@pytest.fixture
def tripwire(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose $TRITONSERVER records each start in a marker file (and then fails)."""
    binary = tmp_path / "bin" / "tritonserver"
    binary.parent.mkdir()
    binary.write_text(TRIPWIRE)
    binary.chmod(0o755)
    marker = tmp_path / "tritonserver-started"
    env = dict(os.environ, TRITONSERVER=str(binary), TNC_TEST_TRIPWIRE=str(marker))
    return env, marker


def cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "score", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_the_tripwire_fires_when_the_cli_starts_a_server(
    tripwire: tuple[dict[str, str], Path], source: Path
) -> None:
    """The control for the tests below: a good command does try to start a server, and the tripwire sees it."""
    env, marker = tripwire
    done = cli(["--model", "score_probe", "--input", str(source), "--output", str(source.with_name("o.jsonl")),
                "--startup-timeout", "60"], env)
    assert marker.exists(), done.stderr
    assert done.returncode == 20, done.stderr  # an embedded server that failed to start
    assert "Traceback" not in done.stderr


def config_mistake(case: str, tmp: Path, src: Path, out: Path) -> tuple[list[str], int, str] | None:
    """The mistakes only the model's config shows (issue 25): found in the packaged repository's config.pbtxt,
    before the embedded server starts. None: ``case`` is not one of them."""
    text = tmp / "sentences.txt"
    text.write_text("one\ntwo words\n")
    tokens = ["--model", "minilm_tokenizer", "--input", str(text)]
    if case == "several outputs into one .npy":  # before: a traceback after the server, an empty .npy left behind
        return [*tokens, "--output", str(tmp / "tok.npy")], 2, "gives 2 outputs (INPUT_IDS, ATTENTION_MASK)"
    if case == "an output the model lacks":
        return [*tokens, "--output", str(out), "--output-name", "IDS"], 2, "has no output 'IDS'"
    if case == "batch size over the model's max":
        return ["--model", "score_probe", "--input", str(src), "--output", str(out), "--batch-size", "100000"], 2, \
            "--batch-size must be in [1, 16]"
    if case == "a stateful model":
        return ["--model", "chat", "--input", str(text), "--output", str(out)], 2, "'chat' is stateful"
    if case == "a decoupled model":
        return ["--model", "repeat_int32", "--input", str(src), "--output", str(out)], 2, "is decoupled"
    if case == "a float64 .npy for an FP32 input":
        np.save(tmp / "x.npy", np.zeros((4, 2)))
        return ["--model", "score_probe", "--input", str(tmp / "x.npy"), "--output", str(out)], 2, \
            "expected FP32, given float64: narrowing a numpy float array loses precision; cast it yourself or pass " \
            "--allow-lossy"
    if case == "a .npy of rows of another shape":
        np.save(tmp / "x.npy", np.zeros((4, 3), np.float32))
        return ["--model", "score_probe", "--input", str(tmp / "x.npy"), "--output", str(out)], 2, \
            "rows of shape (3,)): every row would fail"
    if case == "text lines for a numeric input":
        return ["--model", "score_probe", "--input", str(text), "--output", str(out)], 2, "every row would fail"
    if case == "no CSV column is an input":
        (tmp / "rows.csv").write_text("id,TEXT2\n1,a\n")
        return ["--model", "minilm", "--input", str(tmp / "rows.csv"), "--output", str(out)], 11, \
            "no header column (id, TEXT2) is an input of the model (TEXT)"
    if case == "a CSV without a column for one input":
        (tmp / "rows.csv").write_text('id,INPUT_IDS\n1,"[1, 2]"\n')
        return ["--model", "minilm_encoder", "--input", str(tmp / "rows.csv"), "--output", str(out)], 2, \
            "no column for input 'ATTENTION_MASK' of model 'minilm_encoder' (its inputs: INPUT_IDS, ATTENTION_MASK; " \
            "the file's columns id are not inputs)"
    if case == "a Parquet file without a column for the input":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [1, 2], "X2": [[1.0, 2.0], [3.0, 4.0]]}), tmp / "rows.parquet")
        return ["--model", "score_probe", "--input", str(tmp / "rows.parquet"), "--output", str(out)], 11, \
            "no column (id, X2) is an input of the model (X)"
    if case == "--keep a column the input lacks":
        (tmp / "rows.csv").write_text('X\n"[1, 2]"\n')
        return ["--model", "score_probe", "--input", str(tmp / "rows.csv"), "--output", str(out), "--keep", "id"], 2, \
            "no column 'id' for --keep"
    if case == "--keep into a .npy":
        return ["--model", "score_probe", "--input", str(src), "--output", str(tmp / "y.npy"), "--keep", "id"], 2, \
            "not the input columns of --keep"
    if case == "--keep from a text file":
        return [*tokens, "--output", str(out), "--keep", "id"], 2, "--keep takes named columns of the input"
    if case == "--keep a column named like an output":
        return ["--model", "score_probe", "--input", str(src), "--output", str(out), "--keep", "Y"], 2, \
            "--keep column 'Y' is named like a column of the output"
    return None


CONFIG_MISTAKES = [
    "several outputs into one .npy", "an output the model lacks", "batch size over the model's max",
    "a stateful model", "a decoupled model", "a float64 .npy for an FP32 input", "a .npy of rows of another shape",
    "text lines for a numeric input", "no CSV column is an input", "a CSV without a column for one input",
    "a Parquet file without a column for the input", "--keep a column the input lacks", "--keep into a .npy",
    "--keep from a text file", "--keep a column named like an output",
]

# A keyword argument as Python spells it (overwrite=True, outputs=[...], format=): the CLI names flags instead.
PYTHON_WORDS = re.compile(r"\b[a-z_]+=(True|False|\[|\.\.\.|\s|$)|\b[a-z_]+\(\)")


def make_mistake(case: str, tmp: Path) -> tuple[list[str], int, str]:
    """(the CLI's arguments, the exit code, a phrase of the one stderr line) for one user mistake."""
    src = tmp / "rows.jsonl"
    write_rows(src, 10)
    out = tmp / "out.jsonl"
    base = ["--model", "score_probe", "--input", str(src), "--output", str(out)]
    if case == "missing input":
        missing = tmp / "nope.jsonl"
        return ["--model", "score_probe", "--input", str(missing), "--output", str(out)], 10, "does not exist"
    if case == "input is a directory":
        (tmp / "dir.jsonl").mkdir()
        return ["--model", "score_probe", "--input", str(tmp / "dir.jsonl"), "--output", str(out)], 11, "directory"
    if case == "csv without header":
        (tmp / "empty.csv").write_text("\n\n")
        return ["--model", "score_probe", "--input", str(tmp / "empty.csv"), "--output", str(out)], 11, "no header"
    if case == "unknown input suffix":
        (tmp / "rows.xml").write_text("<rows/>")
        return ["--model", "score_probe", "--input", str(tmp / "rows.xml"), "--output", str(out)], 12, "'.xml'"
    if case == "unknown output suffix":
        return ["--model", "score_probe", "--input", str(src), "--output", str(tmp / "out.xlsx")], 13, "'.xlsx'"
    if case == "output is the input":
        return ["--model", "score_probe", "--input", str(src), "--output", str(src)], 14, "is the input"
    if case == "output links to the input":
        (tmp / "link.jsonl").symlink_to(src)
        return ["--model", "score_probe", "--input", str(src), "--output", str(tmp / "link.jsonl"), "--overwrite"], \
            14, "symbolic link to the input"
    if case == "errors is the output":
        return [*base, "--errors", str(out)], 14, "same file"
    if case == "existing output":
        out.write_text("not yours\n")
        return base, 15, "--overwrite"
    if case == "symlinked output":
        (tmp / "target.jsonl").write_text("keep\n")
        out.symlink_to(tmp / "target.jsonl")
        return base, 15, "symbolic link"
    if case == "checkpoint of another job":
        job = ResumableOutput(out, fingerprint="jsonl:/elsewhere:1:1;model=other;batch=None;outputs=None",
                              errors_path=tmp / "out.jsonl.errors.jsonl")
        job.open()
        job.commit(0)
        job.close()
        return base, 16, "another job"
    if case == "checkpoint disagrees with its files":
        plan = plan_job(src, out, model="score_probe")
        writer = plan.writer
        writer.open()
        writer.write(0, {"Y": __import__("numpy").array([0.0], "float32")})
        writer.commit(1)
        writer.abandon()
        out.unlink()
        return base, 17, "start over"
    if case == "output folder missing":
        return ["--model", "score_probe", "--input", str(src), "--output", str(tmp / "no" / "out.jsonl")], 19, \
            "does not exist"
    if case == "unknown packaged model":
        return ["--model", "no_such_model", "--input", str(src), "--output", str(out)], 18, "no_such_model"
    model_mistake = config_mistake(case, tmp, src, out)
    if model_mistake is not None:
        return model_mistake
    numbers = {
        "concurrency 0": ["--concurrency", "0"],
        "batch size not a number": ["--batch-size", "many"],
        "commit every nan": ["--commit-every", "nan"],
        "max failed negative": ["--max-failed", "-1"],
        "max failed over 100%": ["--max-failed", "150%"],
        "max line bytes 0": ["--max-line-bytes", "0"],
        "missing --output": None,
    }
    if case == "missing --output":
        return ["--model", "score_probe", "--input", str(src)], 2, "--output"
    extra = numbers[case]
    assert extra is not None
    return [*base, *extra], 2, extra[0]


MISTAKES = [
    "missing input", "input is a directory", "csv without header", "unknown input suffix", "unknown output suffix",
    "output is the input", "output links to the input", "errors is the output", "existing output", "symlinked output",
    "checkpoint of another job", "checkpoint disagrees with its files", "output folder missing",
    "unknown packaged model", "concurrency 0",
    "batch size not a number", "commit every nan", "max failed negative", "max failed over 100%", "max line bytes 0",
    "missing --output", *CONFIG_MISTAKES,
]


@pytest.mark.parametrize("case", MISTAKES)
def test_each_cli_mistake_is_one_line_and_its_own_exit_code_before_any_server(
    tripwire: tuple[dict[str, str], Path], tmp_path: Path, case: str
) -> None:
    env, marker = tripwire
    work = tmp_path / "work"
    work.mkdir()
    args, code, phrase = make_mistake(case, work)
    files_before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file() and not p.is_symlink()}
    done = cli(args, env)
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("triton-npu score: "), lines
    assert phrase in lines[0]
    assert not PYTHON_WORDS.search(lines[0]), lines[0]  # flags, not keyword arguments
    assert done.returncode == code, lines[0]
    assert code in EXIT_CODES
    assert done.stdout == ""
    assert not marker.exists(), "a tritonserver was started"
    # Nothing was touched: every file is as it was.
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file() and not p.is_symlink()} == files_before


def test_cli_help_lists_the_exit_codes() -> None:
    done = cli(["--help"])
    assert done.returncode == 0
    listed = {int(m.group(1)) for m in re.finditer(r"^\s+(\d+)  \S", done.stdout, re.MULTILINE)}
    assert listed == set(EXIT_CODES)


def listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def connected(sock: socket.socket) -> bool:
    """Whether a connection waits in the listener's backlog (the kernel completes it without an accept)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


@pytest.mark.parametrize("case", ["missing input", "unknown output suffix", "checkpoint of another job"])
def test_with_url_the_mistakes_are_found_before_connecting(tmp_path: Path, case: str) -> None:
    """The three that printed a traceback after reaching the server: now one line, and no connection made."""
    sock = listener()
    try:
        args, code, phrase = make_mistake(case, tmp_path)
        done = cli([*args, "--url", f"grpc://127.0.0.1:{sock.getsockname()[1]}"])
        assert done.returncode == code, done.stderr
        assert len(done.stderr.splitlines()) == 1
        assert phrase in done.stderr
        assert not connected(sock)
    finally:
        sock.close()


def test_the_listener_sees_a_cli_that_does_connect(tmp_path: Path, source: Path) -> None:
    """The control for the test above: a good command connects to its --url, and the backlog shows it."""
    sock = listener()
    proc = subprocess.Popen(
        [sys.executable, "-m", "triton_npu_client", "score", "--model", "score_probe", "--input", str(source),
         "--output", str(tmp_path / "o.jsonl"), "--url", f"grpc://127.0.0.1:{sock.getsockname()[1]}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        readable, _, _ = select.select([sock], [], [], 60)  # the event: a connection arrives
        assert readable
    finally:
        proc.kill()
        proc.wait()
        sock.close()


def test_a_job_whose_rows_failed_exits_3_within_its_tolerance_0(triton_server: LocalTriton, tmp_path: Path) -> None:
    src = tmp_path / "rows.jsonl"
    write_rows(src, 4, bad={0, 1, 2, 3})  # every row refused by the model
    out = tmp_path / "out.jsonl"
    # --keep-checkpoint: the finished job stays recognisable, so that its re-runs judge it again.
    base = ["--model", "score_probe", "--input", str(src), "--output", str(out), "--url", triton_server.grpc_url,
            "--no-progress", "--keep-checkpoint"]
    done = cli(base)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [
        f"triton-npu score: 4 of 4 rows failed, more than --max-failed 0 allows (0): see {out}.errors.jsonl"
    ]
    assert "0 ok, 4 failed" in done.stdout
    # Re-running the finished job judges the whole job, not the (empty) last run.
    assert cli(base).returncode == 3
    assert cli([*base, "--max-failed", "4"]).returncode == 0
    assert cli([*base, "--max-failed", "100%"]).returncode == 0
    assert cli([*base, "--max-failed", "0.5"]).returncode == 3
    src2 = tmp_path / "rows2.jsonl"
    write_rows(src2, 4, bad={1})
    out2 = tmp_path / "out2.jsonl"
    base2 = ["--model", "score_probe", "--input", str(src2), "--output", str(out2), "--url", triton_server.grpc_url,
             "--keep-checkpoint"]
    assert cli([*base2, "--max-failed", "25%"]).returncode == 0
    assert cli([*base2, "--max-failed", "0.2"]).returncode == 3


async def test_resuming_with_another_errors_file_never_cuts_it(triton_server: LocalTriton, tmp_path: Path) -> None:
    """The checkpoint vouches for the errors file it was written with, not for whatever --errors names next."""
    source = tmp_path / "rows.jsonl"
    write_rows(source, 800, delay_ms=10.0, bad={3})
    out = tmp_path / "out.jsonl"
    await interrupted_job(triton_server, source, out)
    unrelated = tmp_path / "notes.jsonl"
    unrelated.write_text("someone's notes\n")
    with pytest.raises(CheckpointMismatch, match="errors file"):
        await run_score(triton_server, source, out, errors=unrelated, **SLOW)
    assert unrelated.read_text() == "someone's notes\n"
    done = await run_score(triton_server, source, out, **SLOW)  # the same paths as before: it resumes
    assert done.resumed_from > 0
    assert done.job_rows_failed == 1
    assert scored(out) == [(i, 3.0 * i) for i in range(800) if i != 3]
