"""A real tritonserver on this machine: find the binary, prepare the backends, start, wait, stop."""

from ._server import LocalTriton, default_model_repository, find_tritonserver

__all__ = ["LocalTriton", "default_model_repository", "find_tritonserver"]
