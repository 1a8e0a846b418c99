"""A model's spec is the same whether its config was read over gRPC or over HTTP.

The two endpoints spell the config differently: HTTP writes every field out, gRPC (protobuf JSON) leaves
out each field at its protobuf default, so a START control (enum value 0) comes without its ``kind``,
``max_batch_size: 0`` and ``optional: false`` come not at all. Checked on every model of server_models/
and on a repository of other shapes written here and served by a server of this module's own.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from triton_npu_client import Client, ControlInput, LocalTriton, ModelSpec, SequenceSpec, TensorSpec

SERVER_MODELS = Path(__file__).resolve().parent.parent / "server_models"

# Answers each request with zeros (empty strings) of every declared output shape; only the configs matter here.
MODEL_PY = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.batched = config["max_batch_size"] > 0
        self.outputs = [
            (o["name"], pb_utils.triton_string_to_numpy(o["data_type"]), [max(int(d), 1) for d in o["dims"]])
            for o in config["output"]
        ]

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = [1] if self.batched else []
            tensors = [
                pb_utils.Tensor(name, np.full(rows + dims, b"" if dtype == np.object_ else 0, dtype))
                for name, dtype, dims in self.outputs
            ]
            responses.append(pb_utils.InferenceResponse(tensors))
        return responses
"""

# name -> config.pbtxt body (the name line is added). Each is a shape server_models/ does not cover.
SHAPES = {
    # No batch dimension; an optional input of a dtype whose enum value is not 0; a BOOL output.
    "unbatched_optional": """
        max_batch_size: 0
        input [
          { name: "A" data_type: TYPE_FP32 dims: [ 2, -1 ] },
          { name: "B" data_type: TYPE_INT64 dims: [ 1 ] optional: true }
        ]
        output [ { name: "Y" data_type: TYPE_BOOL dims: [ 1 ] } ]
    """,
    # Controls under names of their own, START declared first, one of each false/true form, direct strategy.
    "controls_renamed": """
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        sequence_batching {
          max_sequence_idle_microseconds: 2500000
          control_input [
            { name: "BEGIN_FLAG" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
            { name: "ENDING" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
            { name: "ALIVE" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
            { name: "the_id" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
          ]
          direct { }
        }
    """,
    # Oldest strategy and no control input at all: the batcher fills nothing in, ids of both kinds.
    "oldest_no_controls": """
        max_batch_size: 8
        input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]
        sequence_batching { oldest { max_candidate_sequences: 4 } }
    """,
    # String ids said by the parameter (as server_models/seq_stats_string does), START the only control.
    "string_ids_param": """
        max_batch_size: 2
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
        sequence_batching {
          control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
          oldest { }
        }
        parameters { key: "correlation_id_type" value: { string_value: "string" } }
    """,
    # No strategy named (Triton's default, direct), a TYPE_STRING CORRID, START declared first.
    "default_strategy_string_corrid": """
        max_batch_size: 1
        input [ { name: "X" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_STRING dims: [ 1 ] } ]
        sequence_batching {
          control_input [
            { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
            { name: "CORR" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
          ]
        }
    """,
}

# What each shape must read as (over either protocol); the START control among them is the one gRPC hid.
EXPECTED_SEQUENCES = {
    "unbatched_optional": None,
    "controls_renamed": SequenceSpec(
        strategy="direct",
        controls=(
            ControlInput(name="BEGIN_FLAG", kind="START", dtype="INT32"),
            ControlInput(name="ENDING", kind="END", dtype="FP32"),
            ControlInput(name="ALIVE", kind="READY", dtype="BOOL"),
            ControlInput(name="the_id", kind="CORRID", dtype="UINT64"),
        ),
        idle_timeout_us=2_500_000,
    ),
    "oldest_no_controls": SequenceSpec(strategy="oldest"),
    "string_ids_param": SequenceSpec(
        strategy="oldest", controls=(ControlInput(name="START", kind="START", dtype="INT32"),), string_ids=True
    ),
    "default_strategy_string_corrid": SequenceSpec(
        strategy="direct",
        controls=(
            ControlInput(name="START", kind="START", dtype="INT32"),
            ControlInput(name="CORR", kind="CORRID", dtype="BYTES"),
        ),
        string_ids=True,
    ),
}


@pytest.fixture(scope="module")
def shapes_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalTriton]:
    """One server for the module on a repository of the SHAPES models (starting one costs seconds)."""
    repo = tmp_path_factory.mktemp("shapes")
    for name, body in SHAPES.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\n'
            + textwrap.dedent(body)
            + "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
        )
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
    server = LocalTriton(repo, stop_grace_s=0)  # a graceful stop costs seconds; test_local.py tests it
    with server:
        yield server
    assert server.processes() == []
    shutil.rmtree(repo)


async def _specs(url: str, names: list[str]) -> dict[str, ModelSpec]:
    async with Client(url) as client:
        return {name: (await client.model(name)).spec for name in names}


async def _names(url: str) -> list[str]:
    async with Client(url) as client:
        return sorted(m.name for m in await client.repository_index())


async def test_server_models_read_the_same_over_grpc_and_http(triton_server: LocalTriton) -> None:
    """Every model of server_models/ gives equal specs over both protocols, its START control included."""
    names = await _names(triton_server.grpc_url)
    assert names == sorted(p.name for p in SERVER_MODELS.iterdir() if (p / "config.pbtxt").is_file())
    over_grpc = await _specs(triton_server.grpc_url, names)
    over_http = await _specs(triton_server.http_url, names)
    for name in names:
        assert over_grpc[name] == over_http[name], name
    # A START control is in the spec exactly when config.pbtxt declares one (read here as a protobuf).
    declaring_start: set[str] = set()
    for name in names:
        config = text_format.Parse((SERVER_MODELS / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        controls = [c for ci in config.sequence_batching.control_input for c in ci.control]
        if any(c.kind == model_config_pb2.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START for c in controls):
            declaring_start.add(name)
    assert "seq_stats_direct" in declaring_start
    with_start = {name for name, spec in over_grpc.items() if spec.sequence and spec.sequence.control("START")}
    assert with_start == declaring_start
    assert over_grpc["slow_echo"].max_batch_size == 0
    assert over_grpc["slow_echo"].input("DELAY_S") == TensorSpec(name="DELAY_S", dtype="FP32", dims=(1,), optional=True)


async def test_other_shapes_read_the_same_over_grpc_and_http(shapes_server: LocalTriton) -> None:
    """Unbatched, optional inputs, renamed controls, no controls, string ids, default strategy: equal specs."""
    names = await _names(shapes_server.grpc_url)
    assert names == sorted(SHAPES)
    over_grpc = await _specs(shapes_server.grpc_url, names)
    over_http = await _specs(shapes_server.http_url, names)
    for name in names:
        assert over_grpc[name] == over_http[name], name
        assert over_grpc[name].sequence == EXPECTED_SEQUENCES[name], name
    unbatched = over_grpc["unbatched_optional"]
    assert (unbatched.max_batch_size, unbatched.batched) == (0, False)
    assert unbatched.inputs == (
        TensorSpec(name="A", dtype="FP32", dims=(2, -1)),
        TensorSpec(name="B", dtype="INT64", dims=(1,), optional=True),
    )
    assert unbatched.outputs == (TensorSpec(name="Y", dtype="BOOL", dims=(1,)),)
    renamed = over_grpc["controls_renamed"].sequence
    assert renamed is not None
    assert renamed.control("START") == ControlInput(name="BEGIN_FLAG", kind="START", dtype="INT32")
