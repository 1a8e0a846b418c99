"""The compiled decode pass against the eager one on this CPU: ms per pass at 1 and 32 rows, and the gain.

Run from the repository root::

    .venv/bin/python bench/chat_compile.py [--checkpoint DIR] [--rows 1,32] [--history 300] [--passes 50]

Both runners decode the same rows in the same process on one torch thread (the compiled one is
``ModelRunner(compile="cpu")``: ``torch.compile(fullgraph=True)`` per batch bucket), alternating A/B over
``--repeats`` rounds; medians. The compile time is printed apart: it is paid once per bucket when a server meets it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEMO = Path(__file__).resolve().parents[1] / "server_models" / "chat" / "demo_gpt2"


def make_runner(model: Any, rows: int, history: int, mode: str) -> tuple[Any, Any]:
    """A runner with ``rows`` slots prefilled with ``history`` tokens each, and its decode batch (greedy)."""
    from triton_npu_client.server import DecodeBatch, ModelRunner, PagedKVCache, PrefillRow, RowSampling
    from triton_npu_client.server.chat._sampling import SamplingFlags

    blocks_each = -(-(history + 1) // 16)
    cache = PagedKVCache.for_model(model, num_blocks=rows * blocks_each + 1, block_size=16)
    runner = ModelRunner(model, cache, slots=rows, max_ctx=history + 16, vocab=model.vocab_size, compile=mode)
    for slot in range(rows):
        table = cache.new_table()
        cache.reserve(table, 0, history + 1)
        ids = tuple((7 * slot + i) % model.vocab_size for i in range(history))
        row = PrefillRow(slot=slot, blocks=tuple(table.blocks), start=0, ids=ids, sampling=RowSampling())
        token = runner.prefill([row])[0]
        cache.commit(table, 0, list(ids))
        runner.join(row, token, table.blocks)
    batch = DecodeBatch(slots=tuple(range(rows)), width=blocks_each, flags=SamplingFlags())
    return runner, batch


def time_passes(runner: Any, batch: Any, history: int, passes: int) -> float:
    """ms per decode pass, the history kept at ``history`` positions (each pass rewrites the same position)."""
    start = time.perf_counter()
    for _ in range(passes):
        runner.decode(batch)
        runner.positions[: len(batch.slots)] = history
    return (time.perf_counter() - start) / passes * 1e3


def measure(
    checkpoint: Path, rows_list: Sequence[int], history: int, passes: int, repeats: int
) -> list[dict[str, Any]]:
    import torch

    from triton_npu_client.server import load_decoder

    torch.set_num_threads(1)
    model = load_decoder(checkpoint)
    results = []
    for rows in rows_list:
        eager, batch = make_runner(model, rows, history, "off")
        compiled, _ = make_runner(model, rows, history, "cpu")
        started = time.perf_counter()
        compiled.decode(batch)  # compiles this bucket
        compile_s = time.perf_counter() - started
        for runner in (eager, compiled):
            time_passes(runner, batch, history, 5)
        timings: dict[str, list[float]] = {"off": [], "cpu": []}
        for _ in range(repeats):
            timings["off"].append(time_passes(eager, batch, history, passes))
            timings["cpu"].append(time_passes(compiled, batch, history, passes))
        off, cpu = statistics.median(timings["off"]), statistics.median(timings["cpu"])
        results.append({"rows": rows, "eager_ms": off, "compiled_ms": cpu, "gain": off / cpu, "compile_s": compile_s})
    return results


def print_table(checkpoint: Path, results: Sequence[dict[str, Any]], history: int) -> None:
    print(f"\nCompiled decode pass on CPU ({checkpoint.name}, {history} tokens of history per row, one thread)")
    print("| rows | eager ms/pass | compiled ms/pass | gain | compile s (once per bucket) |")
    print("|---|---|---|---|---|")
    for r in results:
        cells = f"{r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['gain']:.2f}x | {r['compile_s']:.0f}"
        print(f"| {r['rows']} | {cells} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=Path, default=DEMO, help="checkpoint folder (default: the GPT-2 demo)")
    p.add_argument("--rows", default="1,32", help="batch sizes, comma-separated (default 1,32)")
    p.add_argument("--history", type=int, default=300, help="tokens of history per row (default 300)")
    p.add_argument("--passes", type=int, default=50, help="passes per timing (default 50)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds (default 3)")
    args = p.parse_args(argv)
    from triton_npu_client.server._device import keep_freed_memory

    # As the chat model does when it loads; mallopt is not thread-safe, so here, before any other thread exists.
    keep_freed_memory()
    try:
        rows = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows must be integers separated by commas, got {args.rows!r}")
    if any(r < 1 for r in rows) or args.history < 1 or args.passes < 1 or args.repeats < 1:
        p.error("--rows, --history, --passes and --repeats must be >= 1")
    print_table(args.checkpoint, measure(args.checkpoint, rows, args.history, args.passes, args.repeats), args.history)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
