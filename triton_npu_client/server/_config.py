"""Read what a Python-backend model needs from ``args["model_config"]``: the sequence batcher, parameters.

Pure: takes the JSON string (or the decoded dict) Triton hands to ``initialize``; no pb_utils.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["SequenceBatching", "model_parameter", "parse_model_config"]

# Triton's own default when the config leaves max_sequence_idle_microseconds out.
DEFAULT_IDLE_US = 1_000_000

_KINDS = {
    "CONTROL_SEQUENCE_START": "start",
    "CONTROL_SEQUENCE_END": "end",
    "CONTROL_SEQUENCE_READY": "ready",
    "CONTROL_SEQUENCE_CORRID": "corrid",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceBatching:
    """The model's ``sequence_batching`` section, reduced to what a stateful model acts on.

    ``strategy`` is ``"oldest"`` when the section has an ``oldest`` block, else ``"direct"`` (Triton's
    default when the config names neither).

    ``control_inputs`` maps a control kind (``"start"``, ``"end"``, ``"ready"``, ``"corrid"``) to the
    name of the input tensor that carries it; a kind not declared there is read from the request
    itself (``request.flags()`` / ``request.correlation_id()``).
    """

    strategy: Literal["oldest", "direct"]
    idle_timeout_us: int = DEFAULT_IDLE_US
    control_inputs: Mapping[str, str] = field(default_factory=dict)
    string_ids: bool = False
    max_batch_size: int = 0

    @property
    def idle_timeout_s(self) -> float:
        return self.idle_timeout_us / 1e6

    @classmethod
    def from_model_config(cls, config: str | Mapping[str, Any]) -> SequenceBatching:
        """Parse ``args["model_config"]``; ``ValueError`` when the model is not sequence-batched."""
        cfg = parse_model_config(config)
        seq = cfg.get("sequence_batching")
        # An empty section is still a section: `sequence_batching { }` is a direct-strategy sequence model.
        if seq is None:
            raise ValueError(f"model {cfg.get('name', '?')!r} has no sequence_batching section")
        # Triton runs the direct strategy unless the config selects oldest: a section with neither is direct.
        # Presence decides, not truth: an empty "oldest": {} still selects oldest.
        strategy: Literal["oldest", "direct"] = "oldest" if seq.get("oldest") is not None else "direct"
        controls: dict[str, str] = {}
        string_ids = False
        for control_input in seq.get("control_input", []):
            for control in control_input.get("control", []):
                kind = _KINDS.get(control.get("kind", ""))
                if kind is None:
                    continue
                controls[kind] = control_input["name"]
                if kind == "corrid" and control.get("data_type") == "TYPE_STRING":
                    string_ids = True
        # A declared TYPE_STRING CORRID control is broken in Triton 2.51 for the Python backend (the
        # batcher pads the id to 128 bytes and the input then fails to parse), so a model can say
        # "string ids" with parameters { key: "correlation_id_type" value: { string_value: "string" } }
        # and read request.correlation_id() instead. Such a model still accepts integer ids (Triton
        # cannot be told otherwise; perf_analyzer sends them): string_ids tells clients what to send.
        if (model_parameter(cfg, "correlation_id_type") or "").lower() == "string":
            string_ids = True
        # uint64 fields may arrive as JSON strings depending on the serialiser: int() takes both.
        idle = int(seq.get("max_sequence_idle_microseconds") or DEFAULT_IDLE_US)
        return cls(
            strategy=strategy,
            idle_timeout_us=idle,
            control_inputs=controls,
            string_ids=string_ids,
            max_batch_size=int(cfg.get("max_batch_size", 0)),
        )


def parse_model_config(config: str | Mapping[str, Any]) -> dict[str, Any]:
    """``args["model_config"]`` (a JSON string) as a dict; a mapping is copied through."""
    if isinstance(config, str):
        decoded = json.loads(config)
        if not isinstance(decoded, dict):
            raise ValueError("model_config JSON is not an object")
        return decoded
    return dict(config)


def model_parameter(config: str | Mapping[str, Any], key: str, default: str | None = None) -> str | None:
    """The ``string_value`` of ``parameters { key: ... }`` in the model config, or ``default``."""
    params = parse_model_config(config).get("parameters") or {}
    entry = params.get(key)
    if not entry:
        return default
    value = entry.get("string_value") if isinstance(entry, Mapping) else entry
    return default if value in (None, "") else str(value)
