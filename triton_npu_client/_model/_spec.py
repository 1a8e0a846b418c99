"""What a model accepts and returns: immutable specs built once from the server's model config.

The config arrives as JSON in two spellings: Triton's HTTP endpoint writes every field out, defaults
included, while the gRPC one (protobuf JSON) leaves out each field at its protobuf default: ``0``,
``false``, ``""``, empty lists and enum value 0 (``CONTROL_SEQUENCE_START``, ``TYPE_INVALID``). Every
scalar and enum field read here goes through :func:`_field`, which gives a missing one its default from the
``ModelConfig`` protobuf itself; a missing list reads as empty. So both spellings build the same spec.
Message fields (``sequence_batching``, ``direct``, ``oldest``) have presence: both spellings carry a set
one, even empty, and neither carries an unset one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
from tritonclient.grpc import model_config_pb2 as _pb

from .._wire import config_to_triton

__all__ = ["ControlInput", "ModelSpec", "SequenceSpec", "TensorSpec"]

# Triton's default max_sequence_idle_microseconds when the config leaves it out.
DEFAULT_IDLE_TIMEOUT_US = 1_000_000

ControlKind = Literal["START", "END", "READY", "CORRID"]


def _field(entry: Mapping[str, Any], message: Any, name: str) -> Any:
    """``entry[name]``, or the protobuf default of field ``name`` of ``message`` (a ``model_config_pb2`` class).

    Enums come back by name, as the HTTP JSON spells them, also when given as numbers.
    """
    field = message.DESCRIPTOR.fields_by_name[name]
    value = entry.get(name)
    if value is None:
        value = field.default_value
    if field.enum_type is not None and isinstance(value, int):
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else str(value)
    return value


def _dims(value: Any) -> tuple[int, ...]:
    # The JSON form of int64 fields is a string ("-1"), the HTTP form a number: accept both.
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
        """From one ``input``/``output`` entry of the model config (JSON form); outputs are never optional."""
        # ModelInput and ModelOutput share name, data_type and dims; only inputs have ``optional``.
        return cls(
            name=str(_field(entry, _pb.ModelInput, "name")),
            dtype=config_to_triton(str(_field(entry, _pb.ModelInput, "data_type"))),
            dims=_dims(entry.get("dims")),
            optional=bool(_field(entry, _pb.ModelInput, "optional")),
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
        for entry in sb.get("control_input") or ():
            name = str(_field(entry, _pb.ModelSequenceBatching.ControlInput, "name"))
            for ctl in entry.get("control") or ():
                # CONTROL_SEQUENCE_START is enum value 0: the gRPC JSON leaves its kind out.
                kind = _CONTROL_KINDS.get(str(_field(ctl, _pb.ModelSequenceBatching.Control, "kind")))
                if kind is None:  # a kind newer than this SDK: not one the session fills in
                    continue
                data_type = str(_field(ctl, _pb.ModelSequenceBatching.Control, "data_type"))
                if data_type != "TYPE_INVALID":
                    dtype = config_to_triton(data_type)
                elif ctl.get("fp32_false_true"):
                    dtype = "FP32"
                elif ctl.get("bool_false_true"):
                    dtype = "BOOL"
                else:
                    dtype = "INT32"
                controls.append(ControlInput(name=name, kind=kind, dtype=dtype))
        corrid = next((c for c in controls if c.kind == "CORRID"), None)
        # A TYPE_STRING CORRID control does not work with the Python backend in 2.51 (the batcher pads string
        # ids), so string-id models declare no CORRID and say so with this config parameter instead.
        param = (parameters or {}).get("correlation_id_type") or {}
        string_param = str(_field(param, _pb.ModelParameter, "string_value")).lower() == "string"
        # 0 (the protobuf default, what gRPC leaves out) is Triton's "use the default idle timeout".
        idle_us = int(_field(sb, _pb.ModelSequenceBatching, "max_sequence_idle_microseconds"))
        return cls(
            # The strategy is a oneof (direct, oldest); with neither set Triton's sequence batcher runs direct.
            # A set one is present in both spellings, even when empty ({}): message fields have presence.
            strategy="oldest" if sb.get("oldest") is not None else "direct",
            controls=tuple(controls),
            string_ids=(corrid is not None and corrid.dtype == "BYTES") or string_param,
            idle_timeout_us=idle_us or DEFAULT_IDLE_TIMEOUT_US,
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
    # The model lets Triton merge requests (rows are independent): client-side merging is the same promise.
    dynamic_batching: bool = False
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
        # Message fields have presence in both spellings: a stateless model has no sequence_batching key.
        sb = config.get("sequence_batching")
        policy = config.get("model_transaction_policy") or {}
        backend = _field(config, _pb.ModelConfig, "backend") or _field(config, _pb.ModelConfig, "platform")
        return cls(
            name=str(_field(config, _pb.ModelConfig, "name")),
            version=version,
            backend=str(backend),
            inputs=tuple(TensorSpec.from_config(e) for e in config.get("input") or ()),
            outputs=tuple(TensorSpec.from_config(e) for e in config.get("output") or ()),
            max_batch_size=int(_field(config, _pb.ModelConfig, "max_batch_size")),
            sequence=SequenceSpec.from_config(sb, parameters=config.get("parameters")) if sb is not None else None,
            decoupled=bool(_field(policy, _pb.ModelTransactionPolicy, "decoupled")),
            dynamic_batching=config.get("dynamic_batching") is not None,
        )
