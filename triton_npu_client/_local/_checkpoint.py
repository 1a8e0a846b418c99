"""A model repository entry for the chat model, generated from a Hugging Face checkpoint folder.

:func:`write_chat_model` checks the folder (``config.json`` with a supported ``model_type``, ``tokenizer.json``,
``tokenizer_config.json`` with a ``chat_template``, the safetensors weights) and writes ``<name>/config.pbtxt`` and
``<name>/1/model.py`` into a repository. The config is the packaged ``server_models/chat/config.pbtxt`` (same
inputs, outputs, sequence batching and parameters, so it serves exactly what the packaged model promises) with
``checkpoint`` (the folder's absolute path), ``max_ctx``, ``dtype``, ``device``, ``max_cache_mb`` and ``cpu_threads``
set; the model file is the packaged one. The checkpoint folder is only read, and only its JSON files: no torch here,
so the CLI refuses a wrong folder in milliseconds, before any server starts.

:func:`chat_model_repository` does the same in a temporary repository it removes at exit (what
``triton-npu chat --checkpoint`` and ``triton-npu serve --checkpoint`` (or its old name, ``--chat``) serve).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .._errors import UsageError
from .._protocol import chat as proto
from ._server import default_model_repository

__all__ = [
    "CHAT_CPU_THREADS_AUTO",
    "CHAT_DEVICES",
    "CHAT_DTYPES",
    "CHAT_MODEL_TYPES",
    "ChatCheckpoint",
    "chat_model_config",
    "chat_model_name",
    "chat_model_repository",
    "read_chat_checkpoint",
    "write_chat_model",
]

# The protocol's list of the checkpoint families the chat model serves, named here for the CLI.
CHAT_MODEL_TYPES: Final = proto.MODEL_TYPES
# "auto": float32 on a CPU instance, the checkpoint's torch_dtype on an accelerator (the engine decides).
CHAT_DTYPES: Final = ("auto", "float32", "float16", "bfloat16")
CHAT_DEVICES: Final = ("auto", "npu", "cuda", "cpu")
# cpu_threads "auto": the stub counts the cores it may run on when it loads (see docs/chat.md, "Threads").
CHAT_CPU_THREADS_AUTO: Final = "auto"
# More torch threads than this is a typo, not a machine: refused before anything is written.
_MAX_CPU_THREADS: Final = 4096

# The packaged model whose config and model file a generated entry copies.
_PACKAGED: Final = "chat"
# The config keys read for the context length, in order (Llama family, then GPT-2).
_POSITION_KEYS: Final = ("max_position_embeddings", "n_positions")
# A name Triton, its HTTP paths and a folder all take as is.
_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_PARAMETER: Final = re.compile(r'^parameters \{ key: "(?P<key>[^"]+)" value: \{ string_value: "(?:[^"\\]|\\.)*" \} \}$')
_MODEL_NAME_LINE: Final = re.compile(r'^name: "[^"]*"$', re.M)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatCheckpoint:
    """What a chat checkpoint folder says about itself (read from its JSON files).

    ``folder`` is absolute; ``max_positions`` is config.json's ``max_position_embeddings`` (or GPT-2's
    ``n_positions``), None when it gives neither; ``torch_dtype`` is config.json's (``dtype`` as transformers 5
    writes it), None when absent.
    """

    folder: Path
    model_type: str
    max_positions: int | None
    torch_dtype: str | None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UsageError(f"checkpoint file {path}: expected a JSON object, cannot read it ({err})") from None
    if not isinstance(value, dict):
        raise UsageError(f"checkpoint file {path}: expected a JSON object, given a JSON {type(value).__name__}")
    return value


def _has_template(tokenizer_config: dict[str, Any]) -> bool:
    # A single template, or Hugging Face's list of named ones ({"name": ..., "template": ...}).
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return bool(template.strip())
    if isinstance(template, list):
        return any(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template)
    return False


def _check_weights(folder: Path) -> None:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return
    if not index.is_file():
        raise UsageError(
            f"checkpoint {folder}: no weights: expected model.safetensors or model.safetensors.index.json"
        )
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"checkpoint file {index}: expected a non-empty weight_map of tensor -> shard file")
    missing = sorted({str(s) for s in weight_map.values() if not (folder / str(s)).is_file()})
    if missing:
        raise UsageError(f"checkpoint file {index}: names shard files the folder lacks: {', '.join(missing)}")


def read_chat_checkpoint(folder: str | os.PathLike[str]) -> ChatCheckpoint:
    """Check that ``folder`` is a checkpoint the chat model serves; :class:`UsageError` (one line) says what is not.

    Needs ``config.json`` (``model_type`` one of :data:`CHAT_MODEL_TYPES`), ``tokenizer.json``,
    ``tokenizer_config.json`` with a ``chat_template``, and ``model.safetensors`` or
    ``model.safetensors.index.json`` (whose shards must all be there). Reads JSON only; writes nothing.
    """
    path = Path(folder).expanduser()
    if not path.exists():
        raise UsageError(f"checkpoint {path}: no such folder")
    if not path.is_dir():
        raise UsageError(f"checkpoint {path}: expected a folder, given a file")
    path = path.resolve()
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"checkpoint {path}: no config.json")
    config = _read_json(config_file)
    model_type = config.get("model_type")
    supported = ", ".join(CHAT_MODEL_TYPES)
    if not isinstance(model_type, str) or model_type not in CHAT_MODEL_TYPES:
        given = "none" if model_type is None else repr(model_type)
        raise UsageError(f"checkpoint file {config_file}: model_type {given} is not supported (supported: {supported})")
    if not (path / "tokenizer.json").is_file():
        raise UsageError(f"checkpoint {path}: no tokenizer.json (a Hugging Face fast tokenizer)")
    tokenizer_config = path / "tokenizer_config.json"
    if not tokenizer_config.is_file():
        raise UsageError(f"checkpoint {path}: no tokenizer_config.json (the chat model needs its chat_template)")
    if not _has_template(_read_json(tokenizer_config)):
        raise UsageError(f"checkpoint file {tokenizer_config}: no chat_template (the chat model needs one)")
    _check_weights(path)
    max_positions: int | None = None
    for key in _POSITION_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"checkpoint file {config_file}: {key}: expected a positive integer, given {value!r}")
        max_positions = value
        break
    # transformers 5 writes "dtype", earlier versions (and most checkpoints on the Hub) "torch_dtype".
    torch_dtype = config.get("torch_dtype", config.get("dtype"))
    return ChatCheckpoint(
        folder=path,
        model_type=model_type,
        max_positions=max_positions,
        torch_dtype=torch_dtype if isinstance(torch_dtype, str) else None,
    )


def chat_model_name(folder: str | os.PathLike[str]) -> str:
    """The default model name for a checkpoint: the folder's name with every run of other characters than
    letters, digits, ``_``, ``.`` and ``-`` made one ``_`` (``chat`` when nothing is left)."""
    raw = Path(folder).expanduser().resolve().name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", raw).lstrip(".-")
    return name or _PACKAGED


def _check_options(
    name: str, max_ctx: int | None, dtype: str, device: str, max_cache_mb: float | None, cpu_threads: int | str
) -> None:
    if not _NAME.fullmatch(name):
        raise UsageError(
            f"model name (--name) {name!r}: expected letters, digits, '_', '.' and '-' (not first: '.' or '-')"
        )
    if max_ctx is not None and (isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or max_ctx < 1):
        raise UsageError(f"max_ctx (--max-ctx): expected a positive integer, given {max_ctx!r}")
    if dtype not in CHAT_DTYPES:
        raise UsageError(f"dtype (--dtype): expected one of {', '.join(CHAT_DTYPES)}, given {dtype!r}")
    if device not in CHAT_DEVICES:
        raise UsageError(f"device (--device): expected one of {', '.join(CHAT_DEVICES)}, given {device!r}")
    if max_cache_mb is not None and not (math.isfinite(max_cache_mb) and max_cache_mb > 0):
        raise UsageError(f"max_cache_mb (--max-cache-mb): expected a positive number, given {max_cache_mb!r}")
    if cpu_threads != CHAT_CPU_THREADS_AUTO and (
        isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or not 1 <= cpu_threads <= _MAX_CPU_THREADS
    ):
        raise UsageError(
            f"cpu_threads (--cpu-threads): expected {CHAT_CPU_THREADS_AUTO!r} or an integer from 1 to "
            f"{_MAX_CPU_THREADS}, given {cpu_threads!r}"
        )


def _pbtxt_string(value: str) -> str:
    """``value`` as a protobuf text-format string literal (a path may hold quotes, backslashes, controls)."""
    out = []
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\{ord(ch):03o}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _parameter_line(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: {_pbtxt_string(value)} }} }}'


def chat_model_config(
    checkpoint: ChatCheckpoint,
    *,
    name: str,
    max_ctx: int | None = None,
    dtype: str = "auto",
    device: str = "auto",
    max_cache_mb: float | None = None,
    cpu_threads: int | str = CHAT_CPU_THREADS_AUTO,
    template: str | None = None,
) -> str:
    """The ``config.pbtxt`` text serving ``checkpoint`` as model ``name``.

    ``template`` is the packaged chat model's config text (default: read from :func:`default_model_repository`).
    ``max_ctx`` is the smaller of the checkpoint's positions and the one given; ``max_cache_mb`` None keeps the
    packaged value. ``cpu_threads`` is the torch threads of a CPU instance: a positive integer, or ``"auto"`` (the
    default): one fewer than the cores the instance's process may run on (the last one is for Triton's threads and
    a local client), counted when it loads, divided among the model's CPU instances (see docs/chat.md, "Threads").
    """
    _check_options(name, max_ctx, dtype, device, max_cache_mb, cpu_threads)
    if checkpoint.max_positions is None and max_ctx is None:
        raise UsageError(
            f"checkpoint {checkpoint.folder}: config.json gives neither {' nor '.join(_POSITION_KEYS)}: "
            "pass max_ctx (--max-ctx)"
        )
    context = min(n for n in (checkpoint.max_positions, max_ctx) if n is not None)
    if template is None:
        template = (default_model_repository() / _PACKAGED / "config.pbtxt").read_text(encoding="utf-8")
    wanted = {
        "checkpoint": str(checkpoint.folder),
        "max_ctx": str(context),
        "dtype": dtype,
        "device": device,
        "cpu_threads": str(cpu_threads),
    }
    if max_cache_mb is not None:
        wanted["max_cache_mb"] = f"{max_cache_mb:g}"
    lines = template.splitlines()
    # The packaged header describes the packaged model (its demo weights); the generated entry says what it is.
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    body = "\n".join(lines)
    if len(_MODEL_NAME_LINE.findall(body)) != 1:
        raise RuntimeError(f"the packaged {_PACKAGED} config.pbtxt has no single top-level name line to replace")
    lines = _MODEL_NAME_LINE.sub(f'name: "{name}"', body).splitlines()
    last_parameter = -1
    for i, line in enumerate(lines):
        match = _PARAMETER.match(line)
        if match is None:
            continue
        last_parameter = i
        key = match.group("key")
        if key in wanted:
            lines[i] = _parameter_line(key, wanted.pop(key))
    if last_parameter < 0:
        raise RuntimeError(f"the packaged {_PACKAGED} config.pbtxt has no parameters lines to fill in")
    lines[last_parameter + 1 : last_parameter + 1] = [_parameter_line(k, v) for k, v in wanted.items()]
    header = [
        f"# Generated by triton-npu from a {checkpoint.model_type} checkpoint (parameter checkpoint): the packaged",
        f"# {_PACKAGED} model's config (server_models/{_PACKAGED}/config.pbtxt describes every input, output and",
        "# parameter) with checkpoint, max_ctx, dtype, device, max_cache_mb and cpu_threads set for it. See",
        "# docs/chat.md.",
    ]
    return "\n".join([*header, *lines]) + "\n"


def write_chat_model(
    repository: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    *,
    name: str | None = None,
    max_ctx: int | None = None,
    dtype: str = "auto",
    device: str = "auto",
    max_cache_mb: float | None = None,
    cpu_threads: int | str = CHAT_CPU_THREADS_AUTO,
) -> str:
    """Write a chat model serving the checkpoint folder ``checkpoint`` into ``repository``; return its name.

    ``name`` defaults to :func:`chat_model_name`. Writes ``<repository>/<name>/config.pbtxt`` (see
    :func:`chat_model_config`) and ``<repository>/<name>/1/model.py`` (the packaged chat model's); ``repository``
    is created if missing, ``<name>`` must not exist. Everything is checked before anything is written:
    :class:`UsageError` (one line) names what is wrong. The checkpoint folder is never written.
    """
    found = read_chat_checkpoint(checkpoint)
    chosen = chat_model_name(found.folder) if name is None else name
    text = chat_model_config(
        found, name=chosen, max_ctx=max_ctx, dtype=dtype, device=device, max_cache_mb=max_cache_mb,
        cpu_threads=cpu_threads,
    )
    root = Path(repository)
    entry = root / chosen
    if entry.exists():
        raise UsageError(f"model repository {root}: {chosen!r} exists already: pass another name")
    root.mkdir(parents=True, exist_ok=True)
    (entry / "1").mkdir(parents=True)
    (entry / "config.pbtxt").write_text(text, encoding="utf-8")
    shutil.copyfile(default_model_repository() / _PACKAGED / "1" / "model.py", entry / "1" / "model.py")
    return chosen


@contextlib.contextmanager
def chat_model_repository(
    checkpoint: str | os.PathLike[str],
    *,
    name: str | None = None,
    max_ctx: int | None = None,
    dtype: str = "auto",
    device: str = "auto",
    max_cache_mb: float | None = None,
    cpu_threads: int | str = CHAT_CPU_THREADS_AUTO,
    prefix: str | None = None,
) -> Iterator[tuple[Path, str]]:
    """A temporary model repository holding one chat model on ``checkpoint``: yields (repository, model name).

    The checks of :func:`write_chat_model` come first (nothing is created when one fails); the folder (named
    ``prefix`` + random, default ``triton-npu-chat-<pid>-``) is removed at exit.
    """
    found = read_chat_checkpoint(checkpoint)
    chosen = chat_model_name(found.folder) if name is None else name
    # Checked before the folder exists: a refusal leaves nothing behind.
    options: dict[str, Any] = {
        "max_ctx": max_ctx, "dtype": dtype, "device": device, "max_cache_mb": max_cache_mb, "cpu_threads": cpu_threads,
    }
    chat_model_config(found, name=chosen, **options)
    with tempfile.TemporaryDirectory(prefix=prefix or f"triton-npu-chat-{os.getpid()}-") as folder:
        written = write_chat_model(folder, found.folder, name=chosen, **options)
        yield Path(folder), written
