"""Generate typed input/output classes from a model repository's ``config.pbtxt`` files.

``triton-npu stubs MODEL_REPOSITORY -o module.py`` writes one module holding, per model, a frozen attrs
``<Model>Inputs`` class (keyword-only, one numpy-typed field per input) and a ``<Model>Outputs`` class, so
that mypy catches a wrong input name or dtype in user code before anything runs.

The generated module depends on attrs and numpy only, never on this package: ``Inputs.as_dict()`` gives a
``dict[str, ndarray]`` to splat into any client's infer call, and ``Outputs.from_result(result)`` reads any
result that has ``as_numpy(name)`` (tritonclient), an ``outputs`` mapping, or ``__getitem__(name)``.

Configs are parsed with tritonclient's ``ModelConfig`` protobuf and ``google.protobuf.text_format``; the
output is deterministic (models and tensors sorted by name) and ruff / mypy --strict clean.
"""

from __future__ import annotations

import json
import keyword
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from .._errors import UsageError

__all__ = ["ModelStub", "TensorStub", "generate_stubs", "read_repository", "render_module"]

# Triton dtype -> (numpy scalar type used in annotations and casts, Triton's short name).
# BF16 has no numpy dtype: callers hold it as float32 and the client encodes it.
_NUMPY: dict[int, tuple[str, str]] = {
    mc.TYPE_BOOL: ("np.bool_", "BOOL"),
    mc.TYPE_UINT8: ("np.uint8", "UINT8"),
    mc.TYPE_UINT16: ("np.uint16", "UINT16"),
    mc.TYPE_UINT32: ("np.uint32", "UINT32"),
    mc.TYPE_UINT64: ("np.uint64", "UINT64"),
    mc.TYPE_INT8: ("np.int8", "INT8"),
    mc.TYPE_INT16: ("np.int16", "INT16"),
    mc.TYPE_INT32: ("np.int32", "INT32"),
    mc.TYPE_INT64: ("np.int64", "INT64"),
    mc.TYPE_FP16: ("np.float16", "FP16"),
    mc.TYPE_FP32: ("np.float32", "FP32"),
    mc.TYPE_FP64: ("np.float64", "FP64"),
    mc.TYPE_BF16: ("np.float32", "BF16"),
    mc.TYPE_STRING: ("np.object_", "BYTES"),
}
# What a caller may pass for a BYTES input: text, raw bytes, lists of either, or an object array.
_BYTES_INPUT = "_BytesLike"
# Names the generated classes use themselves; a tensor with one of these names gets a suffix.
_RESERVED = frozenset(
    {"MODEL_NAME", "MAX_BATCH_SIZE", "SEQUENCE", "SEQUENCE_STRATEGY", "STRING_CORRELATION_ID", "DECOUPLED"}
    | {"as_dict", "from_result", "TENSOR_NAMES"}
)


@attrs.frozen(kw_only=True)
class TensorStub:
    """One input or output as the generator sees it."""

    name: str
    field: str
    dtype: int
    dims: tuple[int, ...]
    optional: bool = False

    @property
    def triton_dtype(self) -> str:
        return _NUMPY[self.dtype][1]

    @property
    def scalar(self) -> str:
        return _NUMPY[self.dtype][0]


@attrs.frozen(kw_only=True)
class ModelStub:
    """One model's facts, read from its ``config.pbtxt``."""

    name: str
    class_prefix: str
    max_batch_size: int
    inputs: tuple[TensorStub, ...]
    outputs: tuple[TensorStub, ...]
    sequence_strategy: str | None
    string_correlation_id: bool
    decoupled: bool


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


def _tensors(where: str, items: Sequence[mc.ModelInput] | Sequence[mc.ModelOutput]) -> tuple[TensorStub, ...]:
    ordered = sorted(items, key=lambda t: t.name)
    fields = _unique((_field_name(t.name) for t in ordered), _RESERVED)
    stubs = []
    for tensor, field in zip(ordered, fields, strict=True):
        if tensor.data_type not in _NUMPY:
            raise UsageError(f"{where}: tensor {tensor.name!r} has unsupported data type {tensor.data_type}")
        stubs.append(
            TensorStub(
                name=tensor.name,
                field=field,
                dtype=tensor.data_type,
                dims=tuple(tensor.dims),
                optional=bool(getattr(tensor, "optional", False)),
            )
        )
    return tuple(stubs)


def _read_config(path: Path, model_name: str, class_prefix: str) -> ModelStub:
    config = mc.ModelConfig()
    try:
        text_format.Parse(path.read_text(), config)
    except text_format.ParseError as err:
        raise UsageError(f"{path}: not a valid Triton model config: {err}") from err
    seq = config.sequence_batching if config.HasField("sequence_batching") else None
    strategy: str | None = None
    string_corrid = False
    if seq is not None:
        strategy = seq.WhichOneof("strategy_choice") or "direct"  # Triton's default strategy
        string_corrid = any(
            c.kind == mc.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID and c.data_type == mc.TYPE_STRING
            for ci in seq.control_input
            for c in ci.control
        )
    return ModelStub(
        name=model_name,
        class_prefix=class_prefix,
        max_batch_size=config.max_batch_size,
        inputs=_tensors(str(path), config.input),
        outputs=_tensors(str(path), config.output),
        sequence_strategy=strategy,
        string_correlation_id=string_corrid,
        decoupled=config.model_transaction_policy.decoupled,
    )


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
    # Triton names a model after its folder; the config's own name, when set, must match it.
    prefixes = _unique(_identifier(name, capitalise=True) for name in found)
    return [
        _read_config(repository / name / "config.pbtxt", name, prefix)
        for name, prefix in zip(found, prefixes, strict=True)
    ]


def _q(value: str | None) -> str:
    # A double-quoted literal, as ruff format writes it (JSON strings are valid Python literals).
    return "None" if value is None else json.dumps(value)


def _dims(t: TensorStub) -> str:
    return "[" + ", ".join(str(d) for d in t.dims) + "]"


def _input_type(t: TensorStub) -> str:
    base = _BYTES_INPUT if t.dtype == mc.TYPE_STRING else f"npt.NDArray[{t.scalar}]"
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
        encoded = f"np.asarray({value}, dtype=np.object_)" if t.dtype == mc.TYPE_STRING else value
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
    repository: Path, output: Path | None = None, *, models: Sequence[str] = (), command_args: str = ""
) -> str:
    """Generate the stubs module for ``repository``; write it to ``output`` when given; return the text."""
    stubs = read_repository(repository, models=models)
    if not stubs:
        raise UsageError(f"{repository}: no model folder with a config.pbtxt")
    text = render_module(stubs, command_args=command_args)
    if output is not None:
        output.write_text(text)
    return text
