"""perf_analyzer provisioning and the runner, against the session's real server."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tools.perf_analyzer import (
    DECOUPLED_VERSION,
    PerfAnalyzer,
    PerfAnalyzerError,
    arun_perf_analyzer,
    ensure_perf_analyzer,
    parse_report,
    run_perf_analyzer,
)
from triton_npu_client import Client, LocalTriton


@pytest.fixture(scope="module")
def pa() -> PerfAnalyzer:
    """The cached perf_analyzer (downloaded on the first run on a machine)."""
    return ensure_perf_analyzer()


def _args(server: LocalTriton, *extra: str) -> list[str]:
    return [
        "-m", "scale_fp32", "-u", f"127.0.0.1:{server.grpc_port}", "-i", "grpc", "--shape", "INPUT0:4",
        "--measurement-mode", "count_windows", "--measurement-request-count", "200",
        # A shared 2-core machine is noisy: accept any three windows rather than fail on stability.
        "--stability-percentage", "1000", *extra,
    ]  # fmt: skip


def test_ensure_is_idempotent_under_concurrent_callers(pa: PerfAnalyzer) -> None:
    """Eight concurrent ensure calls agree on one executable binary."""
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: ensure_perf_analyzer(), range(8)))
    assert {g.binary for g in got} == {pa.binary}
    assert pa.binary.is_file()


def test_every_shared_library_resolves(pa: PerfAnalyzer) -> None:
    """ldd finds libb64 and libcudart through the env's LD_LIBRARY_PATH: no apt package needed."""
    out = subprocess.run(["ldd", str(pa.binary)], env=pa.env, capture_output=True, text=True, check=True).stdout
    assert "not found" not in out
    assert "libb64.so.0d =>" in out
    assert "libcudart.so.12 =>" in out


def test_run_against_real_server(pa: PerfAnalyzer, triton_server: LocalTriton) -> None:
    """A concurrency-4 run on scale_fp32 measures positive throughput, ordered latencies and no errors."""
    result = run_perf_analyzer(pa, _args(triton_server, "--concurrency-range", "4"), timeout_s=120)
    assert result.concurrency == 4
    assert result.throughput_infer_s > 0
    assert result.errors == 0
    assert 0 < result.p50_latency_us <= result.p99_latency_us
    assert result.server_execution_count > 0
    assert result.avg_batch_size >= 1.0


async def test_async_run_against_real_server(pa: PerfAnalyzer, triton_server: LocalTriton) -> None:
    """The async runner gives the same kind of result without blocking the loop."""
    result = await arun_perf_analyzer(pa, _args(triton_server, "--concurrency-range", "2"), timeout_s=120)
    assert result.concurrency == 2
    assert result.throughput_infer_s > 0
    assert result.errors == 0


def test_request_errors_raise(pa: PerfAnalyzer, triton_server: LocalTriton) -> None:
    """A batch above max_batch_size (64) makes the server refuse: PerfAnalyzerError counts the errors."""
    with pytest.raises(PerfAnalyzerError) as info:
        run_perf_analyzer(pa, _args(triton_server, "-b", "100"), timeout_s=60)
    assert info.value.errors >= 1
    assert "batch-size must be <= 64" in info.value.output


def test_runner_refuses_report_path(pa: PerfAnalyzer, tmp_path: Path) -> None:
    """The runner owns the CSV report path: passing -f is a usage error, refused before anything runs."""
    report = tmp_path / "r.csv"
    with pytest.raises(ValueError, match="-f"):
        run_perf_analyzer(pa, ["-m", "x", "-f", str(report)])
    assert not report.exists()


def test_parse_report_reads_last_row_and_server_counts() -> None:
    """The parser takes the last load level of a CSV and the last server block of the console output."""
    header = "Concurrency,Inferences/Second,Client Send,p50 latency,p90 latency,p95 latency,p99 latency\n"
    csv_text = header + "1,100.5,3,900,950,990,1200\n8,2651.62,3,1394,2056,2359,4332\n"
    output = "  Server:\n    Inference count: 7967\n    Execution count: 4025\n"
    result = parse_report(csv_text, output)
    assert (result.concurrency, result.throughput_infer_s) == (8, 2651.62)
    assert (result.p50_latency_us, result.p99_latency_us) == (1394, 4332)
    assert result.avg_batch_size == pytest.approx(7967 / 4025)
    assert result.errors == 0


CHAT_TOKENS = 6  # per reply: MIN_TOKENS = MAX_TOKENS, so every turn streams exactly this many responses


def _chat_data(path: Path) -> Path:
    """Two conversations of three turns; the first turn carries a system message too."""
    questions = ["Where are you going?", "What did your sister say?", "Shall we walk to the village?"]
    streams = []
    for system in ("You are a polite young lady.", "You are an old sailor."):
        steps = []
        for i, question in enumerate(questions):
            roles, texts = (["system", "user"], [system, question]) if i == 0 else (["user"], [question])
            steps.append({
                "ROLE": {"content": roles, "shape": [len(roles)]},
                "TEXT": {"content": texts, "shape": [len(texts)]},
                "MAX_TOKENS": [CHAT_TOKENS], "MIN_TOKENS": [CHAT_TOKENS],
            })  # fmt: skip
        streams.append(steps)
    path.write_text(json.dumps({"data": streams}))
    return path


async def _live_conversations(server: LocalTriton) -> int:
    """LIVE as the chat model reports it, read by a one-request conversation (START and END; counts itself)."""
    async with Client(server.grpc_url, timeout_s=120) as client:
        chat = await client.model("chat")
        async with chat.sequence() as seq:
            request = {
                "ROLE": np.array([b"user"], dtype=np.object_),
                "TEXT": np.array([b"Hi."], dtype=np.object_),
                "MAX_TOKENS": np.array([1], np.int32),
            }
            results = [r async for r in seq.stream(request, end=True)]
    return int(results[-1]["LIVE"][0, 0])


async def test_drives_the_decoupled_chat_model_in_streaming_sequence_mode(
    chat_only_server: LocalTriton, tmp_path: Path
) -> None:
    """perf_analyzer 2.38 runs chat conversations over the gRPC stream: no error, every streamed response counted.

    Each turn streams CHAT_TOKENS responses and perf_analyzer waits for the final one before the next turn
    of that conversation (2.34 did not: it took the first response as the end and sent the next turn on top
    of a streaming one). It ends every conversation it started: the model holds none of them afterwards.
    """
    pa = ensure_perf_analyzer(version=DECOUPLED_VERSION)
    before = await _live_conversations(chat_only_server)
    args = [
        "-m", "chat", "-u", f"127.0.0.1:{chat_only_server.grpc_port}", "-i", "grpc", "--streaming",
        "--input-data", str(_chat_data(tmp_path / "chat.json")),
        "--sequence-length", "3", "--sequence-length-variation", "0", "--sequence-id-range", "1000000000:1999999999",
        "--concurrency-range", "4", "--measurement-mode", "count_windows", "--measurement-request-count", "12",
        "--stability-percentage", "1000",
    ]  # fmt: skip
    result = await arun_perf_analyzer(pa, args, timeout_s=300)
    assert result.errors == 0
    assert result.concurrency == 4
    assert result.throughput_infer_s > 0
    assert result.server_inference_count > 0
    # Responses are counted per request, over the same requests as the turns: exactly CHAT_TOKENS per turn.
    assert result.response_throughput_s == pytest.approx(CHAT_TOKENS * result.throughput_infer_s, rel=1e-3)
    assert 0 < result.p50_latency_us <= result.p99_latency_us
    assert await _live_conversations(chat_only_server) == before


def test_parse_report_reads_response_throughput() -> None:
    """2.38's report has a Response Throughput column for decoupled models; older reports read as 0.0."""
    header = "Concurrency,Inferences/Second,Response Throughput,p50 latency,p90 latency,p95 latency,p99 latency\n"
    result = parse_report(header + "4,44.9493,359.595,87017,104994,110922,123807\n", "")
    assert (result.throughput_infer_s, result.response_throughput_s) == (44.9493, 359.595)
    old = parse_report("Concurrency,Inferences/Second,p50 latency\n2,10.5,900\n", "")
    assert old.response_throughput_s == 0.0
