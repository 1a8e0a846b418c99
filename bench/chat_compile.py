"""The compiled decode pass against the eager one on this CPU: ms per pass at 1 and 32 rows, and the gain.

Run from the repository root::

    .venv/bin/python bench/chat_compile.py [--checkpoint DIR] [--rows 1,32] [--history 300] [--passes 50]
        [--sampled] [--inductor-defaults] [--noise]

Both runners decode the same rows in the same process on one torch thread (the compiled one is
``ModelRunner(compile="cpu")``: ``torch.compile(fullgraph=True)`` per batch bucket), alternating A/B over
``--repeats`` rounds; medians. The compile time is printed apart: it is paid once per bucket when a server meets it.

``--sampled``: the rows sample (temperature 0.8, top-k 5, a seed each) instead of decoding greedily, so the pass
carries the sampler and its hash. ``--inductor-defaults``: compile with inductor's own CPU options instead of the
runner's ``CPU_COMPILE_OPTIONS`` (what the runner did before them). ``--noise``: also count the sampler's Exp(1)
draws (``exponential_noise``) that a compiled graph gives differently from eager, for the rows and vocabulary used.
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


def make_runner(model: Any, rows: int, history: int, mode: str, sampled: bool = False) -> tuple[Any, Any]:
    """A runner with ``rows`` slots prefilled with ``history`` tokens each, and its decode batch (greedy, or
    ``sampled``: temperature 0.8, top-k 5, seed slot + 1)."""
    from triton_npu_client.server import DecodeBatch, ModelRunner, PagedKVCache, PrefillRow, RowSampling
    from triton_npu_client.server.chat._sampling import SamplingFlags

    blocks_each = -(-(history + 1) // 16)
    cache = PagedKVCache.for_model(model, num_blocks=rows * blocks_each + 1, block_size=16)
    runner = ModelRunner(model, cache, slots=rows, max_ctx=history + 16, vocab=model.vocab_size, compile=mode)
    for slot in range(rows):
        table = cache.new_table()
        cache.reserve(table, 0, history + 1)
        ids = tuple((7 * slot + i) % model.vocab_size for i in range(history))
        sampling = RowSampling(temperature=0.8, top_k=5, seed=slot + 1) if sampled else RowSampling()
        row = PrefillRow(slot=slot, blocks=tuple(table.blocks), start=0, ids=ids, sampling=sampling)
        token = runner.prefill([row])[0]
        cache.commit(table, 0, list(ids))
        runner.join(row, token, table.blocks)
    flags = SamplingFlags(sampled=True, filtered=True) if sampled else SamplingFlags()
    batch = DecodeBatch(slots=tuple(range(rows)), width=blocks_each, flags=flags)
    return runner, batch


def time_passes(runner: Any, batch: Any, history: int, passes: int) -> float:
    """ms per decode pass, the history kept at ``history`` positions (each pass rewrites the same position)."""
    start = time.perf_counter()
    for _ in range(passes):
        runner.decode(batch)
        runner.positions[: len(batch.slots)] = history
    return (time.perf_counter() - start) / passes * 1e3


def measure(
    checkpoint: Path, rows_list: Sequence[int], history: int, passes: int, repeats: int, *, sampled: bool = False,
    inductor_defaults: bool = False,
) -> list[dict[str, Any]]:
    import torch

    from triton_npu_client.server import load_decoder
    from triton_npu_client.server.chat import _runner

    torch.set_num_threads(1)
    if inductor_defaults:
        _runner.CPU_COMPILE_OPTIONS = ()  # type: ignore[assignment, misc]  # read when a pass is compiled
    model = load_decoder(checkpoint)
    results = []
    for rows in rows_list:
        eager, batch = make_runner(model, rows, history, "off", sampled)
        compiled, _ = make_runner(model, rows, history, "cpu", sampled)
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


def noise_differences(rows: int, vocab: int) -> tuple[int, int]:
    """How many of ``rows`` x ``vocab`` Exp(1) draws a compiled ``exponential_noise`` gives differently from eager
    (the runner's inductor options, or inductor's own with --inductor-defaults), and how many there are."""
    import torch

    from triton_npu_client.server.chat import _runner
    from triton_npu_client.server.chat._sampling import exponential_noise

    seeds, positions = torch.arange(1, rows + 1), torch.arange(rows) + 300
    options: dict[str, Any] = dict(_runner.CPU_COMPILE_OPTIONS)
    compiled = torch.compile(exponential_noise, fullgraph=True, dynamic=False, options=options)
    got, expected = compiled(seeds, positions, vocab), exponential_noise(seeds, positions, vocab)
    return int((got != expected).sum()), rows * vocab


def print_table(checkpoint: Path, results: Sequence[dict[str, Any]], history: int, label: str = "") -> None:
    print(f"\nCompiled decode pass on CPU ({checkpoint.name}, {history} tokens of history per row, one thread{label})")
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
    p.add_argument("--sampled", action="store_true", help="rows sample (temperature 0.8, top-k 5) instead of greedy")
    p.add_argument("--inductor-defaults", action="store_true",
                   help="compile with inductor's own CPU options, not the runner's CPU_COMPILE_OPTIONS")  # fmt: skip
    p.add_argument("--noise", action="store_true", help="count the Exp(1) draws a compiled graph gives differently")
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
    results = measure(args.checkpoint, rows, args.history, args.passes, args.repeats, sampled=args.sampled,
                      inductor_defaults=args.inductor_defaults)  # fmt: skip
    label = (", sampled" if args.sampled else ", greedy") + (
        ", inductor's own options" if args.inductor_defaults else ", the runner's CPU_COMPILE_OPTIONS"
    )
    print_table(args.checkpoint, results, args.history, label)
    if args.noise:
        from triton_npu_client.server import load_decoder

        differ, draws = noise_differences(max(rows), load_decoder(args.checkpoint).vocab_size)
        print(f"\nExp(1) draws a compiled graph gives differently from eager: {differ} of {draws:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
