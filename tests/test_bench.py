"""The benchmark scripts run end to end (smoke runs; their numbers are not asserted, only their shape)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from triton_npu_client import LocalTriton

ROOT = Path(__file__).resolve().parent.parent
PLAIN = "tritonclient.grpc.aio loop"
PERF_ANALYZER = "perf_analyzer (C++)"
THIS_CLIENT = (
    "this client (model.infer, default)",
    "this client (model.infer, no coalescing)",
    "this client (prebuilt request, no coalescing)",
)
THIS_CLIENT_SESSIONS = ("this client (streaming sessions, seq_stats_stream)", "this client (unary sessions)")


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The script, in a process group of its own: on a timeout the whole group is killed, so a child it started
    (perf_analyzer, a server) cannot outlive the test as subprocess.run's kill of the script alone would let it.
    A timeout fails with what the script had printed by then (where it hung), not only the timeout."""
    with subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        hung = False
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if hung:
            out, err = proc.communicate(timeout=30)
            raise AssertionError(
                f"{shlex.join(args)} ran past {timeout_s} s; its stdout ended:\n{out[-3000:]}\nits stderr ended:\n"
                f"{err[-3000:]}"
            )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_client_vs_tritonclient_quick_on_its_own_server(tmp_path: Path) -> None:
    """--quick starts its own server and prints a row per contender and concurrency with positive throughput.

    One concurrency (every contender's code path is the same at 1 and at 4; the suite's time is not)."""
    out = tmp_path / "rows.json"
    args = ["bench/client_vs_tritonclient.py", "--quick", "--concurrency", "4", "--seconds", "0.5", "--json", str(out)]
    proc = _run(args, timeout_s=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cells = {(r["contender"], r["concurrency"]) for r in rows}
    assert cells == {(c, 4) for c in (PLAIN, PERF_ANALYZER, *THIS_CLIENT)}
    assert all(r["infer_s"] > 0 and r["errors"] == 0 and r["avg_batch"] >= 1.0 for r in rows)
    # The printed table has the same rows, and says how it was run.
    table_rows = [line for line in proc.stdout.splitlines() if line.startswith(f"| {PLAIN}")]
    assert len(table_rows) == 1
    assert proc.stdout.startswith("python bench/client_vs_tritonclient.py --quick --concurrency 4 --seconds 0.5")


def test_sequences_quick(triton_server: LocalTriton, tmp_path: Path) -> None:
    """The sequence benchmark runs the plain loop, this client's sessions and perf_analyzer on seq_stats_oldest."""
    out = tmp_path / "rows.json"
    url = f"127.0.0.1:{triton_server.grpc_port}"
    args = ["bench/sequences.py", "--quick", "--seconds", "0.5", "--url", url, "--json", str(out)]
    proc = _run(args, timeout_s=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    expected = {(c, 16) for c in (PLAIN, PERF_ANALYZER, *THIS_CLIENT_SESSIONS)}
    assert {(r["contender"], r["concurrency"]) for r in rows} == expected
    bad = [r for r in rows if not (r["infer_s"] > 0 and r["errors"] == 0 and r["failure"] is None)]
    assert bad == [], proc.stderr[-3000:]
    # Sequences from 16 concurrent clients really batch on the server (oldest strategy).
    assert all(r["avg_batch"] > 1.0 for r in rows)


def test_table_prints_crashed_rows_without_ratios() -> None:
    """A failed contender's row reads "crashed", and no ratio is computed against or from it."""
    sys.path.insert(0, str(ROOT / "bench"))  # bench/ is a folder of scripts, not a package
    try:
        common = importlib.import_module("common")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    Run, median_run, table = common.Run, common.median_run, common.table
    ok = Run(contender=PLAIN, concurrency=16, requests=100, seconds=1.0, latencies_s=(0.01,) * 100)
    crashed = Run.crashed("this client (streaming sessions)", 16, "ConnectError('stream broke')")
    # One crashed repeat makes the cell crashed: a median must not hide a failure.
    assert median_run([ok, crashed, ok]).failure is not None
    lines = table([ok, crashed]).splitlines()
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[:3] == ["this client (streaming sessions)", "16", "crashed"]
    assert set(cells[3:]) == {"-"}
    assert [c.strip() for c in lines[2].strip("|").split("|")][-2] == "1.00x"


def test_chat_perf_analyzer_quick(chat_only_server: LocalTriton, tmp_path: Path) -> None:
    """perf_analyzer drives chat at concurrency 1 and 4: turns stream every token, no errors, commands printed."""
    out = tmp_path / "rows.json"
    url = f"127.0.0.1:{chat_only_server.grpc_port}"
    proc = _run(["bench/chat_perf_analyzer.py", "--quick", "--url", url, "--json", str(out)], timeout_s=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 4]
    assert all(r["failure"] is None and r["errors"] == 0 and r["turns_s"] > 0 for r in rows)
    # --quick asks for 8 tokens per turn, one response each: perf_analyzer counted every streamed response.
    assert all(r["responses_per_turn"] == pytest.approx(8.0, rel=1e-3) for r in rows)
    assert all(r["first_p50_ms"] > 0 for r in rows)
    assert proc.stdout.count("--streaming") == 2
    assert sum(line.startswith("| 1 |") or line.startswith("| 4 |") for line in proc.stdout.splitlines()) == 2


def _device_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/chat_device_check.py", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip


def test_chat_device_check_on_cpu() -> None:
    """On a CPU-only machine the chat device check picks the CPU, says it is a smoke check, passes its checks on
    the GPT-2 demo and a tiny Llama (paged cache, batched decode) and names the device."""
    proc = _device_check("--conversations", "3", "--tokens", "5", "--max-ctx", "256", "--families", "llama")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("-> cpu")
    assert "a smoke check" in lines[1]
    sections = [i for i, line in enumerate(lines) if line.startswith("== ")]
    assert [lines[i].split()[1] for i in sections] == ["GPT2", "Llama"]
    for at in sections:
        assert re.fullmatch(r"weights: \d+ tensors on cpu", lines[at + 1])
        # Per kv head, three conversations' blocks of 16 positions (256 each), keys and values of every layer.
        assert re.fullmatch(r"KV cache blocks \[\d+, 48, 16, \d+\] per layer: \d+ tensors on cpu", lines[at + 2])
    wanted = "engine on cpu (ref) vs argmax of a plain batched forward: equal (3 conversations x 5 tokens)"
    assert lines.count(wanted) == 2
    rows = [lines[i + 1].split() for i, line in enumerate(lines) if line.startswith("device ")]
    assert [row[:2] for row in rows] == [["cpu", "3"], ["cpu", "3"]]
    assert all(float(cell.replace(",", "")) > 0 for row in rows for cell in row[2:6])
    assert lines[-1] == "OK"


def test_chat_device_check_fails_for_an_absent_device() -> None:
    """Forcing a device this machine lacks is a failed check with a reason, never a silent fallback to CPU."""
    proc = _device_check("--device", "npu", "--conversations", "1", "--tokens", "1")
    assert proc.returncode == 2
    assert proc.stdout.startswith("FAIL: device 'npu' was forced")


def test_chat_bench_quick(triton_server: LocalTriton) -> None:
    """bench/chat.py prints its three server tables and the engine-alone table, with a ratio against each goal."""
    proc = _run(
        ["bench/chat.py", "--url", triton_server.grpc_url, "--repeats", "1", "--tokens", "8", "--chats", "4",
         "--turns", "3", "--no-cache", "--no-compile"],
        timeout_s=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for goal in ("goal <= 1.3x", "goal >= 8x", "goal >= 5x", "goal >= 0.85x"):
        assert re.search(rf"\*\*[\d.]+x[^*]*\*\* \({goal}: (met|NOT met)\)", out), goal
    assert "## The engine alone, in process" in out
    # Every measured figure is a positive number.
    figures = [float(m) for m in re.findall(r"\| ([\d.]+) \| [\d., ]+ \|", out)]
    assert len(figures) >= 6
    assert all(f > 0 for f in figures)


def test_score_bench_quick(triton_server: LocalTriton) -> None:
    """bench/score.py --quick prints its three tables with positive figures (numbers not asserted)."""
    args = ["bench/score.py", "--quick", "--models", "scale_fp32", "--url", triton_server.grpc_url]
    proc = _run(args, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    row = re.search(r"^\| scale_fp32 \| 64 \| 2,000 \| ([\d,]+) \(2\) \| ([\d,]+) \| \*\*([\d.]+)x\*\*", out, re.M)
    assert row is not None, out
    assert all(float(v.replace(",", "")) > 0 for v in row.groups())
    for fmt in ("npy",):
        assert re.search(rf"^\| \.{fmt} \| now \| [\d.]+ MiB \| [\d.]+ MiB \| \*\*[\d.]+x\*\* \|$", out, re.M), out
    assert re.search(r"^\| 4 \| [\d,.]+ \| [\d,.]+ \| [\d,]+ \| [\d,]+ \| \*\*[\d.]+x\*\* \|$", out, re.M), out


def test_chat_turns_bench_quick() -> None:
    """bench/chat_turns.py --quick: a row per way of sending a turn, each figure positive, and the ratio line."""
    proc = _run(["bench/chat_turns.py", "--quick"], timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    row = r"^\| now \| (ChatSession\.send|seq\.stream) \| (\d+) \| ([\d.]+) \| ([\d,]+) \| [\d, ]+ \|$"
    rows = re.findall(row, out, re.M)
    assert sorted(how for how, *_ in rows) == ["ChatSession.send", "seq.stream"], out
    assert all(float(v.replace(",", "")) > 0 for _, *figures in rows for v in figures)
    assert re.search(r"ChatSession\.send vs seq\.stream, client CPU a token: \*\*[\d.]+x\*\*", out), out


def test_chat_cache_bench_figures_and_verdicts(tmp_path: Path) -> None:
    """bench/chat_cache.py without a server: the slot formula is b1a3b0a's, the length mix has its mean, the
    generated entries take the parameters, and a ratio under its goal reads NOT met (bench/chat.py --no-cache
    keeps its own smoke run off these sections: a full run starts a server of four chat models)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        cc = importlib.import_module("chat_cache")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    import numpy as np

    from triton_npu_client import write_chat_model

    # b1a3b0a's kv_bytes_per_position for GPT-2: 2 * n_layer * n_embd * element size (float32).
    assert cc.kv_bytes_per_position(cc.DEMO) == 2 * 4 * 192 * 4
    # 128 MiB of 1,536-position slots of 6,144 bytes a position: 14 conversations; max_sequences caps too.
    assert cc.slot_capacity(128, 1536, 6144, 1024) == 14
    assert cc.slot_capacity(128, 1536, 6144, 3) == 3
    lengths = cc.length_mix(4000, np.random.default_rng(0), 4096)
    assert min(lengths) >= cc.MIN_TOKENS
    assert max(lengths) <= 4096
    assert 180 <= sum(lengths) / len(lengths) <= 220

    name = write_chat_model(tmp_path, cc.DEMO, name="entry", max_cache_mb=64)
    config = tmp_path / name / "config.pbtxt"
    cc.set_parameters(config, share_prefixes="false", evict_min_idle_ms="-1")
    text = config.read_text()
    assert 'parameters { key: "evict_min_idle_ms" value: { string_value: "-1" } }' in text
    assert 'parameters { key: "share_prefixes" value: { string_value: "false" } }' in text
    assert text.count('key: "evict_min_idle_ms"') == 1

    subject = cc.Subject(
        label="demo", folder=cc.DEMO, max_ctx=1536, cache_mb=128, bytes_per_position=6144, max_sequences=1024,
        shared="on", unshared="off",
    )  # fmt: skip
    held = cc.Capacity(
        held=50, live=50, kv_bytes=1, positions=10_000, lengths=[200] * 50, cut_short=0, refused=cc.FULL + ": more"
    )
    fast, slow = cc.Opening(ttft_s=0.1, prompt_tokens=30), cc.Opening(ttft_s=0.4, prompt_tokens=530)
    ttft = cc.Ttft(shared=[cc.Round([fast, fast], 0.1)], unshared=[cc.Round([slow, slow], 0.4)], system_tokens=500)
    res = cc.Results([subject], capacity={"demo": held}, ttft={"demo": ttft})
    args = cc.parse(["--quick"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cc.print_capacity(res)
        cc.print_ttft(args, res)
    printed = out.getvalue()
    assert "demo: paged vs the slot design: **3.6x** (goal >= 4x: NOT met)" in printed
    assert "demo: shared vs not: **4.0x faster** (goal >= 5x: NOT met); by the stub's CPU: 4.0x" in printed


def _bench_module(name: str) -> object:
    sys.path.insert(0, str(ROOT / "bench"))  # bench/ is a folder of scripts, not a package
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_peer_options_parse_and_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/chat.py --peer llama-server=PATH --threads N,M: the path made absolute, the counts a tuple; a wrong
    kind, an empty path, a bad count, --peer with --url and --llama-shape without --llama are refused."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # parse() imports bench/chat_cache.py, as the script does
    peer: Any = _bench_module("peer_llamacpp")
    chat: Any = _bench_module("chat")
    args = chat.parse(["--llama", "--llama-shape", "smollm2-135m", "--peer", "llama-server=bin/llama-server",
                       "--threads", "2,1"])  # fmt: skip
    assert args.peer == peer.Peer("llama-server", Path.cwd() / "bin" / "llama-server")
    assert args.threads == (2, 1)
    assert args.llama_shape == "smollm2-135m"
    plain = chat.parse([])
    assert plain.peer is None
    assert plain.threads == (1, 2)
    assert plain.llama_shape == "demo"
    for bad in ("vllm=/x", "llama-server", "llama-server=", "llama-server= "):
        with pytest.raises(argparse.ArgumentTypeError):
            peer.parse_peer(bad)
    for bad in ("0", "1,1", "a", "", "1,-2"):
        with pytest.raises(argparse.ArgumentTypeError):
            peer.parse_threads(bad)
    for argv in (["--peer", "llama-server=/x", "--url", "127.0.0.1:1"], ["--llama-shape", "demo"]):
        with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
            chat.parse(argv)


def _fake_llama_cpp(root: Path) -> Path:
    """A folder shaped as llama.cpp's tree where the pre-tokenizer shim looks: conversion/base.py's TextModel whose
    get_vocab_base_pre behaves as the real one (a name for a known hash, NotImplementedError for an unknown one),
    and a converter script that prints what it returns for the tokenizer named by the checkpoint folder."""
    (root / "conversion").mkdir(parents=True)
    (root / "gguf-py").mkdir()
    (root / "build" / "bin").mkdir(parents=True)
    (root / "build" / "bin" / "llama-server").write_text("")
    (root / "conversion" / "__init__.py").write_text("")
    (root / "conversion" / "base.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        if tokenizer == 'known':\n"
        "            return 'llama-bpe'\n"
        "        if tokenizer == 'other':\n"
        "            raise NotImplementedError('something else')\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized - update get_vocab_base_pre()')\n"
    )
    (root / "convert_hf_to_gguf.py").write_text(
        "import sys\nfrom pathlib import Path\nfrom conversion.base import TextModel\n"
        "args = sys.argv[1:]\n"
        "pre = TextModel().get_vocab_base_pre(Path(args[0]).name)\n"
        "Path(args[args.index('--outfile') + 1]).write_text(f'{pre} {args[1:args.index(\"--outfile\")]}')\n"
    )
    return root / "build" / "bin" / "llama-server"


def test_peer_converter_command_registers_an_unknown_pre_tokenizer(tmp_path: Path) -> None:
    """The converter is found above the llama-server binary and run through the shim: an unrecognised
    pre-tokenizer becomes gpt-2, a known one stays the converter's, any other refusal still fails; f32 asked."""
    peer: Any = _bench_module("peer_llamacpp")
    server = _fake_llama_cpp(tmp_path / "llama.cpp")
    converter = peer.find_converter(server)
    assert converter == tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    with pytest.raises(FileNotFoundError):
        peer.find_converter(tmp_path / "elsewhere" / "llama-server")
    env = peer.converter_env(converter, {"PYTHONPATH": "/somewhere/else", "HOME": "/root"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "llama.cpp" / "gguf-py"), "/somewhere/else"]
    results = {}
    for name in ("random", "known", "other"):
        out = tmp_path / f"{name}.gguf"
        command = peer.converter_command(converter, tmp_path / name, out)
        assert command[:2] == [sys.executable, "-c"]
        assert command[3:5] == [str(converter), "gpt-2"]
        proc = subprocess.run(command, env=peer.converter_env(converter), capture_output=True, text=True, check=False)
        results[name] = (proc.returncode, out.read_text() if out.exists() else proc.stderr)
    assert results["random"] == (0, "gpt-2 ['--outtype', 'f32']")
    assert results["known"] == (0, "llama-bpe ['--outtype', 'f32']")
    assert results["other"][0] != 0
    assert "NotImplementedError: something else" in results["other"][1]


def test_peer_server_command() -> None:
    """llama-server on loopback, a slot per conversation of bench/chat.py's MAX_CTX each, the threads for both
    phases, the KV cache float32; --no-webui only where the binary has it."""
    peer: Any = _bench_module("peer_llamacpp")
    chat: Any = _bench_module("chat")
    command = peer.server_command(Path("/b/llama-server"), Path("/m.gguf"), port=8123, slots=32, threads=2)
    # Each option with its value; a bare flag (followed by another option or nothing) maps to "".
    flags = {
        word: (command[i + 1] if i + 1 < len(command) and not command[i + 1].startswith("--") else "")
        for i, word in enumerate(command)
        if word.startswith("--")
    }
    assert command[0] == "/b/llama-server"
    assert flags["--host"] == "127.0.0.1"
    assert flags["--parallel"] == "32"
    assert int(flags["--ctx-size"]) == 32 * chat.MAX_CTX == 32 * peer.CTX_PER_CONVERSATION
    assert flags["--threads"] == flags["--threads-batch"] == "2"
    assert flags["--cache-type-k"] == flags["--cache-type-v"] == "f32"
    assert flags["--cont-batching"] == flags["--no-webui"] == ""
    assert "--no-webui" not in peer.server_command(
        Path("/b"), Path("/m"), port=1, slots=1, threads=1, no_webui=False
    )


def test_peer_table_ratios_goals_and_verdicts() -> None:
    """The table divides ours by llama.cpp's medians, holds each to issue 23's goal for its shape and thread count
    (latency <= 1.0x on SmolLM2's shape, <= 1.5x on the tiny ones; 32 conversations >= 1.5x at one thread, >= 1.0x
    at two) and says met or NOT met; agreement counts the leading tokens that spell ours; a too long conversation
    loses its oldest messages as on our server."""
    peer: Any = _bench_module("peer_llamacpp")
    assert peer.goals("smollm2-135m", 1) == peer.Goals(latency=1.0, throughput=1.5)
    assert peer.goals("demo", 2) == peer.Goals(latency=1.5, throughput=1.0)
    assert peer.goals(None, 2).latency == 1.0
    ours = peer.Side(
        ms_per_token=[12.0, 11.0, 13.0], one_tokens_per_s=[80.0], ttft_first_ms=[10.0], ttft_turn_ms=[30.0],
        many_tokens_per_s=[300.0], cpu_per_1k=[2.0],
    )  # fmt: skip
    theirs = peer.Side(
        ms_per_token=[10.0, 10.0, 10.0], one_tokens_per_s=[100.0], ttft_first_ms=[20.0], ttft_turn_ms=[20.0],
        many_tokens_per_s=[250.0], cpu_per_1k=[1.0],
    )  # fmt: skip
    res = [peer.Comparison(1, ours, theirs), peer.Comparison(2, ours, theirs)]
    rows = {
        (cells[0], cells[1]): cells[2:]
        for line in peer.table(res, "smollm2-135m", 32, 10).splitlines()[2:]
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert rows[("1", "one conversation: ms per token")] == [
        "12.00 (12.00, 11.00, 13.00)", "10.00 (10.00, 10.00, 10.00)", "**1.20x**", "<= 1.0x", "NOT met"
    ]
    assert rows[("1", "TTFT, a short first turn (ms)")][2:] == ["**0.50x**", "<= 1.0x", "met"]
    assert rows[("1", "TTFT at turn 10, history kept (ms)")][2:] == ["**1.50x**", "<= 1.0x", "NOT met"]
    assert rows[("1", "32 conversations: tokens/s")][2:] == ["**1.20x**", ">= 1.5x", "NOT met"]
    assert rows[("2", "32 conversations: tokens/s")][2:] == ["**1.20x**", ">= 1.0x", "met"]
    assert rows[("2", "32 conversations: server CPU-s per 1,000 tokens")][2:] == ["**2.00x**", "-", "-"]
    tiny = peer.table(res[:1], "demo", 32, 10)
    assert "| 1 | one conversation: ms per token | 12.00 (12.00, 11.00, 13.00) | 10.00 (10.00, 10.00, 10.00) | " \
        "**1.20x** | <= 1.5x | met |" in tiny
    assert peer.verdict(float("nan"), 1.0, at_most=True) == "NOT met"
    # Context overflow as ours: the fewest oldest messages go, the system message stays, a user message leads.
    def render(messages: list[tuple[str, str]]) -> list[int]:
        return [0] * sum(len(text) for _, text in messages)

    talk = [("system", "s" * 10), ("user", "u" * 30), ("assistant", "a" * 30), ("user", "v" * 20)]
    assert peer.fit(talk, 10, render, 100) == talk
    assert peer.fit(talk, 11, render, 100) == [talk[0], talk[3]]  # the assistant reply cannot lead: both go
    with pytest.raises(RuntimeError):
        peer.fit(talk, 71, render, 100)
    spell = {1: b"ab", 2: b"c", 3: b"x"}.__getitem__
    assert peer.agreeing(b"abcd", [1, 2, 3], lambda ids: b"".join(spell(i) for i in ids)) == 2
    assert peer.agreeing(b"", [1], lambda ids: b"".join(spell(i) for i in ids)) == 0


def test_random_llama_reaches_a_wanted_vocabulary(tmp_path: Path) -> None:
    """tests/_checkpoints.py's tokenizer_vocab: above its corpus' merges, seeded filler text gets the BPE (and the
    model's vocab_size) to exactly the size asked; the SmolLM2 shape asks bench/chat_cache.py for 49,152."""
    from _checkpoints import write_tiny_llama
    from tokenizers import Tokenizer

    folder = write_tiny_llama(tmp_path / "big", tokenizer_vocab=2000)
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == 2000
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() == 2000
    small = write_tiny_llama(tmp_path / "small")
    assert json.loads((small / "config.json").read_text())["vocab_size"] == 400
    cc: Any = _bench_module("chat_cache")
    assert cc.LLAMA_SHAPES["smollm2-135m"]["vocab_size"] == 49152
    assert cc.describe_shape("smollm2-135m") == "30 layers of 576, 9 heads (3 key/value), vocabulary 49,152"
    assert cc.describe_shape("demo") == "4 layers of 192, 4 heads (2 key/value), vocabulary 400"
