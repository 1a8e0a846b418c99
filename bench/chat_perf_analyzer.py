"""NVIDIA's perf_analyzer drives the ``chat`` model: streamed turns of multi-turn conversations, N at once.

Each conversation is a perf_analyzer sequence of ``--turns`` steps over the gRPC stream (``--streaming``):
the first step carries a system message and a user message, the others one user message; perf_analyzer
sends START on the first and END on the last (the model answers that turn, then frees the conversation).
Every turn asks for exactly ``--tokens`` tokens (MIN_TOKENS = MAX_TOKENS), so turns are alike and each
streamed response carries one token.

It needs perf_analyzer 2.38 (``tools.perf_analyzer.DECOUPLED_VERSION``): 2.34 ends a request at its first
response, sends the next turn while the previous one still streams and loses count of its concurrency.

    python bench/chat_perf_analyzer.py                       # starts a server on server_models/
    python bench/chat_perf_analyzer.py --url 127.0.0.1:8001 --concurrency 1 4 16 64
    python bench/chat_perf_analyzer.py --quick               # smoke run

Prints the perf_analyzer command lines, then a table: concurrency, turns/s, responses/s, latency of a
whole turn (p50/p99), time to the first response (p50/p99, from perf_analyzer's profile export) and
errors. Exits 1 when a run fails or errs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import attrs

# The repository root, for tools/ (dev tooling that is not part of the installed package).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.perf_analyzer import (
    DECOUPLED_VERSION,
    PerfAnalyzer,
    PerfAnalyzerError,
    ensure_perf_analyzer,
    run_perf_analyzer,
)
from triton_npu_client import LocalTriton

SYSTEMS = [
    "You are a polite young lady in a country house.",
    "You are an old sailor who has seen every port.",
    "You are a careful gardener; answer briefly.",
    "You are the village schoolmaster.",
]
QUESTIONS = [
    "Where are you going this morning?",
    "What did your sister say?",
    "Shall we walk to the village?",
    "Is it going to rain before dinner?",
    "Who was at the ball last night?",
]
# Far from the small ids other clients of a shared server usually start at.
SEQUENCE_IDS = "1000000000:1999999999"


@attrs.frozen(kw_only=True)
class Row:
    """One concurrency level; times in milliseconds. ``failure`` is None when the run succeeded."""

    concurrency: int
    turns_s: float = 0.0
    responses_s: float = 0.0
    responses_per_turn: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    first_p50_ms: float = 0.0
    first_p99_ms: float = 0.0
    errors: int = 0
    server_requests: int = 0
    failure: str | None = None


def input_data(*, turns: int, tokens: int, conversations: int) -> dict[str, Any]:
    """perf_analyzer's ``--input-data`` JSON: one stream of ``turns`` steps per distinct conversation."""
    streams = []
    for c in range(conversations):
        steps = []
        for t in range(turns):
            question = QUESTIONS[(c + t) % len(QUESTIONS)]
            roles, texts = (
                (["system", "user"], [SYSTEMS[c % len(SYSTEMS)], question]) if t == 0 else (["user"], [question])
            )
            steps.append(
                {
                    # ROLE and TEXT are [-1]: perf_analyzer needs each step's shape (batch dim excluded).
                    "ROLE": {"content": roles, "shape": [len(roles)]},
                    "TEXT": {"content": texts, "shape": [len(texts)]},
                    "MAX_TOKENS": [tokens],
                    "MIN_TOKENS": [tokens],
                }
            )
        streams.append(steps)
    return {"data": streams}


def perf_args(url: str, data: Path, *, concurrency: int, turns: int, requests: int, export: Path) -> list[str]:
    """perf_analyzer's options for one concurrency level (the runner adds ``-f``)."""
    return [
        "-m", "chat", "-u", url, "-i", "grpc", "--streaming", "--input-data", str(data),
        "--sequence-length", str(turns), "--sequence-length-variation", "0", "--sequence-id-range", SEQUENCE_IDS,
        "--concurrency-range", str(concurrency),
        "--measurement-mode", "count_windows", "--measurement-request-count", str(requests),
        # A shared machine is noisy: accept any three windows rather than fail on stability.
        "--stability-percentage", "1000",
        "--profile-export-file", str(export),
    ]  # fmt: skip


def first_response_ms(export: Path) -> list[float]:
    """Time from each request to its first response (ms), from a 2.38 ``--profile-export-file``."""
    found: list[float] = []
    for experiment in json.loads(export.read_text())["experiments"]:
        for request in experiment["requests"]:
            responses = request.get("response_timestamps") or []
            if responses:
                found.append((responses[0] - request["timestamp"]) / 1e6)
    return found


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(
    pa: PerfAnalyzer, url: str, data: Path, folder: Path, *, concurrency: int, turns: int, requests: int
) -> Row:
    """One perf_analyzer run at ``concurrency``; a failed run becomes a row with its errors and reason."""
    export = folder / f"profile-{concurrency}.json"
    args = perf_args(url, data, concurrency=concurrency, turns=turns, requests=requests, export=export)
    print("$ " + shlex.join(pa.command([*args, "-f", "<report.csv>"])), flush=True)
    try:
        result = run_perf_analyzer(pa, args, timeout_s=600)
    except PerfAnalyzerError as err:
        return Row(concurrency=concurrency, errors=max(err.errors, 1), failure=str(err))
    firsts = first_response_ms(export) if export.is_file() else []
    return Row(
        concurrency=concurrency,
        turns_s=result.throughput_infer_s,
        responses_s=result.response_throughput_s,
        responses_per_turn=result.response_throughput_s / result.throughput_infer_s if result.throughput_infer_s else 0,
        p50_ms=result.p50_latency_us / 1e3,
        p99_ms=result.p99_latency_us / 1e3,
        first_p50_ms=statistics.median(firsts) if firsts else 0.0,
        first_p99_ms=_percentile(firsts, 0.99),
        errors=result.errors,
        server_requests=result.server_inference_count,
    )


def table(rows: list[Row]) -> str:
    head = ["concurrency", "turns/s", "responses/s", "resp/turn", "p50 ms", "p99 ms", "first p50 ms",
            "first p99 ms", "errors"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
    for r in rows:
        if r.failure is not None:
            cells = [str(r.concurrency), "failed", *["-"] * 6, str(r.errors)]
        else:
            cells = [
                str(r.concurrency), f"{r.turns_s:.1f}", f"{r.responses_s:.1f}", f"{r.responses_per_turn:.2f}",
                f"{r.p50_ms:.1f}", f"{r.p99_ms:.1f}", f"{r.first_p50_ms:.1f}", f"{r.first_p99_ms:.1f}", str(r.errors),
            ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", default=None, help="gRPC host:port of a running server (default: start one)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None, help="conversations at once (1 4 16)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per reply (default 32)")
    parser.add_argument("--requests", type=int, default=40, help="turns per measurement window (default 40)")
    parser.add_argument("--quick", action="store_true", help="smoke run: concurrency 1 and 4, short replies")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.turns, ns.tokens, ns.requests = 3, 8, 12
    concurrency = ns.concurrency or ([1, 4] if ns.quick else [1, 4, 16])
    if ns.turns < 1 or ns.tokens < 1 or ns.requests < 1 or min(concurrency) < 1:
        parser.error("--turns, --tokens, --requests and --concurrency must be positive")

    print("python " + shlex.join(sys.argv), flush=True)
    try:
        pa = ensure_perf_analyzer(version=DECOUPLED_VERSION)
    except PerfAnalyzerError as err:
        print(f"perf_analyzer {DECOUPLED_VERSION} unavailable: {err}", file=sys.stderr)
        return 2
    rows: list[Row] = []
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chat-perf-")))
        url = ns.url
        if url is None:
            server = stack.enter_context(LocalTriton())
            url = f"127.0.0.1:{server.grpc_port}"
        data = folder / "chat_input.json"
        data.write_text(json.dumps(input_data(turns=ns.turns, tokens=ns.tokens, conversations=len(SYSTEMS))))
        for n in concurrency:
            rows.append(measure(pa, url, data, folder, concurrency=n, turns=ns.turns, requests=ns.requests))
    print(
        f"\nchat over the gRPC stream, perf_analyzer {pa.version or '($PERF_ANALYZER)'}; {ns.turns} turns per "
        f"conversation, {ns.tokens} tokens per reply (one per response); latency: a whole turn, to its last "
        f"response\n"
    )
    print(table(rows))
    for r in rows:
        if r.failure is not None:
            print(f"concurrency {r.concurrency} failed: {r.failure}", file=sys.stderr)
    if ns.json is not None:
        ns.json.write_text(json.dumps({"rows": [attrs.asdict(r) for r in rows]}, indent=1))
    return 0 if all(r.failure is None and r.errors == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
