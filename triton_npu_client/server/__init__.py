"""Server-side toolkit for Python-backend models inside Triton: sequence controls, state, device.

Imports only the standard library and numpy (never the client, tritonclient or
``triton_python_backend_utils``), so model.py files, unit tests and ``bench/device_check.py`` can all
use it. torch is imported lazily, and only for an instance that may use an accelerator (see
:func:`accelerator_possible`): a CPU instance runs on :class:`NumpyMoments` without it.
The one pb_utils-facing piece, :class:`RunningStatsModel`, takes that module as an argument.
"""

from ._bert import BERT, BertConfig, load_bert, sentence_embeddings
from ._chat import ChatEngine, ChatMessage, ChatResponse, ChatTokenizer, ChatTurn, TurnOptions
from ._chat_model import ChatModel
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
from ._encoder import (
    EncoderModel,
    SentenceEncoder,
    SentenceEncoderConfig,
    SentenceTokenizer,
    TokenizerModel,
    packaged_checkpoint,
)
from ._generate import SEQUENCE_BUSY, ExitReason, StepLoop, StepOutput, Stream
from ._gpt2 import GPT2, GPT2Config, GPT2Layer, KVCache, load_gpt2
from ._gpt2 import forward as gpt2_forward
from ._model import RunningStatsModel
from ._state import BatchPlan, NumpyMoments, Refusal, RunningMoments, SequenceSlots

__all__ = [
    "FLAG_END",
    "FLAG_START",
    "SEQUENCE_BUSY",
    "Accelerators",
    "BERT",
    "BatchPlan",
    "BertConfig",
    "ChatEngine",
    "ChatMessage",
    "ChatModel",
    "ChatResponse",
    "ChatTokenizer",
    "ChatTurn",
    "DeviceChoice",
    "EncoderModel",
    "ExitReason",
    "GPT2",
    "GPT2Config",
    "GPT2Layer",
    "KVCache",
    "NumpyMoments",
    "Refusal",
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
    "gpt2_forward",
    "instance_index",
    "load_bert",
    "load_gpt2",
    "model_parameter",
    "packaged_checkpoint",
    "parse_device_ids",
    "parse_model_config",
    "probe_accelerators",
    "read_controls",
    "sentence_embeddings",
    "to_host",
]
