"""The client: URL -> transport, lifecycle, admin calls, and model handles."""

from ._client import Client, ClientConfig, ModelStatistics, RepositoryModel, ServerMetadata
from ._model import Model
from ._shm import SharedMemoryPool, SharedMemoryStats

__all__ = [
    "Client", "ClientConfig", "Model", "ModelStatistics", "RepositoryModel", "ServerMetadata", "SharedMemoryPool",
    "SharedMemoryStats",
]
