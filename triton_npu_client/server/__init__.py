"""Server-side toolkit for Python-backend models inside Triton: sequence controls, state, device.

This folder's own modules are the generic toolkit any stateful model can use: sequence controls (``_controls``),
per-sequence slots and state (``_state``), the step loop of decoupled models (``_generate``), device choice
(``_device``), the model config (``_config``), checkpoint JSON files (``_files``) and the running-statistics model
(``_model``). What the server and the client must spell the same (refusal markers, the chat history digest, the chat
model's tensor names) is neither side's: it lives in ``triton_npu_client._protocol``, which both import. Each model
engine lives in a folder of its own: ``chat/`` (GPT-2 decoder, KV cache, chat engine and model) and ``encoder/``
(BERT, the sentence tokenizer and encoder models). The toolkit imports no engine; an engine imports the toolkit and
itself, never another engine (tests/test_layers.py). Every public name is re-exported here whichever folder defines
it.

Imports only the standard library, numpy and the protocol (never the client, tritonclient or
``triton_python_backend_utils``), so model.py files, unit tests and ``bench/device_check.py`` can all
use it. torch is imported lazily, and only for an instance that may use an accelerator (see
:func:`accelerator_possible`): a CPU instance runs on :class:`NumpyMoments` without it.
The one pb_utils-facing piece, :class:`RunningStatsModel`, takes that module as an argument.
"""

import typing as _typing

if _typing.TYPE_CHECKING:
    from .._protocol import SEQUENCE_BUSY
    from ._config import SequenceBatching, model_parameter, parse_model_config
    from ._controls import FLAG_END, FLAG_START, SequenceControls, read_controls
    from ._device import (
        Accelerators,
        DeviceChoice,
        accelerator_possible,
        activate,
        choose_device,
        instance_index,
        parse_device_ids,
        probe_accelerators,
        to_host,
    )
    from ._generate import ExitReason, StepLoop, StepOutput, Stream
    from ._model import RunningStatsModel
    from ._state import BatchPlan, NumpyMoments, Refusal, RunningMoments, SequenceSlots
    from .chat._blocks import BlockManager, BlockTable, CacheFull, PagedKVCache
    from .chat._chat import ChatEngine, ChatMessage, ChatResponse, ChatTurn, TurnOptions
    from .chat._chat_model import ChatModel
    from .chat._decoders import Decoder, load_decoder
    from .chat._gpt2 import GPT2, GPT2Config, GPT2Layer, load_gpt2
    from .chat._llama import Llama, LlamaConfig, LlamaLayer, RopeScaling, load_llama
    from .chat._runner import DecodeBatch, ModelRunner, PrefillRow, RowSampling
    from .chat._tables import forward_tables
    from .chat._template import ChatTemplateError, CheckpointTokenizer
    from .encoder._bert import BERT, BertConfig, load_bert, sentence_embeddings
    from .encoder._encoder import (
        EncoderModel,
        SentenceEncoder,
        SentenceEncoderConfig,
        SentenceTokenizer,
        TokenizerModel,
        packaged_checkpoint,
    )

# Every name loads its module on first use (PEP 562): `import triton_npu_client.server` stays cheap for a model.py
# that needs one engine, and a tool that reads one name loads neither numpy models nor tokenizers. A name maps to
# its module (relative to this package: "._protocol" is the protocol, beside it), or to (module, name there).
_LAZY: dict[str, str | tuple[str, str]] = {
    "BERT": "encoder._bert",
    "BertConfig": "encoder._bert",
    "load_bert": "encoder._bert",
    "sentence_embeddings": "encoder._bert",
    "ChatEngine": "chat._chat",
    "ChatMessage": "chat._chat",
    "ChatResponse": "chat._chat",
    "CheckpointTokenizer": "chat._template",
    "ChatTemplateError": "chat._template",
    "ChatTurn": "chat._chat",
    "TurnOptions": "chat._chat",
    "ChatModel": "chat._chat_model",
    "SequenceBatching": "_config",
    "model_parameter": "_config",
    "parse_model_config": "_config",
    "FLAG_END": "_controls",
    "FLAG_START": "_controls",
    "SequenceControls": "_controls",
    "read_controls": "_controls",
    "Accelerators": "_device",
    "DeviceChoice": "_device",
    "accelerator_possible": "_device",
    "activate": "_device",
    "choose_device": "_device",
    "instance_index": "_device",
    "parse_device_ids": "_device",
    "probe_accelerators": "_device",
    "to_host": "_device",
    "EncoderModel": "encoder._encoder",
    "SentenceEncoder": "encoder._encoder",
    "SentenceEncoderConfig": "encoder._encoder",
    "SentenceTokenizer": "encoder._encoder",
    "TokenizerModel": "encoder._encoder",
    "packaged_checkpoint": "encoder._encoder",
    "ExitReason": "_generate",
    "StepLoop": "_generate",
    "StepOutput": "_generate",
    "Stream": "_generate",
    "GPT2": "chat._gpt2",
    "GPT2Config": "chat._gpt2",
    "GPT2Layer": "chat._gpt2",
    "BlockManager": "chat._blocks",
    "PagedKVCache": "chat._blocks",
    "BlockTable": "chat._blocks",
    "CacheFull": "chat._blocks",
    "Decoder": "chat._decoders",
    "DecodeBatch": "chat._runner",
    "ModelRunner": "chat._runner",
    "PrefillRow": "chat._runner",
    "RowSampling": "chat._runner",
    "forward_tables": "chat._tables",
    "load_gpt2": "chat._gpt2",
    "load_decoder": "chat._decoders",
    "Llama": "chat._llama",
    "LlamaConfig": "chat._llama",
    "LlamaLayer": "chat._llama",
    "RopeScaling": "chat._llama",
    "load_llama": "chat._llama",
    "SEQUENCE_BUSY": "._protocol",  # the marker model.py files raise with
    "RunningStatsModel": "_model",
    "BatchPlan": "_state",
    "NumpyMoments": "_state",
    "Refusal": "_state",
    "RunningMoments": "_state",
    "SequenceSlots": "_state",
}


def __getattr__(name: str) -> _typing.Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = (where, name) if isinstance(where, str) else where
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FLAG_END",
    "FLAG_START",
    "SEQUENCE_BUSY",
    "Accelerators",
    "BERT",
    "BatchPlan",
    "BlockManager",
    "BlockTable",
    "BertConfig",
    "CacheFull",
    "ChatEngine",
    "ChatMessage",
    "ChatModel",
    "ChatResponse",
    "ChatTemplateError",
    "CheckpointTokenizer",
    "ChatTurn",
    "DecodeBatch",
    "Decoder",
    "DeviceChoice",
    "EncoderModel",
    "ExitReason",
    "GPT2",
    "GPT2Config",
    "GPT2Layer",
    "Llama",
    "LlamaConfig",
    "LlamaLayer",
    "ModelRunner",
    "NumpyMoments",
    "PagedKVCache",
    "PrefillRow",
    "Refusal",
    "RopeScaling",
    "RowSampling",
    "RunningMoments",
    "RunningStatsModel",
    "SentenceEncoder",
    "SentenceEncoderConfig",
    "SentenceTokenizer",
    "SequenceBatching",
    "SequenceControls",
    "SequenceSlots",
    "StepLoop",
    "StepOutput",
    "Stream",
    "TokenizerModel",
    "TurnOptions",
    "accelerator_possible",
    "activate",
    "choose_device",
    "forward_tables",
    "instance_index",
    "load_bert",
    "load_decoder",
    "load_gpt2",
    "load_llama",
    "model_parameter",
    "packaged_checkpoint",
    "parse_device_ids",
    "parse_model_config",
    "probe_accelerators",
    "read_controls",
    "sentence_embeddings",
    "to_host",
]
