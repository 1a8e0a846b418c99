"""The columnar path of scoring, and the one validator it shares with ``infer``/``infer_batch``.

Against the session's real server: ``score_probe`` (Y = 3 * X[0]; X has dims [2]) and ``scale_fp32`` (dynamic
batching, dims [-1]).
"""

from __future__ import annotations

import numpy as np
import pytest
from _stats import stats_after

from triton_npu_client import (
    Client,
    InputDtypeError,
    InputShapeError,
    LocalTriton,
    ScoredBatch,
    UsageError,
    score_batches,
    score_rows,
    validate_batch,
    validate_row,
)


async def test_a_column_batch_scores_like_its_rows(triton_server: LocalTriton) -> None:
    """score_batches (columns) and score_rows (the same rows one by one) agree row for row, bad rows included."""
    rng = np.random.default_rng(7)
    values: list[object] = [[float(i), 0.0] for i in range(90)]
    bad = sorted(rng.choice(90, size=6, replace=False).tolist())
    for i in bad[:3]:
        values[i] = [float(i), 0.0, 1.0]  # three numbers for dims [2]
    for i in bad[3:]:
        values[i] = ["x", "y"]  # text for FP32
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        batches = [part async for part in score_batches(model, [{"X": values[:50]}, {"X": values[50:]}],
                                                        batch_size=8, concurrency=3)]
        rows = [row async for row in score_rows(model, [{"X": v} for v in values], batch_size=8, concurrency=3)]
    from_batches = [row for part in batches for row in part.rows()]
    assert [r.index for r in from_batches] == [r.index for r in rows] == list(range(90))
    assert [r.ok for r in from_batches] == [r.ok for r in rows] == [i not in bad for i in range(90)]
    for a, b in zip(from_batches, rows, strict=True):
        if a.ok:
            assert a.outputs is not None
            assert b.outputs is not None
            np.testing.assert_array_equal(a.outputs["Y"], b.outputs["Y"])
            assert float(a.outputs["Y"][0]) == 3.0 * a.index
        else:
            assert type(a.error) is type(b.error)
            assert str(a.error) == str(b.error)
            assert a.input == {"X": values[a.index]} == b.input
    assert {type(r.error) for r in from_batches if not r.ok} == {InputShapeError, InputDtypeError}


async def test_runs_split_where_a_row_was_refused(triton_server: LocalTriton) -> None:
    """A chunk with a refused row: its good rows still travel together, and come back as two runs around it."""
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        (before,) = await client.inference_statistics("score_probe")
        column = [[0.0, 0.0], [1.0, 0.0], [2.0], [3.0, 0.0]]
        (part,) = [p async for p in score_batches(model, [{"X": column}], batch_size=4)]
        after = await stats_after(client, "score_probe", before, 3)
    assert isinstance(part, ScoredBatch)
    assert (part.start, part.length, part.rows_ok, part.rows_failed) == (0, 4, 3, 1)
    assert [index for index, _ in part.runs] == [0, 3]
    np.testing.assert_array_equal(part.runs[0][1]["Y"], [[0.0], [3.0]])
    np.testing.assert_array_equal(part.runs[1][1]["Y"], [[9.0]])
    ((index, error, given),) = part.errors
    assert index == 2
    assert isinstance(error, InputShapeError)
    assert given == {"X": [2.0]}
    assert after.success_count - before.success_count == 1  # the three good rows in one request


async def test_batches_are_sliced_to_batch_size_and_sent_as_sliced(triton_server: LocalTriton) -> None:
    """Batches of 10 and 7 rows at batch_size 4: requests of 4,4,2,4,3 rows, never merged with each other (the
    client's coalescing would merge concurrent requests of a dynamic-batching model: a job keeps its shape)."""
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("scale_fp32")
        (before,) = await client.inference_statistics("scale_fp32")
        first = np.arange(40, dtype=np.float32).reshape(10, 4)
        second = np.arange(28, dtype=np.float32).reshape(7, 4) + 100
        parts = [p async for p in score_batches(model, [{"INPUT0": first}, {"INPUT0": second}], batch_size=4,
                                                concurrency=4, start=5)]
        after = await stats_after(client, "scale_fp32", before, 17)
    assert [(p.start, p.length) for p in parts] == [(5, 4), (9, 4), (13, 2), (15, 4), (19, 3)]
    assert after.success_count - before.success_count == 5
    got = np.concatenate([p.runs[0][1]["OUTPUT0"] for p in parts])
    np.testing.assert_array_equal(got, 2 * np.concatenate([first, second]))


async def test_columns_of_different_lengths_are_refused(triton_server: LocalTriton) -> None:
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("dtypes_echo")
        batch = {"IN_INT8": np.zeros((3, 2), np.int8), "IN_FP32": np.zeros((2, 2), np.float32)}
        with pytest.raises(UsageError, match=r"differ in length \(IN_INT8=3, IN_FP32=2\)"):
            async for _ in score_batches(model, [batch]):
                pass
        with pytest.raises(UsageError, match=r"column 'IN_INT8' of a batch is a ndarray without a length"):
            async for _ in score_batches(model, [{"IN_INT8": np.array(3, dtype=np.int8)}]):
                pass


BAD_VALUES = [
    ["x", "y"],  # text for FP32
    [1.0, 2.0, 3.0],  # three numbers for dims [2]
    [[1.0, 2.0]],  # one dim too many
    2**70,  # an integer no float32 holds exactly is refused unless lossy
]


@pytest.mark.parametrize("value", BAD_VALUES, ids=["text", "length", "rank", "huge"])
async def test_one_validator_for_infer_and_score(triton_server: LocalTriton, value: object) -> None:
    """The same bad value is refused with the same error by validate_row, model.infer and a scoring job."""
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        with pytest.raises(UsageError) as direct:
            validate_row(model.spec, {"X": value})
        with pytest.raises(UsageError) as infer:
            await model.infer(X=value)
        (row,) = [r async for r in score_rows(model, [{"X": value}])]
        (part,) = [p async for p in score_batches(model, [{"X": [value]}])]
    for error in (infer.value, row.error, part.errors[0][1]):
        assert type(error) is type(direct.value)
        assert str(error) == str(direct.value)


def test_validate_batch_reads_a_column_of_scalars_only_when_told_it_holds_rows() -> None:
    """[n] for a dims [-1] input: n scalars in a job's column (the row rule), refused as a bare batch (ambiguous)."""
    from triton_npu_client import BatchSizeError, ModelSpec

    spec = ModelSpec.from_config({
        "name": "m", "max_batch_size": 8,
        "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "B", "data_type": "TYPE_FP32", "dims": [-1]}],
    })  # fmt: skip
    assert validate_batch(spec, {"A": [1.0, 2.0]}, rows=True)["A"].shape == (2, 1)
    with pytest.raises(BatchSizeError, match=r"batch form expects shape \[batch\]\+\[-1\], given \[2\]"):
        validate_batch(spec, {"A": np.array([1.0, 2.0], np.float32)})
    with pytest.raises(BatchSizeError, match=r"batch size 9 outside \[1, 8\]"):
        validate_batch(spec, {"A": np.zeros((9, 1), np.float32)})
    assert validate_row(spec, 3.0)["A"].shape == (1,)


async def test_a_record_s_other_fields_are_left_behind(triton_server: LocalTriton) -> None:
    """Rows that carry fields of their own (an id) score as their inputs alone, on the columnar path and on the
    row-by-row path a bad neighbour forces; the errors file keeps the bad row whole."""
    rows: list[dict[str, object]] = [{"id": f"r{i}", "X": [float(i), 0.0]} for i in range(12)]
    rows[9] = {"id": "r9", "X": [9.0]}  # the chunk of rows 8..11 goes row by row
    async with Client(triton_server.grpc_url, timeout_s=60) as client:
        model = await client.model("score_probe")
        out = [r async for r in score_rows(model, rows, batch_size=4)]
        ids = np.array([f"r{i}" for i in range(8)], dtype=object)
        column = np.array([[float(i), 0.0] for i in range(8)], dtype=np.float32)
        parts = [p async for p in score_batches(model, [{"id": ids, "X": column}], batch_size=4)]
    assert [(p.rows_ok, p.rows_failed) for p in parts] == [(4, 0), (4, 0)]
    np.testing.assert_array_equal(np.concatenate([p.runs[0][1]["Y"] for p in parts])[:, 0], 3.0 * np.arange(8))
    assert [r.ok for r in out] == [i != 9 for i in range(12)]
    assert [float(r.outputs["Y"][0]) for r in out if r.outputs is not None] == [3.0 * i for i in range(12) if i != 9]
    assert isinstance(out[9].error, InputShapeError)
    assert out[9].input == {"id": "r9", "X": [9.0]}
