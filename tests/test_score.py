"""score_rows / score(): packing, order under concurrency, per-row errors, isolation, a server restart mid-job.

Against the real server: ``score_probe`` (Y = 3 * X[0], each request sleeps max(X[1]) ms on one of 3 instances, so
requests finish out of order; a negative X[0] fails its whole request) and ``scale_fp32`` (dynamic batching).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import numpy as np
import pytest
from _stats import stats_after

from triton_npu_client import (
    BatchSizeError,
    Client,
    InputDtypeError,
    InputShapeError,
    InternalServerError,
    LocalTriton,
    MissingInputError,
    RowParseError,
    ScoredRow,
    UsageError,
    score,
    score_rows,
    score_sync,
)
from triton_npu_client._jobs.formats import BadRow


def probe_rows(n: int, *, delay_ms: float = 0.0, seed: int = 0) -> list[dict[str, list[float]]]:
    rng = np.random.default_rng(seed)
    return [{"X": [float(i), float(rng.uniform(0, delay_ms)) if delay_ms else 0.0]} for i in range(n)]


async def collect(it: AsyncIterator[ScoredRow]) -> list[ScoredRow]:
    return [row async for row in it]



async def test_order_is_kept_when_requests_finish_out_of_order(triton_server: LocalTriton) -> None:
    """Rows in requests of 5 at 8 in flight on 3 instances, random sleeps: row i still carries 3*i, in order."""
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        (before,) = await client.inference_statistics("score_probe")
        rows = probe_rows(300, delay_ms=15.0)
        out = await collect(score_rows(model, rows, concurrency=8, batch_size=5))
        after = await stats_after(client, "score_probe", before, 300)
    assert [r.index for r in out] == list(range(300))
    assert all(r.ok for r in out)
    got = np.array([r.outputs["Y"][0] for r in out if r.outputs is not None])
    np.testing.assert_array_equal(got, 3.0 * np.arange(300, dtype=np.float32))
    # 60 requests of 5 rows: packed as asked, nothing sent twice.
    assert after.success_count - before.success_count == 60
    assert after.inference_count - before.inference_count == 300


async def test_an_input_larger_than_max_batch_size_is_split(triton_server: LocalTriton) -> None:
    """infer_batch refuses 200 rows (max_batch_size 64); score_rows sends them as 64+64+64+8."""
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        rows = probe_rows(200)
        with pytest.raises(BatchSizeError):
            await model.infer_batch(X=np.array([r["X"] for r in rows], np.float32))
        (before,) = await client.inference_statistics("score_probe")
        out = await collect(score_rows(model, rows, concurrency=2))
        after = await stats_after(client, "score_probe", before, 200)
    assert [r.index for r in out] == list(range(200))
    assert after.success_count - before.success_count == math.ceil(200 / 16)  # score_probe's max is 16
    assert all(r.outputs is not None and r.outputs["Y"][0] == 3.0 * r.index for r in out)


async def test_bad_rows_become_typed_errors_and_the_rest_go_on(triton_server: LocalTriton) -> None:
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        rows: list[object] = [dict(r) for r in probe_rows(40)]
        rows[3] = {"X": ["a", "b"]}  # BYTES given to an FP32 input
        rows[7] = {"X": [1.0, 2.0, 3.0]}  # 3 values for dims [2]
        rows[11] = {"Y": [1.0, 0.0]}  # no X (a key that is not an input is a record's own field, left behind)
        rows[12] = {}  # no X
        rows[17] = BadRow("line 18: Expecting value")  # a line the reader could not parse
        rows[23] = {"X": [-5.0, 0.0]}  # the model refuses it: its whole request fails, then isolation finds it
        rows[24] = [24.0, 0.0]  # a bare value: fine for a one-input model
        out = await collect(score_rows(model, rows, concurrency=3, batch_size=8))
    assert [r.index for r in out] == list(range(40))
    errors = {r.index: r.error for r in out if not r.ok}
    assert set(errors) == {3, 7, 11, 12, 17, 23}
    assert isinstance(errors[3], InputDtypeError)
    assert errors[3].input_name == "X"
    assert isinstance(errors[7], InputShapeError)
    assert "[2]" in str(errors[7])
    assert "[3]" in str(errors[7])
    assert isinstance(errors[11], MissingInputError)
    assert errors[11].input_name == "X"
    assert isinstance(errors[12], MissingInputError)
    assert errors[12].input_name == "X"
    assert isinstance(errors[17], RowParseError)
    assert "line 18" in str(errors[17])
    assert isinstance(errors[23], InternalServerError)
    assert "negative" in str(errors[23])
    for r in out:
        if r.ok:
            assert r.outputs is not None
            assert r.outputs["Y"][0] == 3.0 * r.index
        else:
            assert r.outputs is None
    # The failed row keeps its input, for the errors file.
    assert out[23].input == {"X": [-5.0, 0.0]}


async def test_a_stateful_or_unbatched_model_is_refused_before_sending(triton_server: LocalTriton) -> None:
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        for name, words in (("seq_stats_oldest", "stateful"), ("slow_echo", "max_batch_size 0")):
            model = await client.model(name)
            with pytest.raises(UsageError, match=words):
                await collect(score_rows(model, [1.0]))


async def test_score_writes_the_output_and_errors_files(triton_server: LocalTriton, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    lines = [json.dumps({"X": [float(i), 0.0]}) for i in range(50)]
    lines[5] = "{not json"
    lines[9] = json.dumps({"X": [-1.0, 0.0]})
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "scores.jsonl"
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        summary = await score(model, source, output, concurrency=3, batch_size=4, progress=False)
        again = await score(model, source, output, concurrency=3, batch_size=4, progress=False)
    assert (summary.rows_ok, summary.rows_failed, summary.resumed_from, summary.complete) == (48, 2, 0, True)
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert [w["row"] for w in written] == [i for i in range(50) if i not in (5, 9)]
    assert all(w["Y"] == [3.0 * w["row"]] for w in written)
    errors = [json.loads(line) for line in summary.errors.read_text().splitlines()]
    assert [(e["row"], e["error"]) for e in errors] == [(5, "RowParseError"), (9, "InternalServerError")]
    assert "negative" in errors[1]["message"]
    # Running a finished job again scores nothing and changes nothing.
    assert again.rows == 0
    assert again.resumed_from == 50
    assert [json.loads(line) for line in output.read_text().splitlines()] == written


async def test_a_server_crash_and_restart_mid_job_loses_nothing(tmp_path: Path) -> None:
    """The job's server is SIGKILLed while requests sleep in it, then started again on the same ports.

    Rows 104-143 make the server sleep 1.5 s, so when the consumer reaches row 100 (its request, rows 100-103, is
    quick) the requests behind it are in flight: they fail with the crash, keep failing while the server is down
    (longer than the client's own quick retries), and succeed once it is back. Nothing becomes an error row; every
    row arrives once, in order.
    """
    servers = [LocalTriton(model_control_mode="explicit", load_models=["score_probe"])]
    rows = probe_rows(400, delay_ms=4.0, seed=3)
    for row in rows[104:144]:
        row["X"][1] = 1500.0
    out: list[ScoredRow] = []
    try:
        first = await servers[0].astart()
        ports = {"http_port": first.http_port, "grpc_port": first.grpc_port, "metrics_port": first.metrics_port}
        async with Client(first.grpc_url, timeout_s=60) as client:
            model = await client.model("score_probe")
            async for scored in score_rows(model, rows, concurrency=4, batch_size=4, patience_s=120):
                out.append(scored)
                if scored.index == 100:
                    # The consumer stops pulling while the server is down: only the requests in flight fail.
                    assert first.pid is not None
                    os.killpg(first.pid, signal.SIGKILL)
                    await first.astop()
                    # A server that died "on its own" keeps its log for a post-mortem; this death was planned.
                    assert first.log_path is not None
                    shutil.rmtree(first.log_path.parent, ignore_errors=True)
                    servers.append(LocalTriton(model_control_mode="explicit", load_models=["score_probe"], **ports))
                    await servers[1].astart()
            # The chunk holding row 100 (rows 100-103) was answered before the crash; rows 104-399 were not.
            (zero,) = await client.inference_statistics("score_probe")
            stats = await stats_after(client, "score_probe", attrs.evolve(zero, inference_count=0), 296)
    finally:
        for server in servers:
            await server.astop()
    assert len(servers) == 2
    assert [r.index for r in out] == list(range(400))
    assert all(r.ok for r in out), [r.error for r in out if not r.ok][:3]
    got = np.array([r.outputs["Y"][0] for r in out if r.outputs is not None])
    np.testing.assert_array_equal(got, 3.0 * np.arange(400, dtype=np.float32))
    # The new server (its counters start at zero) served the requests that were in flight at the crash and the
    # rest of the job, each exactly once.
    assert stats.inference_count == 296


async def test_shared_memory_gives_the_same_rows(triton_server: LocalTriton) -> None:
    """score_rows(shared_memory=True): the same outputs as the plain path, and nothing left registered after."""
    rows = [{"INPUT0": np.arange(1000, dtype=np.float32) + i} for i in range(50)]
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("scale_fp32")
        plain = await collect(score_rows(model, rows, concurrency=3, batch_size=8))
        shm = await collect(score_rows(model, rows, concurrency=3, batch_size=8, shared_memory=True))
        status = await client.transport.system_shared_memory_status(timeout_s=10)
        left = [r["name"] for r in status if f"-{os.getpid()}-" in r["name"]]
    assert [r.index for r in shm] == list(range(50))
    for a, b in zip(plain, shm, strict=True):
        assert a.outputs is not None
        assert b.outputs is not None
        np.testing.assert_array_equal(a.outputs["OUTPUT0"], b.outputs["OUTPUT0"])
        np.testing.assert_array_equal(b.outputs["OUTPUT0"], 2 * rows[b.index]["INPUT0"])
    assert left == []


async def test_async_iterable_source_and_resume_skip(triton_server: LocalTriton, tmp_path: Path) -> None:
    """An async generator feeds score(); a second call with the same source skips the rows already done."""
    pulled: list[int] = []

    async def rows(n: int) -> AsyncIterator[dict[str, list[float]]]:
        for i in range(n):
            pulled.append(i)
            yield {"X": [float(i), 0.0]}

    output = tmp_path / "out.jsonl"
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        first = await score(model, rows(20), output, batch_size=4, progress=False)
        pulled.clear()
        # An iterable cannot be checked for changes: the caller says it yields the same rows.
        again = await score(model, rows(20), output, batch_size=4, progress=False, resume=True)
    assert (first.rows_ok, first.complete) == (20, True)
    assert again.rows == 0
    assert pulled == []  # a complete job does not even read its source
    assert [json.loads(line)["Y"] for line in output.read_text().splitlines()] == [[3.0 * i] for i in range(20)]


async def test_parquet_in_parquet_out_and_npy_in(triton_server: LocalTriton, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = [[float(i), 0.0] for i in range(70)]
    pq.write_table(pa.table({"X": x, "id": list(range(70))}), tmp_path / "in.parquet")
    np.save(tmp_path / "in.npy", np.array(x, dtype=np.float32))
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        a = await score(model, tmp_path / "in.parquet", tmp_path / "out.parquet", progress=False)
        b = await score(model, tmp_path / "in.npy", tmp_path / "out.npy", progress=False)
    assert (a.rows_ok, b.rows_ok) == (70, 70)
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column("row").to_pylist() == list(range(70))
    assert [y[0] for y in table.column("Y").to_pylist()] == [3.0 * i for i in range(70)]
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy")[:, 0], 3.0 * np.arange(70, dtype=np.float32))


def test_score_sync_for_scripts(triton_server: LocalTriton, tmp_path: Path) -> None:
    source = tmp_path / "rows.txt"
    source.write_text("".join(f"line {i}\n" for i in range(12)))
    summary = score_sync(triton_server.grpc_url, "minilm", source, tmp_path / "emb.npy", progress=False)
    embeddings = np.load(tmp_path / "emb.npy")
    assert summary.rows_ok == 12
    assert embeddings.shape == (12, 384)
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, rtol=1e-5)
    assert not np.allclose(embeddings[0], embeddings[1])
