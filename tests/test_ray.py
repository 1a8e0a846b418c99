"""RayScorer: a Ray Dataset scored with map_batches gives what score_rows gives, row for row, across replicas.

One local Ray runtime for the module (``ray.init(num_cpus=2)``, ~10 s to start); its temp folder, its processes and
its auth token are checked gone afterwards. The servers are real: the session's, and a second LocalTriton on a
copy of ``scale_fp32`` (OUTPUT0 = 2 * INPUT0, FP32 [-1], max_batch_size 64) as another replica.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from triton_npu_client import (
    Client,
    InputDtypeError,
    JobAborted,
    LocalTriton,
    MissingInputError,
    RayScorer,
    ScoredRow,
    UsageError,
    default_model_repository,
    score_rows,
)

# Ray Data's DataContext sets deprecated fields of its own when it is created or copied (Ray 2.60): its warnings
# are about Ray's code, not this project's use of it.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")

MODEL = "scale_fp32"
ROWS = 300
# Rows the core refuses alone: int64 values that FP32 cannot hold exactly (a per-row InputDtypeError).
BAD = (37, 150, 299)


def _ray_pids(token: str) -> list[int]:
    """Processes that carry this runtime's auth token in their environment: every Ray process it started."""
    needle = f"RAY_AUTH_TOKEN={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if needle in Path("/proc", entry, "environ").read_bytes().split(b"\0"):
                    found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours
                continue
    return found


@pytest.fixture(scope="module")
def ray_runtime() -> Iterator[None]:
    """A local Ray runtime with 2 CPUs; afterwards no Ray process, temp folder or token file remains."""
    token_file = Path.home() / ".ray" / "auth_token"
    had_token_file = token_file.exists()
    saved_env = dict(os.environ)
    # A fresh token in the environment: Ray would otherwise write one to ~/.ray for every new local cluster.
    token = secrets.token_hex(16)
    os.environ["RAY_AUTH_TOKEN"] = token
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # Short on purpose: Ray puts its AF_UNIX sockets under this folder (paths are capped at 107 bytes).
    temp_dir = tempfile.mkdtemp(prefix="ray-")
    context: Any = None
    preserve_order = False
    try:
        context = ray.data.DataContext.get_current()
        preserve_order = context.execution_options.preserve_order
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
        assert _ray_pids(token), "the runtime's processes should be visible by their token"
        context.execution_options.preserve_order = True  # the output in the input's order, as score() writes it
        yield
    finally:
        if context is not None:
            context.execution_options.preserve_order = preserve_order
        ray.shutdown()
        deadline = time.monotonic() + 60
        while _ray_pids(token) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = _ray_pids(token)
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
        assert left == [], f"Ray processes outlived the runtime: {left}"
        assert not Path(temp_dir).exists()
        assert had_token_file or not token_file.exists()


@pytest.fixture
def replica(tmp_path: Path) -> Iterator[LocalTriton]:
    """A second server with only scale_fp32: another replica of the session server's model."""
    repo = tmp_path / "repo"
    shutil.copytree(default_model_repository() / MODEL, repo / MODEL)
    # Killed when stopped (no grace): the failover test stops it mid-life, as a replica that dies would.
    with LocalTriton(repo, stop_grace_s=0) as server:
        yield server
    assert server.processes() == []


def dead_url() -> str:
    """A loopback gRPC URL with nothing listening on it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"grpc://127.0.0.1:{port}"


def int_rows() -> list[np.ndarray[Any, Any]]:
    """ROWS int64 vectors of 1 to 4 values (variable length); the BAD ones hold 2**24 + 1, which FP32 rounds."""
    rng = np.random.default_rng(9)
    rows = [rng.integers(-1000, 1000, size=1 + i % 4).astype(np.int64) for i in range(ROWS)]
    for i in BAD:
        rows[i][0] = 2**24 + 1
    return rows


async def reference(url: str, rows: list[np.ndarray[Any, Any]]) -> list[ScoredRow]:
    async with Client(url) as client:
        model = await client.model(MODEL)
        return [s async for s in score_rows(model, [{"INPUT0": r} for r in rows], concurrency=2, batch_size=8)]


async def inference_counts(urls: list[str]) -> list[int]:
    counts = []
    for url in urls:
        async with Client(url) as client:
            (stats,) = await client.inference_statistics(MODEL)
            counts.append(stats.inference_count)
    return counts


def counts_after(urls: list[str], before: list[int], rows: int) -> list[int]:
    """Inferences per server since ``before``, once they add up to ``rows`` (Triton counts just after answering)."""
    deadline = time.monotonic() + 30
    while True:
        delta = [now - b for now, b in zip(asyncio.run(inference_counts(urls)), before, strict=True)]
        if sum(delta) >= rows or time.monotonic() > deadline:
            return delta
        time.sleep(0.05)


def describe(row: ScoredRow) -> str:
    return "" if row.error is None else f"{type(row.error).__name__}: {row.error}"


def test_map_batches_matches_score_rows_row_for_row(
    ray_runtime: None, triton_server: LocalTriton, replica: LocalTriton
) -> None:
    """300 rows over 2 actors and 3 endpoints (one dead): the same outputs and errors as score_rows, in order,
    each good row scored once, and both live replicas used."""
    rows = int_rows()
    expected = asyncio.run(reference(triton_server.grpc_url, rows))
    assert [i for i, s in enumerate(expected) if not s.ok] == list(BAD)
    assert all(isinstance(expected[i].error, InputDtypeError) for i in BAD)
    live = [triton_server.grpc_url, replica.grpc_url]
    before = asyncio.run(inference_counts(live))

    ds = ray.data.from_items([{"id": i, "INPUT0": r} for i, r in enumerate(rows)], override_num_blocks=6)
    out = ds.map_batches(
        RayScorer,
        fn_constructor_kwargs={
            "model": MODEL,
            "urls": [triton_server.grpc_url, dead_url(), replica.grpc_url],
            "concurrency": 2,
            "batch_size": 8,
            "failover_after_s": 1.0,
        },
        batch_format="numpy",
        batch_size=50,
        compute=ray.data.ActorPoolStrategy(size=2),
    ).take_all()

    assert [r["id"] for r in out] == list(range(ROWS))
    assert [r["error"] for r in out] == [describe(s) for s in expected]
    for got, want, row in zip(out, expected, rows, strict=True):
        if want.ok:
            assert want.outputs is not None
            np.testing.assert_array_equal(got["OUTPUT0"], want.outputs["OUTPUT0"], strict=True)
            np.testing.assert_array_equal(got["OUTPUT0"], 2 * row.astype(np.float32))
            np.testing.assert_array_equal(got["INPUT0"], row)  # the input columns travel along
        else:
            assert np.isnan(got["OUTPUT0"]).all()
    delta = counts_after(live, before, ROWS - len(BAD))
    assert sum(delta) == ROWS - len(BAD), delta  # every good row once, none lost or repeated by the failover
    assert min(delta) > 0, f"a replica took no rows: {delta}"


def test_the_minilm_ensemble_on_a_text_column(ray_runtime: None, triton_server: LocalTriton) -> None:
    """A text column through the tokenizer -> encoder ensemble: the embeddings score_rows gives, a missing text
    (null) refused alone, order kept."""
    topics = ["the weather", "a football match", "stock prices", "a cat on a mat", "quantum physics", "bread"]
    texts: list[str | None] = [f"sentence {i}: {' and '.join(topics[: 1 + i % 6])}." for i in range(60)]
    texts[23] = None
    url = triton_server.grpc_url

    async def expected() -> list[ScoredRow]:
        async with Client(url) as client:
            model = await client.model("minilm")
            return [s async for s in score_rows(model, [{"TEXT": t} for t in texts], concurrency=2, batch_size=8)]

    want = asyncio.run(expected())
    assert [i for i, s in enumerate(want) if not s.ok] == [23]
    ds = ray.data.from_items([{"sentence": t} for t in texts], override_num_blocks=3)
    out = ds.map_batches(
        RayScorer,
        fn_constructor_kwargs={"model": "minilm", "urls": url, "inputs": {"sentence": "TEXT"}, "batch_size": 8},
        batch_format="numpy",
        batch_size=20,
        compute=ray.data.ActorPoolStrategy(size=2),
    ).take_all()

    assert [r["sentence"] for r in out] == texts
    assert [r["error"] for r in out] == [describe(s) for s in want]
    assert out[23]["error"].startswith("InputDtypeError")
    got = np.stack([r["EMBEDDING"] for i, r in enumerate(out) if i != 23])
    ref = np.stack([s.outputs["EMBEDDING"] for s in want if s.outputs is not None])
    assert got.shape == (59, 384)
    assert got.dtype == np.float32
    # The encoder pads each request to its longest text, and requests are packed differently here than in the
    # reference run: the same sentence may meet a different matmul shape, which moves the last float bits.
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
    assert out[23]["EMBEDDING"].shape == (384,)
    assert np.isnan(out[23]["EMBEDDING"]).all()


def test_failover_mid_life_and_pickled_copies(
    triton_server: LocalTriton, replica: LocalTriton, seed: Callable[[int], int]
) -> None:
    """Called directly (no Ray): batches alternate between replicas; when one dies, its batch moves to the other
    and nothing is lost; a pickled copy works on its own; close() ends the loop thread."""
    rng = np.random.default_rng(seed(3))
    batch = {"INPUT0": rng.standard_normal((40, 3)).astype(np.float32), "key": np.arange(40)}
    urls = [replica.grpc_url, triton_server.grpc_url]
    scorer = RayScorer(MODEL, urls, concurrency=2, batch_size=8, failover_after_s=1.0, patience_s=30.0)
    try:
        before = asyncio.run(inference_counts(urls))
        for _ in range(2):
            got = scorer(batch)
            assert list(got) == ["INPUT0", "key", "OUTPUT0", "error"]
            np.testing.assert_array_equal(got["OUTPUT0"], 2 * batch["INPUT0"], strict=True)
            assert list(got["error"]) == [""] * 40
        assert counts_after(urls, before, 80) == [40, 40]  # two batches, one per replica

        replica.stop()
        for _ in range(2):  # one of the two batches starts on the dead replica
            got = scorer(batch)
            np.testing.assert_array_equal(got["OUTPUT0"], 2 * batch["INPUT0"], strict=True)
            assert list(got["error"]) == [""] * 40

        copy = pickle.loads(pickle.dumps(scorer))
        assert copy._worker is None  # settings travel, the loop and the clients do not
        try:
            np.testing.assert_array_equal(copy(batch)["OUTPUT0"], 2 * batch["INPUT0"], strict=True)
        finally:
            copy.close()
    finally:
        scorer.close()
    assert [t for t in threading.enumerate() if t.name == "triton-npu-ray-scorer"] == []


def test_every_endpoint_unreachable_aborts_the_batch() -> None:
    """No endpoint answers within patience_s: the batch raises JobAborted (the Ray task fails, no row is faked)."""
    scorer = RayScorer(MODEL, [dead_url(), dead_url()], failover_after_s=0.2, patience_s=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(JobAborted, match="patience_s"):
            scorer({"INPUT0": np.ones((2, 3), np.float32)})
        assert time.monotonic() - started < 15
    finally:
        scorer.close()


def test_columns_map_to_inputs_and_clashes_are_refused(triton_server: LocalTriton) -> None:
    """inputs= renames a column; a missing input, an unknown one or an output that would overwrite a column is
    refused before anything is sent; keep_columns=False returns outputs and errors only."""
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    url = triton_server.grpc_url
    renamed = RayScorer(MODEL, url, inputs={"features": "INPUT0"}, keep_columns=False, error_column="why")
    plain = RayScorer(MODEL, url)
    try:
        got = renamed({"features": x, "id": np.arange(3)})
        assert list(got) == ["OUTPUT0", "why"]
        np.testing.assert_array_equal(got["OUTPUT0"], 2 * x, strict=True)
        with pytest.raises(MissingInputError, match="INPUT0"):
            plain({"features": x})
        with pytest.raises(UsageError, match="OUTPUT0"):
            plain({"INPUT0": x, "OUTPUT0": x})
        with pytest.raises(UsageError, match="nope"):
            RayScorer(MODEL, url, inputs={"INPUT0": "nope"})({"INPUT0": x})
    finally:
        renamed.close()
        plain.close()


def test_import_does_not_load_ray() -> None:
    """`import triton_npu_client` and the RayScorer name load no Ray: the extra is needed only to run Ray itself."""
    code = "import sys, triton_npu_client as t\nt.RayScorer('m', 'grpc://127.0.0.1:1')\nprint('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
