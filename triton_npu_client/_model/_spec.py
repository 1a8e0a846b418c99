"""What a model accepts and returns: immutable specs built once from the server's model config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from .._wire import config_to_triton

__all__ = ["ControlInput", "ModelSpec", "SequenceSpec", "TensorSpec"]

# Triton's default max_sequence_idle_microseconds when the config leaves it out.
DEFAULT_IDLE_TIMEOUT_US = 1_000_000

ControlKind = Literal["START", "END", "READY", "CORRID"]


def _dims(value: Any) -> tuple[int, ...]:
    # The JSON form of int64 fields is a string ("-1"), the protobuf form an int: accept both.
    return tuple(int(d) for d in value or ())


@attrs.frozen(kw_only=True)
class TensorSpec:
    """One input or output: name, Triton dtype (``"FP32"``, ``"BYTES"``...), dims without the batch dim."""

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False

    def __repr__(self) -> str:
        dims = ",".join(str(d) for d in self.dims)
        return f"{self.name}{'?' if self.optional else ''}: {self.dtype}[{dims}]"

    @classmethod
    def from_config(cls, entry: Mapping[str, Any]) -> TensorSpec:
        """From one ``input``/``output`` entry of the model config (JSON form)."""
        return cls(
            name=str(entry["name"]),
            dtype=config_to_triton(str(entry.get("data_type", "TYPE_INVALID"))),
            dims=_dims(entry.get("dims")),
            optional=bool(entry.get("optional", False)),
        )


@attrs.frozen(kw_only=True)
class ControlInput:
    """A sequence control input the batcher fills in (START, END, READY or CORRID) and its Triton dtype."""

    name: str
    kind: ControlKind
    dtype: str


_CONTROL_KINDS: Mapping[str, ControlKind] = {
    "CONTROL_SEQUENCE_START": "START",
    "CONTROL_SEQUENCE_END": "END",
    "CONTROL_SEQUENCE_READY": "READY",
    "CONTROL_SEQUENCE_CORRID": "CORRID",
}


@attrs.frozen(kw_only=True)
class SequenceSpec:
    """Sequence batching of a stateful model.

    ``string_ids`` is true when the CORRID control is declared ``TYPE_STRING``; without a CORRID control
    Triton 2.51 accepts both integer and string ids (``accepts_int_ids`` and ``accepts_str_ids``).
    """

    strategy: Literal["oldest", "direct"]
    controls: tuple[ControlInput, ...] = ()
    string_ids: bool = False
    idle_timeout_us: int = DEFAULT_IDLE_TIMEOUT_US

    def control(self, kind: ControlKind) -> ControlInput | None:
        """The control input of ``kind``, if declared."""
        return next((c for c in self.controls if c.kind == kind), None)

    @property
    def accepts_str_ids(self) -> bool:
        """Whether string correlation ids are accepted (declared string, or no CORRID control at all)."""
        return self.string_ids or self.control("CORRID") is None

    @property
    def accepts_int_ids(self) -> bool:
        """Whether integer correlation ids are accepted."""
        return not self.string_ids

    @classmethod
    def from_config(cls, sb: Mapping[str, Any], *, parameters: Mapping[str, Any] | None = None) -> SequenceSpec:
        """From the ``sequence_batching`` section of the model config (JSON form) and the config's ``parameters``."""
        controls = []
        for entry in sb.get("control_input", ()):
            for ctl in entry.get("control", ()):
                kind = _CONTROL_KINDS.get(str(ctl.get("kind")))
                if kind is None:
                    continue
                # The HTTP JSON spells out defaults ("TYPE_INVALID", empty lists); gRPC JSON omits them.
                if ctl.get("data_type") not in (None, "", "TYPE_INVALID"):
                    dtype = config_to_triton(str(ctl["data_type"]))
                elif ctl.get("fp32_false_true"):
                    dtype = "FP32"
                elif ctl.get("bool_false_true"):
                    dtype = "BOOL"
                else:
                    dtype = "INT32"
                controls.append(ControlInput(name=str(entry["name"]), kind=kind, dtype=dtype))
        corrid = next((c for c in controls if c.kind == "CORRID"), None)
        # A TYPE_STRING CORRID control does not work with the Python backend in 2.51 (the batcher pads string
        # ids), so string-id models declare no CORRID and say so with this config parameter instead.
        param = (parameters or {}).get("correlation_id_type") or {}
        string_param = str(param.get("string_value", "")).lower() == "string"
        return cls(
            # Triton's strategy is a oneof whose default is direct.
            strategy="oldest" if "oldest" in sb else "direct",
            controls=tuple(controls),
            string_ids=(corrid is not None and corrid.dtype == "BYTES") or string_param,
            idle_timeout_us=int(sb.get("max_sequence_idle_microseconds") or DEFAULT_IDLE_TIMEOUT_US),
        )


@attrs.frozen(kw_only=True)
class ModelSpec:
    """A model's signature: inputs, outputs, batching, statefulness. Build with :meth:`from_config`."""

    name: str
    version: str | None = None
    backend: str = ""
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    max_batch_size: int = 0
    sequence: SequenceSpec | None = None
    decoupled: bool = False
    _inputs_by_name: Mapping[str, TensorSpec] = attrs.field(init=False, repr=False, eq=False)
    _outputs_by_name: Mapping[str, TensorSpec] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_inputs_by_name", {t.name: t for t in self.inputs})
        object.__setattr__(self, "_outputs_by_name", {t.name: t for t in self.outputs})

    @property
    def is_stateful(self) -> bool:
        """Whether the model uses sequence batching (its requests need a sequence id)."""
        return self.sequence is not None

    @property
    def batched(self) -> bool:
        """Whether requests carry a leading batch dimension (``max_batch_size > 0``)."""
        return self.max_batch_size > 0

    def input(self, name: str) -> TensorSpec | None:
        """The input called ``name``, or None."""
        return self._inputs_by_name.get(name)

    def output(self, name: str) -> TensorSpec | None:
        """The output called ``name``, or None."""
        return self._outputs_by_name.get(name)

    def __repr__(self) -> str:
        ins = ", ".join(repr(t) for t in self.inputs)
        outs = ", ".join(repr(t) for t in self.outputs)
        version = f":{self.version}" if self.version else ""
        extra = f", max_batch_size={self.max_batch_size}"
        if self.sequence is not None:
            extra += f", sequence={self.sequence.strategy}"
        if self.decoupled:
            extra += ", decoupled"
        return f"<ModelSpec {self.name}{version}({ins}) -> ({outs}){extra}>"

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any, *, version: str | None = None) -> ModelSpec:
        """From a model config: the JSON dict (``{"config": {...}}`` or its inside) or a ``ModelConfig`` protobuf."""
        if not isinstance(config, Mapping):
            from google.protobuf import json_format

            config = json_format.MessageToDict(config, preserving_proto_field_name=True)
        if "config" in config and isinstance(config["config"], Mapping):
            config = config["config"]
        sb = config.get("sequence_batching")
        policy = config.get("model_transaction_policy") or {}
        return cls(
            name=str(config["name"]),
            version=version,
            backend=str(config.get("backend") or config.get("platform") or ""),
            inputs=tuple(TensorSpec.from_config(e) for e in config.get("input", ())),
            outputs=tuple(TensorSpec.from_config(e) for e in config.get("output", ())),
            max_batch_size=int(config.get("max_batch_size") or 0),
            sequence=SequenceSpec.from_config(sb, parameters=config.get("parameters")) if sb is not None else None,
            decoupled=bool(policy.get("decoupled", False)),
        )
