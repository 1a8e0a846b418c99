"""The protocol (``triton_npu_client._protocol``) is what both sides spell: each side's own tables agree with it.

No server: the packaged chat configs, the chat engine's family table and the client's options are read as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_type_hints

import attrs
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from triton_npu_client import ChatOpenArgs, ChatOptionArgs, ChatOptions
from triton_npu_client._local import CHAT_MODEL_TYPES
from triton_npu_client._protocol import chat as proto
from triton_npu_client.server.chat._families import FAMILIES

MODELS = Path(__file__).resolve().parent.parent / "server_models"
CHAT_MODELS = sorted(p.parent.name for p in MODELS.glob("chat*/config.pbtxt"))


def _names(model: str) -> tuple[set[str], set[str]]:
    config = text_format.Parse((MODELS / model / "config.pbtxt").read_text(), mc.ModelConfig())
    return {i.name for i in config.input}, {o.name for o in config.output}


def test_the_packaged_chat_model_declares_exactly_the_protocol_names() -> None:
    """server_models/chat (what a generated checkpoint model copies) declares every name of the protocol, no other."""
    inputs, outputs = _names("chat")
    assert inputs == set(proto.INPUTS)
    assert outputs == set(proto.OUTPUTS)


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_every_packaged_chat_model_speaks_the_protocol(model: str) -> None:
    """Each chat* model has what makes a chat model, and no name the protocol does not know (a variant may leave an
    optional one out: chat_stateless has no DIGEST)."""
    inputs, outputs = _names(model)
    assert set(proto.REQUIRED_INPUTS) <= inputs <= set(proto.INPUTS)
    assert set(proto.REQUIRED_OUTPUTS) <= outputs <= set(proto.OUTPUTS)


def test_the_client_sends_only_protocol_inputs_for_its_options() -> None:
    """Every option set gives exactly the protocol's option inputs and STOP (the client's side of the names)."""
    every = ChatOptions(max_tokens=9, min_tokens=1, temperature=0.5, top_p=0.9, top_k=4, seed=3, stop=["#"],
                        stream_interval_ms=5, response_format={"type": "json_object"}, presence_penalty=0.5,
                        frequency_penalty=-0.5, repetition_penalty=1.2, logprobs=2,
                        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")  # fmt: skip
    assert set(every.inputs()) == {*proto.OPTION_INPUTS, proto.STOP}


def test_the_engine_serves_exactly_the_protocol_model_types() -> None:
    """The chat engine's loader table names exactly the checkpoint families the client lets through."""
    assert tuple(FAMILIES) == proto.MODEL_TYPES == CHAT_MODEL_TYPES


def test_the_options_typed_dict_and_the_options_value_name_the_same_options() -> None:
    """ChatOptionArgs (the keywords every chat signature takes) and ChatOptions (their checked value) cannot drift;
    ChatOpenArgs adds the opening keywords to them, and is what every opening signature takes."""
    fields = {f.name for f in attrs.fields(ChatOptions)}
    assert set(get_type_hints(ChatOptionArgs)) == fields == set(ChatOptionArgs.__optional_keys__)
    assert set(ChatOpenArgs.__optional_keys__) - fields == {
        "system", "history", "sequence_id", "timeout_s", "end_timeout_s", "replay_on_loss", "resume"
    }  # fmt: skip
    assert ChatOpenArgs.__required_keys__ == frozenset()


async def test_a_misspelt_chat_option_is_refused_as_python_refuses_a_keyword() -> None:
    """With one ``**options`` type, a keyword no signature spells any more would be dropped silently: it is a
    TypeError naming it (and what a chat takes) on every entry, before anything is sent."""
    from triton_npu_client import Client

    async with Client("grpc://127.0.0.1:1") as client:  # nothing listens there: nothing may be sent
        with pytest.raises(TypeError, match=r"'max_token'.*max_tokens"):
            client.chat("chat", max_token=5)  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="'sytem'"):
            client.chat("chat", sytem="Be brief.")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="'temp'"):
        ChatOptions().override(temp=0.5)  # type: ignore[call-arg]
