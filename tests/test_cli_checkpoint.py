"""Serving your own checkpoint: the generated repository entry, the refusals before any server starts, and
``triton-npu serve --chat`` / ``triton-npu chat --checkpoint`` answering a real client.

The generated config is parsed back the way Triton reads it (protobuf text format, then the JSON a Python model
gets, read with the toolkit's own ``model_parameter``). The mistakes run ``main()`` in this process with
``LocalTriton`` replaced by a trap, so a check that came after the server start would fail the test. The
end-to-end run starts one ``serve`` and one ``chat`` subprocess at once, on a GPT-2 and a tiny Llama checkpoint.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import pytest
from google.protobuf import json_format, text_format
from safetensors.numpy import save_file
from tritonclient.grpc import model_config_pb2

import triton_npu_client.cli as cli
import triton_npu_client.cli._chat as cli_chat
from triton_npu_client import Client, UsageError, default_model_repository
from triton_npu_client._local import chat_model_name, chat_model_repository, read_chat_checkpoint, write_chat_model
from triton_npu_client.server._config import model_parameter

DEMO = default_model_repository() / "chat" / "demo_gpt2"
PACKAGED_CONFIG = default_model_repository() / "chat" / "config.pbtxt"
# A safety net only: each wait ends as soon as the output it waits for appears.
WAIT_S = 240.0
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"


# -- checkpoint folders ---------------------------------------------------------------------------------------


def gpt2_checkpoint(folder: Path) -> Path:
    """A copy of the GPT-2 demo checkpoint (with its tokenizer_config.json's chat template) at ``folder``."""
    shutil.copytree(DEMO, folder, ignore=shutil.ignore_patterns("*.md"))
    if not (folder / "tokenizer_config.json").is_file():
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return folder


def llama_like_checkpoint(folder: Path, **config: Any) -> Path:
    """A folder shaped like a sharded Llama 3 checkpoint: its config.json, tokenizer files, an index and shards.

    The shards are empty: only the JSON files are read when generating the entry."""
    folder.mkdir(parents=True)
    settings: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0},
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    }
    settings.update(config)
    (folder / "config.json").write_text(json.dumps(settings))
    shutil.copyfile(DEMO / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for shard in shards:
        (folder / shard).write_bytes(b"")
    index = {"weight_map": {"model.embed_tokens.weight": shards[0], "lm_head.weight": shards[1]}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def snapshot(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every entry under ``folder`` (itself included): (mtime_ns, size, sha256 of a file's bytes)."""
    found = {}
    for path in [folder, *sorted(folder.rglob("*"))]:
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        found[str(path.relative_to(folder))] = (info.st_mtime_ns, info.st_size, digest)
    return found


def parsed(config_text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(config_text, model_config_pb2.ModelConfig())


def as_triton_json(config: model_config_pb2.ModelConfig) -> str:
    """The config as the JSON a Python model's ``args["model_config"]`` holds."""
    return str(json_format.MessageToJson(config, preserving_proto_field_name=True))


# -- the generated entry --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "max_ctx", "expected_ctx"),
    [("gpt2", None, 1536), ("gpt2", 700, 700), ("llama", None, 131072), ("llama", 4096, 4096), ("gpt2", 10**6, 1536)],
)
def test_generated_entry_holds_the_checkpoints_values(
    tmp_path: Path, family: str, max_ctx: int | None, expected_ctx: int
) -> None:
    """config.pbtxt is the packaged chat config (inputs, outputs, batching, other parameters) with checkpoint,
    max_ctx = min(the checkpoint's positions, the one given), dtype, device, max_cache_mb and cpu_threads set;
    model.py is the packaged one; the name is the folder's."""
    if family == "gpt2":
        checkpoint = gpt2_checkpoint(tmp_path / "my_gpt2")
    else:
        checkpoint = llama_like_checkpoint(tmp_path / "my_gpt2")
    name = write_chat_model(
        tmp_path / "repo", checkpoint, max_ctx=max_ctx, dtype="bfloat16", device="cpu", max_cache_mb=256.5,
        cpu_threads=3,
    )
    assert name == "my_gpt2"
    found = read_chat_checkpoint(checkpoint)
    assert found.model_type == family
    assert found.torch_dtype == {"gpt2": "float16", "llama": "bfloat16"}[family]
    entry = tmp_path / "repo" / name
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*")) == ["1", "1/model.py", "config.pbtxt"]
    assert (entry / "1" / "model.py").read_bytes() == (PACKAGED_CONFIG.parent / "1" / "model.py").read_bytes()

    generated = parsed((entry / "config.pbtxt").read_text())
    as_json = as_triton_json(generated)
    assert model_parameter(as_json, "checkpoint") == str(checkpoint.resolve())
    assert model_parameter(as_json, "max_ctx") == str(expected_ctx)
    assert model_parameter(as_json, "dtype") == "bfloat16"
    assert model_parameter(as_json, "device") == "cpu"
    assert model_parameter(as_json, "max_cache_mb") == "256.5"
    assert model_parameter(as_json, "cpu_threads") == "3"

    packaged = parsed(PACKAGED_CONFIG.read_text())
    set_here = {"checkpoint", "max_ctx", "dtype", "device", "max_cache_mb", "cpu_threads"}
    assert {k: v.string_value for k, v in generated.parameters.items() if k not in set_here} == {
        k: v.string_value for k, v in packaged.parameters.items() if k not in set_here
    }
    assert generated.name == name
    for config in (generated, packaged):
        config.ClearField("name")
        config.ClearField("parameters")
    assert generated == packaged


def test_defaults_keep_the_packaged_cache_cap_and_choose_dtype_and_device_at_load(tmp_path: Path) -> None:
    """Without options: dtype, device and cpu_threads "auto" (the engine chooses when it loads: cpu_threads the
    cores the stub may run on), max_cache_mb the packaged model's."""
    name = write_chat_model(tmp_path / "repo", llama_like_checkpoint(tmp_path / "ckpt", max_position_embeddings=4096))
    as_json = as_triton_json(parsed((tmp_path / "repo" / name / "config.pbtxt").read_text()))
    assert (model_parameter(as_json, "dtype"), model_parameter(as_json, "device")) == ("auto", "auto")
    assert model_parameter(as_json, "cpu_threads") == "auto"
    assert model_parameter(as_json, "max_ctx") == "4096"
    assert model_parameter(as_json, "max_cache_mb") == model_parameter(
        as_triton_json(parsed(PACKAGED_CONFIG.read_text())), "max_cache_mb"
    )


def test_transformers_5_dtype_key_is_read(tmp_path: Path) -> None:
    """transformers 5 saves config.json's dtype as "dtype", not "torch_dtype"."""
    folder = llama_like_checkpoint(tmp_path / "ckpt", dtype="float32")
    config = json.loads((folder / "config.json").read_text())
    del config["torch_dtype"]
    (folder / "config.json").write_text(json.dumps(config))
    assert read_chat_checkpoint(folder).torch_dtype == "float32"


def test_a_path_with_quotes_and_backslashes_is_written_exactly(tmp_path: Path) -> None:
    """The checkpoint parameter is a protobuf string literal: quotes, backslashes and a tab in the folder's path
    come back as they were; the default name replaces what a model name cannot hold."""
    odd = 'we said "hi"\\ there\tnow'
    checkpoint = llama_like_checkpoint(tmp_path / odd)
    name = write_chat_model(tmp_path / "repo", checkpoint)
    assert name == "we_said_hi_there_now"
    as_json = as_triton_json(parsed((tmp_path / "repo" / name / "config.pbtxt").read_text()))
    assert model_parameter(as_json, "checkpoint") == str(checkpoint.resolve())


@pytest.mark.parametrize(
    ("folder", "expected"),
    [("Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct"), ("Qwen2.5 0.5B (chat)", "Qwen2.5_0.5B_chat_"),
     (".hidden", "hidden"), ("--", "chat"), ("naïve", "na_ve")],
)
def test_default_name_is_the_folder_name_made_valid(tmp_path: Path, folder: str, expected: str) -> None:
    assert chat_model_name(tmp_path / folder) == expected


def test_the_temporary_repository_is_removed_at_exit(tmp_path: Path) -> None:
    """chat_model_repository: one model named as asked, in a folder that is gone after the block."""
    checkpoint = gpt2_checkpoint(tmp_path / "ckpt")
    with chat_model_repository(checkpoint, name="tiny", prefix="tnc-test-") as (repository, name):
        assert name == "tiny"
        assert repository.name.startswith("tnc-test-")
        assert [p.name for p in repository.iterdir()] == ["tiny"]
    assert not repository.exists()


# -- mistakes: one line, exit 2, no server ---------------------------------------------------------------------


class NoServer:
    """Stands in for LocalTriton: a test fails if a command gets as far as making a server."""

    made: ClassVar[list[object]] = []

    def __init__(self, *args: object, **kwargs: object) -> None:
        NoServer.made.append((args, kwargs))
        raise AssertionError(f"a server was started: {args} {kwargs}")


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _into_a_file(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.write_text("x")


def _shard_missing(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    _write(folder / "model.safetensors.index.json", json.dumps({"weight_map": {"w": "model-1-of-2.safetensors"}}))


def _unchanged(folder: Path) -> None:
    pass


# Each case: how to spoil a good gpt2 checkpoint copy, the arguments it adds, a phrase the one line must hold.
Spoil = Callable[[Path], None]
MISTAKES: list[tuple[str, Spoil, list[str], str]] = [
    ("missing", shutil.rmtree, [], "no such folder"),
    ("a file", _into_a_file, [], "expected a folder, given a file"),
    ("no config", lambda d: (d / "config.json").unlink(), [], "no config.json"),
    ("bad json", lambda d: _write(d / "config.json", "{"), [], "config.json: expected a JSON object"),
    (
        "bert",
        lambda d: _write(d / "config.json", json.dumps({"model_type": "bert", "max_position_embeddings": 512})),
        [],
        "model_type 'bert' is not supported (supported: gpt2, llama, qwen2, mistral)",
    ),
    ("no model_type", lambda d: _write(d / "config.json", "{}"), [], "model_type none is not supported"),
    ("no tokenizer", lambda d: (d / "tokenizer.json").unlink(), [], "no tokenizer.json"),
    ("no tokenizer config", lambda d: (d / "tokenizer_config.json").unlink(), [], "no tokenizer_config.json"),
    (
        "no template",
        lambda d: _write(d / "tokenizer_config.json", json.dumps({"eos_token": "<|end|>"})),
        [],
        "tokenizer_config.json: no chat_template",
    ),
    ("no weights", lambda d: (d / "model.safetensors").unlink(), [], "no weights: expected model.safetensors"),
    ("missing shard", _shard_missing, [], "names shard files the folder lacks: model-1-of-2.safetensors"),
    ("max-ctx 0", _unchanged, ["--max-ctx", "0"], "max_ctx (--max-ctx): expected a positive integer, given 0"),
    ("max-ctx < 0", _unchanged, ["--max-ctx", "-8"], "expected a positive integer, given -8"),
    ("dtype", _unchanged, ["--dtype", "int4"], "dtype (--dtype): expected one of auto, float32"),
    ("device", _unchanged, ["--device", "tpu"], "device (--device): expected one of auto, npu, cuda, cpu"),
    ("cache", _unchanged, ["--max-cache-mb", "0"], "max_cache_mb (--max-cache-mb): expected a positive number"),
    ("name", _unchanged, ["--name", "a/b"], "model name (--name) 'a/b': expected letters"),
    (
        "cpu-threads 0", _unchanged, ["--cpu-threads", "0"],
        "cpu_threads (--cpu-threads): expected 'auto' or an integer from 1 to 4096, given 0",
    ),
    ("cpu-threads < 0", _unchanged, ["--cpu-threads", "-3"], "expected 'auto' or an integer from 1 to 4096, given -3"),
    ("cpu-threads huge", _unchanged, ["--cpu-threads", "100000"], "from 1 to 4096, given 100000"),
    (
        "cpu-threads word", _unchanged, ["--cpu-threads", "two"],
        "cpu_threads (--cpu-threads): expected 'auto' or a positive integer, given 'two'",
    ),
    ("cpu-threads float", _unchanged, ["--cpu-threads", "1.5"], "expected 'auto' or a positive integer, given '1.5'"),
]


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    NoServer.made = []
    monkeypatch.setattr(cli._serve, "LocalTriton", NoServer)
    monkeypatch.setattr(cli_chat, "LocalTriton", NoServer)
    return NoServer.made


def leftover_folders() -> list[str]:
    prefixes = (f"triton-npu-chat-{os.getpid()}-", f"triton-npu-serve-{os.getpid()}-")
    return [p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefixes)]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``triton-npu argv`` here; check exit 2, nothing on stdout, one line on stderr; return that line."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), err
    assert err.endswith("\n"), err
    assert err.count("\n") == 1, err
    assert err.startswith(f"triton-npu {argv[0]}: "), err
    return err


@pytest.mark.parametrize("command", ["chat", "serve"])
@pytest.mark.parametrize(("case", "spoil", "extra", "needle"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2_before_any_server(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_server: list[object],
    command: str,
    case: str,
    spoil: Spoil,
    extra: list[str],
    needle: str,
) -> None:
    checkpoint = gpt2_checkpoint(tmp_path / "ckpt")
    spoil(checkpoint)
    before = snapshot(checkpoint) if checkpoint.is_dir() else None
    flag = "--checkpoint" if command == "chat" else "--chat"
    err = refused(capsys, [command, flag, str(checkpoint), *extra])
    assert needle in err
    assert no_server == []
    assert leftover_folders() == []
    if before is not None:
        assert snapshot(checkpoint) == before


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["chat", "--max-ctx", "100"], "--max-ctx shapes the model generated from a checkpoint: it needs --checkpoint"),
        (["serve", "--name", "x"], "--name shapes the model generated from a checkpoint: it needs --checkpoint DIR"),
        (["serve", "--dtype", "float16"], "--dtype shapes the model"),
        (["serve", "--cpu-threads", "2"], "--cpu-threads shapes the model generated from a checkpoint: it needs"),
        (["chat", "--cpu-threads", "auto"], "--cpu-threads shapes the model generated from a checkpoint: it needs"),
        (["chat", "--checkpoint", "CKPT", "--url", "grpc://127.0.0.1:1"], "it cannot go with --url"),
        (["chat", "--checkpoint", "CKPT", "--model", "chat"], "name the new one with --name"),
        (["serve", "--chat", "CKPT", "--model-repository", "REPO"], "REPO has a model 'ckpt' already"),
    ],
)
def test_options_that_do_not_go_together_are_refused_before_any_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_server: list[object], argv: list[str], needle: str
) -> None:
    checkpoint = gpt2_checkpoint(tmp_path / "ckpt")
    repository = tmp_path / "repo"
    (repository / "ckpt").mkdir(parents=True)
    swap = {"CKPT": str(checkpoint), "REPO": str(repository)}
    err = refused(capsys, [swap.get(a, a) for a in argv])
    assert needle.replace("REPO", str(repository)) in err
    assert no_server == []
    assert leftover_folders() == []


class Reached(UsageError):
    """Raised by :class:`ServerAt` where the server would start: the command ends there with one line, exit 2."""


class ServerAt:
    """Stands in for LocalTriton: records the config of every model in the repository it is given, then stops."""

    configs: ClassVar[dict[str, str]] = {}

    def __init__(self, repository: str | Path, *args: object, **kwargs: object) -> None:
        ServerAt.configs = {p.parent.name: p.read_text() for p in Path(repository).glob("*/config.pbtxt")}
        raise Reached("a server would start here")


@pytest.mark.parametrize(("command", "flag"), [("chat", "--checkpoint"), ("serve", "--chat")])
@pytest.mark.parametrize(("given", "expected"), [(["--cpu-threads", "3"], "3"), ([], "auto"),
                                                 (["--cpu-threads", " AUTO"], "auto")])  # fmt: skip
def test_cpu_threads_reach_the_generated_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str, flag: str,
    given: list[str], expected: str,
) -> None:
    """``--cpu-threads`` (default auto) is the served entry's cpu_threads, in the repository handed to the server."""
    monkeypatch.setattr(cli._serve, "LocalTriton", ServerAt)
    monkeypatch.setattr(cli_chat, "LocalTriton", ServerAt)
    ServerAt.configs = {}
    checkpoint = gpt2_checkpoint(tmp_path / "ckpt")
    assert cli.main([command, flag, str(checkpoint), *given]) == 2
    out, err = capsys.readouterr()
    assert (out, err.splitlines()[-1]) == ("", f"triton-npu {command}: a server would start here")
    (config,) = ServerAt.configs.values()
    assert model_parameter(as_triton_json(parsed(config)), "cpu_threads") == expected
    assert leftover_folders() == []


def test_from_the_shell_a_mistake_is_one_line(tmp_path: Path) -> None:
    """The installed command as a user runs it: one line on stderr, exit 2, and quickly (no server)."""
    done = subprocess.run(
        [sys.executable, "-m", "triton_npu_client", "serve", "--chat", str(tmp_path / "nowhere")],
        capture_output=True, text=True, timeout=WAIT_S,
    )
    assert done.returncode == 2
    assert done.stderr == f"triton-npu serve: checkpoint {tmp_path / 'nowhere'}: no such folder\n"


# -- end to end -------------------------------------------------------------------------------------------------


class Lines:
    """A running command's stdout and stderr, read as they come (never by sleeping)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        assert proc.stderr is not None
        self._out = b""
        self._err = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(proc.stdout, selectors.EVENT_READ, "out")
        self._selector.register(proc.stderr, selectors.EVENT_READ, "err")

    @property
    def out(self) -> str:
        return self._out.decode(errors="replace")

    @property
    def err(self) -> str:
        return self._err.decode(errors="replace")

    def _read(self, timeout: float) -> None:
        for key, _ in self._selector.select(timeout):
            data = os.read(key.fd, 65536)
            if not data:
                self._selector.unregister(key.fileobj)
            elif key.data == "out":
                self._out += data
            else:
                self._err += data

    def until(self, pattern: str) -> re.Match[str]:
        """Read until stdout holds a line matching ``pattern``; fail (showing both streams) if it ends first."""
        deadline = time.monotonic() + WAIT_S
        while (match := re.search(pattern, self.out, re.M)) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in time: out={self.out!r} err={self.err[-3000:]!r}"
            assert self._selector.get_map(), f"output closed before {pattern!r}: {self.out!r} {self.err[-3000:]!r}"
            self._read(left)
        return match

    def finish(self) -> None:
        """Read both streams to their end."""
        deadline = time.monotonic() + WAIT_S
        while self._selector.get_map():
            left = deadline - time.monotonic()
            assert left > 0, f"output not closed in time: out={self.out!r} err={self.err[-3000:]!r}"
            self._read(left)


def tiny_llama(folder: Path) -> Path:
    """A random one-layer Llama (grouped-query attention, untied head) in two shards with their index, written
    with numpy (no torch here: writing takes milliseconds); the demo's tokenizer, template and end-of-turn ids."""
    folder.mkdir(parents=True)
    vocab, hidden, heads, kv_heads, inter = 4096, 32, 4, 2, 64
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 0,
    }
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(DEMO / name, folder / name)
    rng = np.random.default_rng(0)

    def w(*shape: int) -> npt.NDArray[np.float32]:
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    head_dim, layer = hidden // heads, "model.layers.0."
    shards = [
        {
            "model.embed_tokens.weight": w(vocab, hidden),
            f"{layer}input_layernorm.weight": 1 + w(hidden),
            f"{layer}self_attn.q_proj.weight": w(heads * head_dim, hidden),
            f"{layer}self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            f"{layer}self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            f"{layer}self_attn.o_proj.weight": w(hidden, heads * head_dim),
        },
        {
            f"{layer}post_attention_layernorm.weight": 1 + w(hidden),
            f"{layer}mlp.gate_proj.weight": w(inter, hidden),
            f"{layer}mlp.up_proj.weight": w(inter, hidden),
            f"{layer}mlp.down_proj.weight": w(hidden, inter),
            "model.norm.weight": 1 + w(hidden),
            "lm_head.weight": w(vocab, hidden),
        },
    ]
    weight_map = {}
    for i, tensors in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


async def one_turn(url: str, model: str, question: str) -> tuple[str, int, dict[str, Any]]:
    async with Client(url, timeout_s=120) as client:
        async with client.chat(model, max_tokens=8) as chat:
            reply = await chat.ask(question)
        config = await client.model_config(model)
    return reply.text, reply.tokens, config


def test_serve_chat_and_chat_checkpoint_answer_a_real_client(tmp_path: Path) -> None:
    """One `serve --chat DIR --model-repository R` and one `chat --checkpoint`, started at once.

    The server holds R's model (a tiny Llama entry that write_chat_model wrote there) beside the GPT-2 checkpoint's
    model, named after DIR; each answers a turn, and each served config holds its checkpoint's path. `chat
    --checkpoint LLAMA --name tiny` prints the reply the served Llama gives (greedy: the same entry, the same reply).
    Both commands exit 0, remove their folders, and never write into a checkpoint. (That the generated GPT-2 entry
    serves exactly what the packaged model does follows from the configs' equality, tested above: the packaged model
    is left out of this server, two model loads and their auto-complete stubs fewer.)"""
    gpt2 = gpt2_checkpoint(tmp_path / "demo gpt2 (copy)")
    llama = tiny_llama(tmp_path / "tiny-llama")
    before = {folder: snapshot(folder) for folder in (gpt2, llama)}
    repository = tmp_path / "repo"
    repository.mkdir()
    assert write_chat_model(repository, llama, name="tiny_llama", max_ctx=128) == "tiny_llama"
    question = "Good morning."
    serve = [sys.executable, "-m", "triton_npu_client", "serve", "--chat", str(gpt2),
             "--model-repository", str(repository), "--max-ctx", "1024", "--cpu-threads", "1"]
    chat = [sys.executable, "-m", "triton_npu_client", "chat", "--checkpoint", str(llama),
            "--name", "tiny", "--max-ctx", "128", "--max-tokens", "8"]
    # Both commands start their servers at once: the test waits for the slower, not for the sum.
    with subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path) as server, \
            subprocess.Popen(chat, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=tmp_path) as chatting:
        try:
            assert chatting.stdin is not None
            chatting.stdin.write(f"{question}\n".encode())
            chatting.stdin.close()
            lines = Lines(server)
            url = lines.until(r"^  gRPC +(\S+)$").group(1)
            assert "  chat     model 'demo_gpt2_copy_' from checkpoint" in lines.out
            text, tokens, config = asyncio.run(one_turn(url, "demo_gpt2_copy_", question))
            llama_text, llama_tokens, llama_config = asyncio.run(one_turn(url, "tiny_llama", question))
            server.send_signal(signal.SIGINT)
            lines.finish()
            server.wait(timeout=WAIT_S)
            chat_lines = Lines(chatting)
            chat_lines.finish()
            chatting.wait(timeout=WAIT_S)
        finally:
            for proc in (server, chatting):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert server.returncode == 130, lines.err[-3000:]  # stopped by Ctrl-C (SIGINT)
    assert tokens > 0
    assert text
    assert model_parameter(config, "checkpoint") == str(gpt2.resolve())
    assert model_parameter(config, "max_ctx") == "1024"
    assert model_parameter(config, "cpu_threads") == "1"  # --cpu-threads, as the server holds it
    assert llama_tokens > 0
    assert model_parameter(llama_config, "checkpoint") == str(llama.resolve())
    assert model_parameter(llama_config, "cpu_threads") == "auto"  # write_chat_model's default
    assert chatting.returncode == 0, chat_lines.err[-3000:]
    assert "starting tritonserver for model 'tiny'" in chat_lines.err
    assert chat_lines.out == llama_text + "\n"
    for pid, verb in ((server.pid, "serve"), (chatting.pid, "chat")):
        prefix = f"triton-npu-{verb}-{pid}-"
        assert [p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(prefix)] == []
    assert {folder: snapshot(folder) for folder in (gpt2, llama)} == before
