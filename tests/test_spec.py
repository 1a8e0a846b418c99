"""ModelSpec / SequenceSpec from model configs (JSON dicts and protobufs), and the signature repr."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from triton_npu_client import ControlInput, ModelSpec, SequenceSpec, TensorSpec

REPO = Path(__file__).resolve().parent.parent / "server_models"

STATEFUL = {
    "name": "acc",
    "backend": "python",
    "max_batch_size": 16,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": ["4"]}],
    "sequence_batching": {
        "max_sequence_idle_microseconds": "5000000",
        "control_input": [
            {
                "name": "START",
                # as the HTTP JSON spells it: defaults written out
                "control": [
                    {"kind": "CONTROL_SEQUENCE_START", "data_type": "TYPE_INVALID", "int32_false_true": [0, 1]}
                ],
            },
            {"name": "READY", "control": [{"kind": "CONTROL_SEQUENCE_READY", "bool_false_true": [False, True]}]},
            {"name": "CORRID", "control": [{"kind": "CONTROL_SEQUENCE_CORRID", "data_type": "TYPE_STRING"}]},
        ],
        "direct": {},
    },
    "model_transaction_policy": {"decoupled": True},
}


def test_stateful_config() -> None:
    """Strategy, control inputs with dtypes, string ids, idle timeout and decoupled are read from the config."""
    spec = ModelSpec.from_config({"config": STATEFUL})
    assert spec.is_stateful
    assert spec.decoupled
    seq = spec.sequence
    assert seq == SequenceSpec(
        strategy="direct",
        controls=(
            ControlInput(name="START", kind="START", dtype="INT32"),
            ControlInput(name="READY", kind="READY", dtype="BOOL"),
            ControlInput(name="CORRID", kind="CORRID", dtype="BYTES"),
        ),
        string_ids=True,
        idle_timeout_us=5_000_000,
    )
    assert seq.accepts_str_ids
    assert not seq.accepts_int_ids
    assert repr(spec) == "<ModelSpec acc(X: FP32[4]) -> (Y: FP32[4]), max_batch_size=16, sequence=direct, decoupled>"


def test_oldest_without_corrid_accepts_both_id_kinds() -> None:
    """An oldest-strategy model without a CORRID control takes int and str ids, with the 1 s default timeout."""
    config = dict(STATEFUL, sequence_batching={"oldest": {"max_candidate_sequences": 4}})
    seq = ModelSpec.from_config(config).sequence
    assert seq is not None
    assert (seq.strategy, seq.controls, seq.idle_timeout_us) == ("oldest", (), 1_000_000)
    assert seq.accepts_int_ids
    assert seq.accepts_str_ids


def test_from_protobuf_matches_server_models_config() -> None:
    """The config.pbtxt of scale_fp32, parsed as a protobuf, gives the documented signature."""
    proto = text_format.Parse((REPO / "scale_fp32" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    spec = ModelSpec.from_config(proto)
    assert spec.inputs == (TensorSpec(name="INPUT0", dtype="FP32", dims=(-1,)),)
    assert spec.input("INPUT0") is spec.inputs[0]
    assert spec.output("NOPE") is None
    assert not spec.is_stateful
    assert repr(spec) == "<ModelSpec scale_fp32(INPUT0: FP32[-1]) -> (OUTPUT0: FP32[-1]), max_batch_size=64>"


def test_dtypes_echo_declares_every_dtype_optional() -> None:
    """dtypes_echo has one optional input per Triton dtype, BYTES from TYPE_STRING."""
    proto = text_format.Parse((REPO / "dtypes_echo" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    spec = ModelSpec.from_config(proto)
    assert {t.dtype for t in spec.inputs} == {
        "BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64",
        "FP16", "FP32", "FP64", "BF16", "BYTES",
    }  # fmt: skip
    assert all(t.optional for t in spec.inputs)


def _grpc_json(pbtxt: str) -> dict[str, Any]:
    """The config as Triton's gRPC endpoint spells it: protobuf JSON, every field at its default left out."""
    proto = text_format.Parse(pbtxt, model_config_pb2.ModelConfig())
    return dict(json_format.MessageToDict(proto, preserving_proto_field_name=True))


def test_start_control_survives_the_grpc_spelling() -> None:
    """CONTROL_SEQUENCE_START is enum value 0, so gRPC JSON drops its kind: the control is still read as START."""
    config = _grpc_json((REPO / "seq_stats_direct" / "config.pbtxt").read_text())
    assert "kind" not in config["sequence_batching"]["control_input"][0]["control"][0]
    seq = ModelSpec.from_config(config).sequence
    assert seq is not None
    assert seq.control("START") == ControlInput(name="START", kind="START", dtype="INT32")
    assert [c.kind for c in seq.controls] == ["START", "END", "READY", "CORRID"]


def test_missing_fields_read_as_their_protobuf_defaults() -> None:
    """Each field gRPC leaves out reads as its default, giving the spec the HTTP spelling (all written out) gives."""
    pbtxt = """
        name: "m" backend: "python" max_batch_size: 0
        input [ { name: "A" data_type: TYPE_FP32 dims: [ -1 ] optional: false } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
        sequence_batching {
          max_sequence_idle_microseconds: 0
          control_input [ { name: "GO" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
        }
        model_transaction_policy { decoupled: false }
    """
    grpc = _grpc_json(pbtxt)
    assert "max_batch_size" not in grpc
    assert "optional" not in grpc["input"][0]
    assert grpc["model_transaction_policy"] == {}
    http = {
        "name": "m",
        "platform": "",
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "A", "data_type": "TYPE_FP32", "dims": [-1], "optional": False}],
        "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}],
        "sequence_batching": {
            "max_sequence_idle_microseconds": 0,
            "control_input": [
                {
                    "name": "GO",
                    "control": [
                        {
                            "kind": "CONTROL_SEQUENCE_START",
                            "int32_false_true": [0, 1],
                            "fp32_false_true": [],
                            "bool_false_true": [],
                            "data_type": "TYPE_INVALID",
                        }
                    ],
                }
            ],
            "state": [],
        },
        "model_transaction_policy": {"decoupled": False},
        "parameters": {},
    }
    spec = ModelSpec.from_config(grpc)
    assert spec == ModelSpec.from_config(http)
    assert spec == ModelSpec(
        name="m",
        backend="python",
        inputs=(TensorSpec(name="A", dtype="FP32", dims=(-1,)),),
        outputs=(TensorSpec(name="Y", dtype="FP32", dims=(-1,)),),
        max_batch_size=0,
        # Neither direct nor oldest given: Triton's sequence batcher runs direct; idle 0 means its 1 s default.
        sequence=SequenceSpec(strategy="direct", controls=(ControlInput(name="GO", kind="START", dtype="INT32"),)),
    )


def test_enums_given_as_numbers_read_as_their_names() -> None:
    """A config dict written with enum numbers (``use_integers_for_enums``) reads like one with enum names."""
    proto = text_format.Parse((REPO / "seq_stats_oldest" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    by_number = json_format.MessageToDict(proto, preserving_proto_field_name=True, use_integers_for_enums=True)
    assert by_number["input"][0]["data_type"] == model_config_pb2.TYPE_FP32
    assert ModelSpec.from_config(by_number) == ModelSpec.from_config(proto)
