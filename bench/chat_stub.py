"""Where the stub's decode time goes: the decode thread's CPU, switches and faults per pass, in the stub and in process.

Run from the repository root (starts its own servers; nothing else is needed)::

    .venv/bin/python bench/chat_stub.py [--rounds 5] [--chats 32] [--tokens 64]
    .venv/bin/python bench/chat_stub.py --quick        # a smoke run: small and fast, numbers not meaningful

The same turns as bench/chat.py's end-to-end run (``--chats`` conversations opened with a question, then a turn of
``--tokens`` tokens each at once, a response per token, greedy, the GPT-2 demo, one torch thread), run by each
contender in turn, alternating the order every round. For each, over the window from the turns' submission to
their last response, the decode thread's counters from /proc (``task/<tid>/stat``, ``status``, ``schedstat``):
CPU time (schedstat's, in ns), its user and system split, runqueue wait, voluntary and involuntary context
switches and minor page faults, per pass (a pass makes one token for every conversation, so passes = ``--tokens``)
and per 1,000 tokens; and which other threads of the process ran meanwhile.

Contenders:

- **in process, on this thread**: bench/chat.py's engine alone (a StepLoop driven pass by pass, nothing sent), over
  the same window; beside it the figure bench/chat.py prints, its decode passes only (the admitting pass left out);
- **in process, loop thread**: the StepLoop on its own thread with its send thread, senders that return at once;
- **in process, loop thread, 0.27 ms sends**: the same with senders that wait 0.27 ms without the GIL, as the Python
  backend's ``send()`` does (its round trip to Triton's process);
- **stub**: the served model (``chat`` on the GPT-2 demo, configured as the packaged one);
- **stub, glibc defaults**: ``keep_freed_memory`` false (see ``_device.keep_freed_memory``);
- **stub, no overlap**: ``overlap_sends`` false: each pass waits until the send thread is idle, so nothing else in
  the stub touches Python while a pass computes;
- **stub, the venv's libpython**: the stub loads this interpreter's ``libpython3.11.so`` (``LD_LIBRARY_PATH``) instead
  of the system one it links (Debian's, for the bundled Triton) -- only where they differ.

Then a pure-Python micro benchmark (a dict/str loop and a loop of small torch operations) in this interpreter with
its own libpython and with the system's (``LD_LIBRARY_PATH``), alternating, in subprocesses.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import os
import platform
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chat as bench_chat  # bench/chat.py: the turns, the engine alone, the processes of a server

from triton_npu_client import Client, LocalTriton, Model, write_chat_model

TICK = os.sysconf("SC_CLK_TCK")
SEND_S = 0.00027  # the Python backend's send() round trip, measured in the stub (docs/triton-facts.md)
SYSTEM_LIBPYTHON = Path("/lib/x86_64-linux-gnu") / "libpython3.11.so.1.0"


@attrs.frozen
class Task:
    """One thread's counters at a moment."""

    comm: str
    run_s: float  # schedstat: time on a CPU
    wait_s: float  # schedstat: time runnable, waiting for a CPU
    utime_s: float
    stime_s: float
    minflt: int
    voluntary: int
    involuntary: int


def read_task(pid: int, tid: int) -> Task | None:
    base = Path(f"/proc/{pid}/task/{tid}")
    try:
        stat = (base / "stat").read_text().rsplit(")", 1)[1].split()
        status = (base / "status").read_text()
        sched = (base / "schedstat").read_text().split()
        comm = (base / "comm").read_text().strip()
    except OSError:
        return None

    def field(name: str) -> int:
        found = re.search(rf"^{name}:\s+(\d+)", status, re.M)
        return int(found[1]) if found else 0

    # stat after the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    return Task(
        comm=comm, run_s=int(sched[0]) / 1e9, wait_s=int(sched[1]) / 1e9, utime_s=int(stat[11]) / TICK,
        stime_s=int(stat[12]) / TICK, minflt=int(stat[7]), voluntary=field("voluntary_ctxt_switches"),
        involuntary=field("nonvoluntary_ctxt_switches"),
    )  # fmt: skip


def read_tasks(pid: int) -> dict[int, Task]:
    found = {}
    for entry in Path(f"/proc/{pid}/task").iterdir():
        task = read_task(pid, int(entry.name))
        if task is not None:
            found[int(entry.name)] = task
    return found


@attrs.frozen
class Window:
    """One contender's run: the decode thread's counters over the window, per pass and per 1,000 tokens."""

    tokens: int
    passes: int
    wall_s: float
    decode: dict[str, float]  # the decode thread's deltas (run_s, wait_s, utime_s, stime_s, minflt, voluntary, ...)
    others: dict[str, tuple[float, int]]  # every other thread that ran: "comm tid" -> (CPU s, voluntary switches)

    def per_1k(self, key: str) -> float:
        return self.decode[key] / self.tokens * 1e3

    def per_pass(self, key: str) -> float:
        return self.decode[key] / self.passes


def window(
    before: dict[int, Task], after: dict[int, Task], *, tokens: int, passes: int, wall_s: float, decode: int | None
) -> Window:
    """The deltas between two readings; ``decode`` is the decode thread's id (None: the busiest thread)."""
    deltas = {}
    for tid, b in after.items():
        a = before.get(tid)
        if a is None:
            continue
        counters = [k for k in attrs.fields_dict(Task) if k != "comm"]
        deltas[tid] = (b.comm, {k: float(getattr(b, k) - getattr(a, k)) for k in counters})
    if decode is None:
        decode = max(deltas, key=lambda t: deltas[t][1]["run_s"])
    others = {
        f"{comm} {tid}": (d["run_s"], int(d["voluntary"]))
        for tid, (comm, d) in deltas.items()
        if tid != decode and (d["run_s"] > 0 or d["voluntary"] > 0)
    }
    return Window(tokens=tokens, passes=passes, wall_s=wall_s, decode=deltas[decode][1], others=others)


# -- in process -------------------------------------------------------------------------------------------------


class _Sender:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.done = threading.Event()

    def send(self, response: object = None, flags: int = 0) -> None:
        if self.wait_s:
            time.sleep(self.wait_s)  # releases the GIL, as the Python backend's send() does for its round trip
        if flags & 1:
            self.done.set()

    def is_cancelled(self) -> bool:
        return False


class InProcess:
    """bench/chat.py's engine alone, driven on this thread or on the StepLoop's own thread."""

    def __init__(self) -> None:
        self.alone = bench_chat.EngineAlone()
        self.passes_only: list[float] = []  # bench/chat.py's figure: its decode passes' CPU per 1,000 tokens

    def run(self, rows: int, tokens: int, *, threaded: bool, send_s: float = 0.0) -> Window:
        from triton_npu_client.server import StepLoop

        engine, loop = self.alone.rig(rows)
        if threaded:
            # The rig's loop drives no thread; this one is the served model's: its own thread and send thread.
            loop = StepLoop(
                step=engine.step, admit=engine.admit, on_exit=engine.on_exit, final_flag=1,
                error_response=lambda m: m, overlap="supersede",
            )  # fmt: skip

        def submit(key: int, start: bool, text: str, n: int) -> _Sender:
            sender = _Sender(send_s)
            turn = engine.parse(
                key=key, start=start, end=False, roles=["user"], texts=[text], max_tokens=n, min_tokens=n
            )
            loop.submit(key, sender, turn)
            return sender

        def finish(senders: list[_Sender]) -> None:
            for sender in senders:
                while not sender.done.is_set():
                    if threaded:
                        sender.done.wait()
                    else:
                        loop.run_pass()

        try:
            questions = bench_chat.QUESTIONS
            finish([submit(k, True, questions[k % len(questions)], 1) for k in range(1, rows + 1)])
            tid = loop._thread.native_id if threaded and loop._thread is not None else threading.get_native_id()
            before, start = read_tasks(os.getpid()), time.perf_counter()
            finish([submit(k, False, "Go on.", tokens) for k in range(1, rows + 1)])
            wall = time.perf_counter() - start
            after = read_tasks(os.getpid())
        finally:
            loop.close()
        return window(before, after, tokens=rows * tokens, passes=tokens, wall_s=wall, decode=tid)

    def passes_cpu(self, rows: int, tokens: int) -> float:
        """bench/chat.py's own figure for the same turns: CPU-s per 1,000 tokens of its decode passes alone."""
        return float(self.alone.turns(rows, tokens).pass_cpu_per_1k)


# -- in the stub --------------------------------------------------------------------------------------------------


async def served(model: Model, stub: int, rows: int, tokens: int) -> Window:
    """bench/chat.py's aggregate turns on ``model``, the stub's threads read around the generating turns."""
    sessions = [model.sequence() for _ in range(rows)]
    try:
        for i, seq in enumerate(sessions):
            question = bench_chat.QUESTIONS[i % len(bench_chat.QUESTIONS)]
            await bench_chat.timed(seq.stream({**bench_chat.messages(("user", question)), **bench_chat.fixed(1)}))
        before, start = read_tasks(stub), time.perf_counter()
        turns = await asyncio.gather(
            *(
                bench_chat.timed(seq.stream({**bench_chat.messages(("user", "Go on.")), **bench_chat.fixed(tokens)}))
                for seq in sessions
            )
        )
        wall = time.perf_counter() - start
        after = read_tasks(stub)
    finally:
        for seq in sessions:
            await seq.aclose()
    return window(before, after, tokens=sum(t.tokens for t in turns), passes=tokens, wall_s=wall, decode=None)


def venv_libpython() -> Path | None:
    """This interpreter's shared libpython when it is not the system's (what the bundled stub links), else None."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    found = Path(str(sysconfig.get_config_var("LIBDIR"))) / str(sysconfig.get_config_var("INSTSONAME"))
    if not found.is_file() or (SYSTEM_LIBPYTHON.exists() and found.resolve() == SYSTEM_LIBPYTHON.resolve()):
        return None
    return found


def entry(repository: Path, name: str, **parameters: str) -> None:
    """The GPT-2 demo as the packaged `chat` serves it (one torch thread), with ``parameters`` set."""
    write_chat_model(
        repository, bench_chat.CHECKPOINT, name=name, max_ctx=bench_chat.MAX_CTX, dtype="float32", device="cpu",
        max_cache_mb=512, cpu_threads=1,
    )  # fmt: skip
    config = repository / name / "config.pbtxt"
    text = config.read_text()
    lines = [f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in parameters.items()]
    config.write_text(text.replace("instance_group", "\n".join([*lines, "instance_group"]), 1))


# -- the micro benchmark ------------------------------------------------------------------------------------------

MICRO = r"""
import time, torch
torch.set_num_threads(1)
x = torch.ones(4, 8)
def python():
    d, s = {}, 0
    for i in range(200000):
        d[i & 1023] = i
        s += len(str(i)) + d[i & 1023] % 7
    return s
def dispatch():
    y = x
    for _ in range(20000):
        y = (y + 1.0) * 0.5
    return y
out = []
for work in (python, dispatch):
    times = []
    for _ in range(7):
        start = time.thread_time(); work(); times.append(time.thread_time() - start)
    out.append(sorted(times)[3] * 1e3)
print(*out)
"""


def micro(libpython_dir: str | None) -> tuple[float, float]:
    env = dict(os.environ)
    if libpython_dir is not None:
        env["LD_LIBRARY_PATH"] = libpython_dir
    done = subprocess.run([sys.executable, "-c", MICRO], env=env, capture_output=True, text=True, check=True)
    python_ms, dispatch_ms = map(float, done.stdout.split())
    return python_ms, dispatch_ms


# -- the run ----------------------------------------------------------------------------------------------------


Contender = Callable[[], Any]


async def main(args: argparse.Namespace) -> int:
    med = statistics.median
    results: dict[str, list[Window]] = {}
    passes_only: list[float] = []
    own_lib = venv_libpython()
    async with contextlib.AsyncExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-chat-stub-")))
        variants: dict[str, tuple[dict[str, str], dict[str, str]]] = {
            "stub": ({}, {}),
            "stub, glibc defaults": ({"keep_freed_memory": "false"}, {}),
            "stub, no overlap": ({"overlap_sends": "false"}, {}),
        }
        if own_lib is not None:
            # LocalTriton puts the bundled server's libraries on LD_LIBRARY_PATH; an env of our own replaces it.
            bundled = importlib.metadata.distribution("nvidia-pytriton").locate_file("nvidia_pytriton.libs")
            parts = (str(own_lib.parent), str(bundled), os.environ.get("LD_LIBRARY_PATH", ""))
            libs = os.pathsep.join(p for p in parts if p)
            variants["stub, the venv's libpython"] = ({}, {"LD_LIBRARY_PATH": libs})
        models: dict[str, tuple[Model, int]] = {}
        for i, (label, (parameters, env)) in enumerate(variants.items()):
            repository = work / f"repository{i}"
            entry(repository, "chat", **parameters)
            server = await stack.enter_async_context(LocalTriton(repository, env=env))
            client = await stack.enter_async_context(Client(server.grpc_url, timeout_s=300))
            model = await client.model("chat")
            procs = bench_chat.Processes.find(server.grpc_url, "chat")
            assert procs is not None, "the stub of a local server"
            models[label] = (model, procs.pids["stub"])
        inproc = InProcess()
        contenders: dict[str, Callable[[], Any]] = {
            "in process, on this thread": lambda: inproc.run(args.chats, args.tokens, threaded=False),
            "in process, loop thread": lambda: inproc.run(args.chats, args.tokens, threaded=True),
            f"in process, loop thread, {SEND_S * 1e3:.2f} ms sends": lambda: inproc.run(
                args.chats, args.tokens, threaded=True, send_s=SEND_S
            ),
        }
        for label, (model, stub) in models.items():
            contenders[label] = lambda model=model, stub=stub: served(model, stub, args.chats, args.tokens)
        # Warm-up: each contender once, small (first calls pay lazy initialisation).
        for model, stub in models.values():
            await served(model, stub, 4, 8)
        inproc.run(4, 8, threaded=False)
        inproc.run(4, 8, threaded=True)
        names = list(contenders)
        for r in range(args.rounds):
            for label in names if r % 2 == 0 else names[::-1]:
                out = contenders[label]()
                results.setdefault(label, []).append(await out if asyncio.iscoroutine(out) else out)
            passes_only.append(inproc.passes_cpu(args.chats, args.tokens))
    micro_runs: dict[str, list[tuple[float, float]]] = {}
    if own_lib is not None and SYSTEM_LIBPYTHON.exists():
        for r in range(args.micro_rounds):
            order = [("the venv's", None), ("the system's (the stub's)", str(SYSTEM_LIBPYTHON.parent))]
            for label, libdir in order if r % 2 == 0 else order[::-1]:
                micro_runs.setdefault(label, []).append(micro(libdir))

    print(
        f"## The decode thread, {args.chats} conversations x {args.tokens} tokens, a response per token "
        f"(medians of {args.rounds} rounds, order alternating)\n"
    )
    base = med(w.per_1k("run_s") for w in results["in process, on this thread"])
    print(
        "| contender | CPU-s / 1k tokens | vs in process | user / sys (s / 1k) | CPU ms / pass | wall ms / pass | "
        "runqueue ms / pass | voluntary / pass | involuntary / pass | minor faults / pass | other threads that ran "
        "(CPU-s / 1k) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, runs in results.items():
        cpu = med(w.per_1k("run_s") for w in runs)
        others = med(sum(c for c, _ in w.others.values()) / w.tokens * 1e3 for w in runs)
        count = med(len(w.others) for w in runs)
        print(
            f"| {label} | {cpu:.3f} | {cpu / base:.2f}x | {med(w.per_1k('utime_s') for w in runs):.3f} / "
            f"{med(w.per_1k('stime_s') for w in runs):.3f} | {med(w.per_pass('run_s') for w in runs) * 1e3:.2f} | "
            f"{med(w.wall_s / w.passes for w in runs) * 1e3:.2f} | "
            f"{med(w.per_pass('wait_s') for w in runs) * 1e3:.2f} | "
            f"{med(w.per_pass('voluntary') for w in runs):.1f} | {med(w.per_pass('involuntary') for w in runs):.1f} | "
            f"{med(w.per_pass('minflt') for w in runs):.1f} | {count:.0f} ({others:.3f}) |"
        )
    only = med(passes_only)
    print(
        f"\nbench/chat.py's engine-alone figure for the same turns (its decode passes only, the admitting pass left "
        f"out): {only:.3f} CPU-s / 1k tokens; the stub's window against it: "
        f"{med(w.per_1k('run_s') for w in results['stub']) / only:.2f}x\n"
    )
    print("Threads of the stub that ran during the last round's window (CPU s, voluntary switches):\n")
    for label in models:
        shown = ", ".join(f"{n}: {c * 1e3:.0f} ms / {v}" for n, (c, v) in sorted(results[label][-1].others.items()))
        print(f"- {label}: {shown}")
    if micro_runs:
        print(f"\n## Pure Python in this interpreter's libpython and in the system's ({args.micro_rounds} rounds)\n")
        print("| libpython | dict/str loop, ms (median) | 20,000 small torch ops, ms (median) |")
        print("|---|---|---|")
        for label, runs in micro_runs.items():
            print(f"| {label} | {med(p for p, _ in runs):.1f} | {med(d for _, d in runs):.1f} |")
        (own_py, own_ops), (sys_py, sys_ops) = (
            (med(p for p, _ in runs), med(d for _, d in runs)) for runs in micro_runs.values()
        )
        print(f"\nsystem / venv: {sys_py / own_py:.2f}x (Python), {sys_ops / own_ops:.2f}x (torch dispatch)")
    print(
        f"\nRun: `{' '.join(['.venv/bin/python', 'bench/chat_stub.py', *sys.argv[1:]])}` on {platform.node()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end."
    )
    return 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5; --quick: 1)")
    p.add_argument("--chats", type=int, default=None, help="conversations at once (default 32; --quick: 4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens each turn makes (default 64; --quick: 8)")
    p.add_argument("--micro-rounds", type=int, default=None, help="micro benchmark rounds (default 6; --quick: 1)")
    p.add_argument("--quick", action="store_true", help="a smoke run: --rounds 1 --chats 4 --tokens 8")
    args = p.parse_args(argv)
    defaults = {"rounds": (5, 1), "chats": (32, 4), "tokens": (64, 8), "micro_rounds": (6, 1)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
