"""Seams around the real transport for tests: they watch what goes to the server, and fake nothing."""

from __future__ import annotations

from typing import Any

from triton_npu_client import Call
from triton_npu_client._transport import Transport


class CountingTransport:
    """The real transport, with a count of inference calls (a seam, not a fake: every call goes to the server)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.infer_calls = 0

    def call(self, call: Call) -> Any:
        self.infer_calls += 1
        return self.inner.call(call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
