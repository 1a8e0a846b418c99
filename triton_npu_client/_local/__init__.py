"""A real tritonserver on this machine: find the binary, prepare the backends, start, wait, stop; and a chat model
repository entry generated from a checkpoint folder."""

from ._checkpoint import (
    CHAT_CPU_THREADS_AUTO,
    CHAT_DEVICES,
    CHAT_DTYPES,
    CHAT_MODEL_TYPES,
    ChatCheckpoint,
    chat_model_config,
    chat_model_name,
    chat_model_repository,
    read_chat_checkpoint,
    write_chat_model,
)
from ._server import LocalTriton, ModelLoad, default_model_repository, find_tritonserver

__all__ = [
    "CHAT_CPU_THREADS_AUTO",
    "CHAT_DEVICES",
    "CHAT_DTYPES",
    "CHAT_MODEL_TYPES",
    "ChatCheckpoint",
    "LocalTriton",
    "ModelLoad",
    "chat_model_config",
    "chat_model_name",
    "chat_model_repository",
    "default_model_repository",
    "find_tritonserver",
    "read_chat_checkpoint",
    "write_chat_model",
]
