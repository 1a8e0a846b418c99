"""One conversation's latency end to end at 1 and 2 torch threads, with OpenMP's idle threads spinning or asleep.

Run from the repository root (starts its own servers; nothing else is needed)::

    .venv/bin/python bench/chat_threads.py [--rounds 5] [--tokens 64] [--threads 1,2]
    .venv/bin/python bench/chat_threads.py --quick        # a smoke run: small and fast, numbers not meaningful

What a person chatting feels: one conversation, 16 positions of history, a reply of ``--tokens`` tokens
(MIN_TOKENS = MAX_TOKENS), a response per token; the client's time between its first and last piece per step
(bench/chat.py's ``per_token_latency``) and the time to the first piece of a short turn. Two checkpoints, each served
at every ``--threads`` value (the entry's ``cpu_threads``): the GPT-2 demo and a random Llama of the SmolLM2-135M
shape (bench/chat_cache.py's ``smollm2-135m``; ``--no-smollm`` leaves it out). Each combination twice, on two servers
that differ only in the stubs' ``OMP_WAIT_POLICY``: unset (libgomp's default: a thread that finishes its share of a
parallel region spins for a while before it sleeps) and ``PASSIVE`` (it sleeps at once). Beside each figure, the CPU
the stub's threads and tritonserver spent per token: spinning shows there as CPU that does no work, and as a core the
client and Triton wait for. The contenders alternate within each round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chat as bench_chat  # bench/chat.py: per_token_latency, the processes of a server

from triton_npu_client import Client, LocalTriton, Model, write_chat_model

POLICIES = {"unset": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}


@attrs.frozen
class Sample:
    ms_per_token: float
    ttft_ms: float
    stub_cpu_ms_per_token: float  # every thread of the stub
    server_cpu_ms_per_token: float  # tritonserver


async def sample(model: Model, procs: bench_chat.Processes, tokens: int) -> Sample:
    before = procs.cpu()
    per_token, _ = await bench_chat.per_token_latency(model, 16, tokens)
    after = procs.cpu()
    async with model.sequence() as seq:
        opening = {**bench_chat.messages(("user", bench_chat.QUESTIONS[0])), **bench_chat.fixed(4)}
        ttft = (await bench_chat.timed(seq.stream(opening))).ttft_s
    steps = tokens + 1  # the history turn's one token and the reply's
    return Sample(
        ms_per_token=per_token * 1e3,
        ttft_ms=ttft * 1e3,
        stub_cpu_ms_per_token=(after["stub"] - before["stub"]) / steps * 1e3,
        server_cpu_ms_per_token=(after["tritonserver"] - before["tritonserver"]) / steps * 1e3,
    )


def checkpoints(work: Path, smollm: bool) -> dict[str, Path]:
    found = {"GPT-2 demo": bench_chat.CHECKPOINT}
    if smollm:
        import chat_cache  # bench/chat_cache.py: the random Llama shapes

        found["Llama, SmolLM2-135M shape"] = Path(chat_cache.write_tiny_llama(work / "smollm2", "smollm2-135m"))
    return found


async def main(args: argparse.Namespace) -> int:
    med = statistics.median
    results: dict[tuple[str, int, str], list[Sample]] = {}
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-chat-threads-")))
        folders = checkpoints(work, args.smollm)
        repository = work / "repository"
        names: dict[tuple[str, int], str] = {}
        for i, (label, folder) in enumerate(folders.items()):
            for threads in args.threads:
                names[(label, threads)] = write_chat_model(
                    repository, folder, name=f"m{i}_t{threads}", max_ctx=1024, dtype="float32", device="cpu",
                    max_cache_mb=128, cpu_threads=threads,
                )  # fmt: skip
        served: dict[tuple[str, int, str], tuple[Model, bench_chat.Processes]] = {}
        for policy, env in POLICIES.items():
            server = await stack.enter_async_context(LocalTriton(repository, env=env, startup_timeout_s=600))
            client = await stack.enter_async_context(Client(server.grpc_url, timeout_s=600))
            for (label, threads), name in names.items():
                procs = bench_chat.Processes.find(server.grpc_url, name)
                assert procs is not None, "the stub of a local server"
                served[(label, threads, policy)] = (await client.model(name), procs)
        for model, procs in served.values():  # warm-up: first calls pay lazy initialisation
            await sample(model, procs, 4)
        order = list(served)
        for r in range(args.rounds):
            for key in order if r % 2 == 0 else order[::-1]:
                model, procs = served[key]
                results.setdefault(key, []).append(await sample(model, procs, args.tokens))
    print(
        f"## One conversation end to end, by torch threads and OMP_WAIT_POLICY (medians of {args.rounds} rounds, "
        f"{args.tokens}-token replies, {len(os.sched_getaffinity(0))} cores)\n"
    )
    print("| checkpoint | cpu_threads | stubs' OMP_WAIT_POLICY | ms per token | vs 1 thread, unset | TTFT ms | "
          "stub CPU ms per token | tritonserver CPU ms per token |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for label in dict.fromkeys(k[0] for k in results):
        base = med(s.ms_per_token for s in results[(label, args.threads[0], next(iter(POLICIES)))])
        for threads in args.threads:
            for policy in POLICIES:
                runs = results[(label, threads, policy)]
                ms = med(s.ms_per_token for s in runs)
                print(
                    f"| {label} | {threads} | {policy} | {ms:.2f} | {ms / base:.2f}x | "
                    f"{med(s.ttft_ms for s in runs):.1f} | {med(s.stub_cpu_ms_per_token for s in runs):.2f} | "
                    f"{med(s.server_cpu_ms_per_token for s in runs):.2f} |"
                )
    print(
        f"\nRun: `{' '.join(['.venv/bin/python', 'bench/chat_threads.py', *sys.argv[1:]])}` on {platform.node()}, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f} at the end."
    )
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick: 1)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per reply (default 64; --quick: 8)")
    p.add_argument("--threads", default="1,2", help="the cpu_threads values, comma-separated (default 1,2)")
    p.add_argument("--no-smollm", dest="smollm", action="store_false", help="the GPT-2 demo only")
    p.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --tokens 8, the GPT-2 demo only")
    args = p.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",")]
    defaults = {"rounds": (5, 1), "tokens": (64, 8)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.quick:
        args.smollm = False
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
