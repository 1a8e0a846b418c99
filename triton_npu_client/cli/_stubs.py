"""Generate typed input/output classes from a model repository's ``config.pbtxt`` files, or from a running server.

``triton-npu stubs MODEL_REPOSITORY -o module.py`` writes one module holding, per model, a frozen attrs
``<Model>Inputs`` class (keyword-only, one numpy-typed field per input) and a ``<Model>Outputs`` class, so
that mypy catches a wrong input name or dtype in user code before anything runs. ``triton-npu stubs --url URL``
reads the configs of the server's READY models instead (or of the ``--model`` ones); without either, the server
named by ``$TRITON_URLS``, else ``$TRITON_URL``, as every verb that makes a client does.

The generated module depends on attrs and numpy only, never on this package: ``Inputs.as_dict()`` gives a
``dict[str, ndarray]`` to splat into any client's infer call, and ``Outputs.from_result(result)`` reads any
result that has ``as_numpy(name)`` (tritonclient), an ``outputs`` mapping, or ``__getitem__(name)``.

Both sources go through the :class:`~triton_npu_client._model.ModelSpec` the client validates requests with: a
``config.pbtxt`` is parsed with tritonclient's ``ModelConfig`` protobuf, a server's config is the one
``client.model(name)`` fetches. So the same models give the same module text from either (only the docstring line
saying how to regenerate it names the source), and a stub never promises what the client would refuse. The output
is deterministic (models and tensors sorted by name) and ruff / mypy --strict clean.

``-o FILE`` never replaces a file this tool did not write: a file that is not a generated stubs module (its
docstring says so) is refused unless ``--overwrite``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import keyword
import os
import re
import secrets
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from .._errors import ModelNotFoundError, TransportError, TritonError, UsageError
from ._urls import URL_HELP, add_url_argument, checked_urls

if TYPE_CHECKING:
    from .._model import ModelSpec, TensorSpec

__all__ = [
    "ModelStub",
    "TensorStub",
    "add_arguments",
    "check_output",
    "generate_stubs",
    "read_repository",
    "read_server",
    "render_module",
    "run",
    "write_module",
]

# Triton dtype (as ModelSpec spells it) -> numpy scalar type used in annotations and casts.
# BF16 has no numpy dtype: callers hold it as float32 and the client encodes it.
_NUMPY: dict[str, str] = {
    "BOOL": "np.bool_",
    "UINT8": "np.uint8",
    "UINT16": "np.uint16",
    "UINT32": "np.uint32",
    "UINT64": "np.uint64",
    "INT8": "np.int8",
    "INT16": "np.int16",
    "INT32": "np.int32",
    "INT64": "np.int64",
    "FP16": "np.float16",
    "FP32": "np.float32",
    "FP64": "np.float64",
    "BF16": "np.float32",
    "BYTES": "np.object_",
}
# What a caller may pass for a BYTES input: text, raw bytes, lists of either, or an object array.
_BYTES_INPUT = "_BytesLike"
# Names the generated classes use themselves; a tensor with one of these names gets a suffix.
_RESERVED = frozenset(
    {"MODEL_NAME", "MAX_BATCH_SIZE", "SEQUENCE", "SEQUENCE_STRATEGY", "STRING_CORRELATION_ID", "DECOUPLED"}
    | {"as_dict", "from_result", "TENSOR_NAMES"}
)
# Seconds each call to a server (its index, each model's config) may take.
_SERVER_TIMEOUT_S = 30.0


@attrs.frozen(kw_only=True)
class TensorStub:
    """One input or output as the generator sees it."""

    name: str
    field: str
    triton_dtype: str
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def scalar(self) -> str:
        return _NUMPY[self.triton_dtype]


@attrs.frozen(kw_only=True)
class ModelStub:
    """One model's facts, read from its ``config.pbtxt`` or from a server, through its :class:`ModelSpec`."""

    name: str
    class_prefix: str
    max_batch_size: int
    inputs: tuple[TensorStub, ...]
    outputs: tuple[TensorStub, ...]
    sequence_strategy: str | None
    string_correlation_id: bool
    decoupled: bool

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, name: str, class_prefix: str, where: str) -> ModelStub:
        """The stub of ``spec`` for model ``name`` (Triton names a model after its folder, not its config's name)."""
        seq = spec.sequence
        return cls(
            name=name,
            class_prefix=class_prefix,
            max_batch_size=spec.max_batch_size,
            inputs=_tensors(where, spec.inputs),
            outputs=_tensors(where, spec.outputs),
            sequence_strategy=None if seq is None else seq.strategy,
            string_correlation_id=seq is not None and seq.string_ids,
            decoupled=spec.decoupled,
        )


def _identifier(raw: str, *, capitalise: bool) -> str:
    parts = [p for p in re.split(r"[^0-9A-Za-z]+", raw) if p]
    camel = "".join(p[:1].upper() + p[1:] for p in parts) or "Model"
    text = camel if capitalise else "_".join(parts) or "tensor"
    if text[0].isdigit():
        text = ("M" if capitalise else "t_") + text
    if keyword.iskeyword(text) or keyword.issoftkeyword(text):
        text += "_"
    return text


def _field_name(name: str) -> str:
    # attrs strips leading underscores from init arguments, and "input.1" is no identifier: sanitise.
    if name.isidentifier() and not name.startswith("_") and not keyword.iskeyword(name):
        return name
    return _identifier(name, capitalise=False)


def _unique(names: Iterable[str], taken: Iterable[str] = ()) -> list[str]:
    seen = set(taken)
    out: list[str] = []
    for name in names:
        candidate, n = name, 2
        while candidate in seen:
            candidate, n = f"{name}_{n}", n + 1
        seen.add(candidate)
        out.append(candidate)
    return out


def _tensors(where: str, items: Sequence[TensorSpec]) -> tuple[TensorStub, ...]:
    ordered = sorted(items, key=lambda t: t.name)
    fields = _unique((_field_name(t.name) for t in ordered), _RESERVED)
    stubs = []
    for tensor, field in zip(ordered, fields, strict=True):
        if tensor.dtype not in _NUMPY:
            raise UsageError(f"{where}: tensor {tensor.name!r} has unsupported data type {tensor.dtype}")
        stubs.append(
            TensorStub(
                name=tensor.name, field=field, triton_dtype=tensor.dtype, dims=tensor.dims, optional=tensor.optional
            )
        )
    return tuple(stubs)


def _spec(config: object, where: str) -> ModelSpec:
    from .._model import ModelSpec

    try:
        return ModelSpec.from_config(config)
    except ValueError as err:  # a data type the SDK does not know (TYPE_INVALID, or newer than it)
        raise UsageError(f"{where}: {err}") from None


def _read_config(path: Path, model_name: str, class_prefix: str) -> ModelStub:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    config = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(), config)
    except text_format.ParseError as err:
        raise UsageError(f"{path}: not a valid Triton model config: {err}") from err
    return ModelStub.from_spec(_spec(config, str(path)), name=model_name, class_prefix=class_prefix, where=str(path))


def read_repository(repository: Path, *, models: Sequence[str] = ()) -> list[ModelStub]:
    """Read every model folder of ``repository`` that has a ``config.pbtxt`` (or only ``models``)."""
    if not repository.is_dir():
        raise UsageError(f"{repository} is not a model repository folder")
    found = sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))
    if models:
        missing = sorted(set(models) - set(found))
        if missing:
            raise UsageError(f"{repository}: no config.pbtxt for model(s) {', '.join(missing)}")
        found = sorted(set(models))
    prefixes = _unique(_identifier(name, capitalise=True) for name in found)
    return [
        _read_config(repository / name / "config.pbtxt", name, prefix)
        for name, prefix in zip(found, prefixes, strict=True)
    ]


async def read_server(
    urls: str | Sequence[str], *, models: Sequence[str] = (), timeout_s: float = _SERVER_TIMEOUT_S
) -> list[ModelStub]:
    """Read every READY model of the server at ``urls`` (or only ``models``), each through ``client.model(name)``.

    Raises :class:`ModelNotFoundError` naming a model that is not READY there and the models that are, and the
    client's :class:`TransportError` when the server cannot be reached.
    """
    from .._client import Client

    async with Client(urls, timeout_s=timeout_s) as client:
        where = client.config.url
        index = await client.repository_index()
        ready = sorted({m.name for m in index if m.state == "READY"})
        missing = sorted(set(models) - set(ready))
        if missing:
            raise ModelNotFoundError(
                f"model(s) {', '.join(missing)} not READY at {where}; READY there: {', '.join(ready) or '(none)'}",
                model=missing[0],
            )
        names = sorted(set(models)) if models else ready
        if not names:
            raise UsageError(f"{where}: no READY model")
        prefixes = _unique(_identifier(name, capitalise=True) for name in names)
        stubs = []
        for name, prefix in zip(names, prefixes, strict=True):
            # The spec the client validates requests with (cached by the client), so a stub matches its checks.
            spec = (await client.model(name)).spec
            stubs.append(ModelStub.from_spec(spec, name=name, class_prefix=prefix, where=f"{where} model {name!r}"))
        return stubs


def _q(value: str | None) -> str:
    # A double-quoted literal, as ruff format writes it (JSON strings are valid Python literals).
    return "None" if value is None else json.dumps(value)


def _dims(t: TensorStub) -> str:
    return "[" + ", ".join(str(d) for d in t.dims) + "]"


def _input_type(t: TensorStub) -> str:
    base = _BYTES_INPUT if t.triton_dtype == "BYTES" else f"npt.NDArray[{t.scalar}]"
    return f"{base} | None" if t.optional else base


def _render_model(m: ModelStub) -> list[str]:
    facts = [
        f"    MODEL_NAME: ClassVar[str] = {_q(m.name)}",
        f"    MAX_BATCH_SIZE: ClassVar[int] = {m.max_batch_size}",
        f"    SEQUENCE: ClassVar[bool] = {m.sequence_strategy is not None}",
        f"    SEQUENCE_STRATEGY: ClassVar[str | None] = {_q(m.sequence_strategy)}",
        f"    STRING_CORRELATION_ID: ClassVar[bool] = {m.string_correlation_id}",
        f"    DECOUPLED: ClassVar[bool] = {m.decoupled}",
    ]
    batch = f"batch dimension first, max {m.max_batch_size}" if m.max_batch_size > 0 else "no batch dimension"
    lines = [
        "",
        "",
        "@attrs.frozen(kw_only=True)",
        f"class {m.class_prefix}Inputs:",
        f'    """Inputs of model ``{m.name}``; {batch}."""',
        "",
        *facts,
        "",
    ]
    for t in m.inputs:
        default = " = None" if t.optional else ""
        lines.append(f"    # {_q(t.name)}: {t.triton_dtype} {_dims(t)}{', optional' if t.optional else ''}")
        lines.append(f"    {t.field}: {_input_type(t)}{default}")
    lines += [
        "",
        "    def as_dict(self) -> dict[str, npt.NDArray[Any]]:",
        '        """The inputs by tensor name, ready for ``model.infer(**inputs.as_dict())``."""',
        "        out: dict[str, npt.NDArray[Any]] = {}",
    ]
    for t in m.inputs:
        value = f"self.{t.field}"
        encoded = f"np.asarray({value}, dtype=np.object_)" if t.triton_dtype == "BYTES" else value
        if t.optional:
            lines += [f"        if {value} is not None:", f"            out[{_q(t.name)}] = {encoded}"]
        else:
            lines.append(f"        out[{_q(t.name)}] = {encoded}")
    lines += ["        return out"]
    lines += [
        "",
        "",
        "@attrs.frozen(kw_only=True)",
        f"class {m.class_prefix}Outputs:",
        f'    """Outputs of model ``{m.name}``."""',
        "",
        f"    MODEL_NAME: ClassVar[str] = {_q(m.name)}",
        "",
    ]
    for t in m.outputs:
        lines.append(f"    # {_q(t.name)}: {t.triton_dtype} {_dims(t)}")
        lines.append(f"    {t.field}: npt.NDArray[{t.scalar}] = attrs.field(eq=_ARRAY_EQ)")
    lines += [
        "",
        "    @classmethod",
        "    def from_result(cls, result: Any) -> Self:",
        '        """Read the outputs from a result (``as_numpy(name)``, ``.outputs[name]`` or ``[name]``)."""',
        "        return cls(",
    ]
    for t in m.outputs:
        lines.append(f"            {t.field}=np.asarray(_output(result, {_q(t.name)}), dtype={t.scalar}),")
    lines.append("        )")
    return lines


_HEADER = '''\
"""Typed inputs and outputs for the models of a Triton model repository.

Generated by ``triton-npu stubs{args}``: do not edit, regenerate.
Depends on attrs and numpy only. BF16 tensors are held as float32; BYTES inputs take str / bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Self

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
{all_names}]

# numpy arrays compare elementwise; attrs needs one bool.
_ARRAY_EQ = attrs.cmp_using(eq=np.array_equal)
{bytes_alias} = str | bytes | Sequence[str | bytes] | npt.NDArray[np.object_] | npt.NDArray[np.bytes_]


def _output(result: Any, name: str) -> Any:
    # Duck-typed on purpose: tritonclient's InferResult, an ``outputs`` mapping, or a plain mapping.
    if hasattr(result, "as_numpy"):
        return result.as_numpy(name)
    if hasattr(result, "outputs"):
        return result.outputs[name]
    return result[name]
'''


def render_module(models: Sequence[ModelStub], *, command_args: str = "") -> str:
    """The generated module's source text (deterministic for the same configs)."""
    names = sorted(f"{m.class_prefix}{kind}" for m in models for kind in ("Inputs", "Outputs"))
    all_names = "".join(f'    "{n}",\n' for n in names)
    text = _HEADER.format(args=command_args, all_names=all_names, bytes_alias=_BYTES_INPUT)
    body = [line for m in models for line in _render_model(m)]
    return text + "\n".join(body) + "\n"


def generate_stubs(
    repository: Path,
    output: Path | None = None,
    *,
    models: Sequence[str] = (),
    command_args: str = "",
    overwrite: bool = False,
) -> str:
    """Generate the stubs module for ``repository``; write it to ``output`` when given; return the text."""
    if output is not None:
        check_output(output, overwrite=overwrite)
    stubs = read_repository(repository, models=models)
    if not stubs:
        raise UsageError(f"{repository}: no model folder with a config.pbtxt")
    text = render_module(stubs, command_args=command_args)
    if output is not None:
        write_module(output, text, overwrite=overwrite)
    return text


# How a module this tool wrote begins (its docstring): such a file may be replaced without --overwrite.
_GENERATED = ('"""Typed inputs and outputs for the models of a Triton model repository.\n\n'
              "Generated by ``triton-npu stubs")  # fmt: skip


def _written_by_us(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open("rb") as f:
            head = f.read(len(_GENERATED.encode()))
    except OSError:
        return False
    return head == _GENERATED.encode()


def check_output(path: Path, *, overwrite: bool = False) -> None:
    """Refuse ``path`` (a :class:`UsageError` in the command line's words) where writing it would replace something
    this tool did not write, unless ``overwrite``; or where its folder does not exist."""
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"-o {path}: folder {folder} does not exist")
    if path.is_dir() and not path.is_symlink():
        raise UsageError(f"-o {path}: is a directory; give a module file")
    if (path.exists() or path.is_symlink()) and not overwrite and not _written_by_us(path):
        raise UsageError(
            f"-o {path}: exists and is not a module triton-npu stubs wrote; pass --overwrite to replace it"
        )


def write_module(path: Path, text: str, *, overwrite: bool = False) -> None:
    """Write ``text`` to ``path``: a new file, or in place of one :func:`check_output` allows (whole, never a part:
    the text goes to a temporary file beside it first; a symlink is replaced, its target left alone)."""
    check_output(path, overwrite=overwrite)
    data = text.encode()
    try:
        with path.open("xb") as f:  # "x": a file that appeared since the check is not truncated
            f.write(data)
        return
    except FileExistsError:
        check_output(path, overwrite=overwrite)  # what appeared may be another program's file
    # Created as open() creates a file (0o666 less the umask), then given the replaced file's permissions.
    temp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if path.is_file() and not path.is_symlink():
            os.chmod(temp, path.stat().st_mode & 0o7777)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


# -- the command line -------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_repository", nargs="?", default=None, metavar="MODEL_REPOSITORY",
        help="model repository whose */config.pbtxt files to read (or --url: a running server's configs)",
    )  # fmt: skip
    add_url_argument(p, help="read the configs of a running server's READY models instead of a repository: " + URL_HELP)
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="module file to write (default: print to stdout); an existing file is replaced only when "
                   "triton-npu stubs wrote it")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace FILE even when triton-npu stubs did not write it")
    p.add_argument("--model", action="append", default=[], help="only this model (repeatable; default: every model)")
    p.epilog = (
        "one source: MODEL_REPOSITORY or --url, not both; with neither, the server at $TRITON_URLS, else $TRITON_URL "
        "(exit status 2 when none is set, a model is missing, or the server cannot be reached)"
    )


def _generate(ns: argparse.Namespace) -> str:
    if ns.model_repository is not None and ns.url is not None:
        raise UsageError("give MODEL_REPOSITORY or --url URL, not both")
    output = None if ns.output is None else Path(ns.output)
    # Recorded in the generated module's docstring so a reader knows how to regenerate it; the source is written
    # as given (a URL as the client takes it), and models in sorted order, so the text stays reproducible.
    shown_models = [f"--model {m}" for m in sorted(set(ns.model))]
    if ns.model_repository is not None:  # a repository given wins over $TRITON_URL: it is the explicit source
        args = " " + " ".join([ns.model_repository, *shown_models])
        return generate_stubs(
            Path(ns.model_repository), output, models=ns.model, command_args=args, overwrite=ns.overwrite
        )
    urls = checked_urls(ns.url)
    if urls is None:
        raise UsageError("give a MODEL_REPOSITORY folder, or --url URL of a running server (or set $TRITON_URL)")
    if output is not None:  # before any connection
        check_output(output, overwrite=ns.overwrite)
    stubs = asyncio.run(read_server(urls, models=ns.model))
    text = render_module(stubs, command_args=" " + " ".join(["--url " + ",".join(urls), *shown_models]))
    if output is not None:
        write_module(output, text, overwrite=ns.overwrite)
    return text


def run(ns: argparse.Namespace) -> int:
    """``triton-npu stubs``: see the module docstring."""
    try:
        text = _generate(ns)
    except TritonError as err:
        message = str(err)
        if isinstance(err, TransportError):  # gRPC's own words name the address its way ("ipv4:..."): say which
            message = f"cannot reach {', '.join(checked_urls(ns.url) or ())}: {message}"
        print(f"triton-npu stubs: {' '.join(message.split())}", file=sys.stderr)
        return 2
    if ns.output is None:
        sys.stdout.write(text)
    else:
        print(f"wrote {ns.output}", file=sys.stderr)
    return 0
