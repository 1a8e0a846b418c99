"""The OpenAI HTTP API in front of the fleet: Chat Completions, Embeddings, Responses (with ``previous_response_id``
continuing the conversation whose KV cache is on the server) and Conversations, as an ASGI app on this SDK's
``Client``. ``triton-npu openai`` serves it; docs/openai.md says what maps to what. Needs the ``openai`` extra
(starlette, uvicorn, prometheus-client)."""

from ._app import GatewayOptions, create_app
from ._schema import Limits
from ._serve import OpenAIGateway
from ._store import MemoryStore, ResponseStore, SQLiteStore, StoredConversation, StoredResponse, default_store_path

__all__ = [
    "GatewayOptions",
    "Limits",
    "MemoryStore",
    "OpenAIGateway",
    "ResponseStore",
    "SQLiteStore",
    "StoredConversation",
    "StoredResponse",
    "create_app",
    "default_store_path",
]
