"""Calls: what every request goes through above the transport (defaults, the retry loop, client-side batching).

The one door below the sessions and the client: what they need of the transport layer (the :class:`Caller` and
the call's types) is re-exported here, so nothing above reaches past this layer.
"""

from .._transport import (
    NO_RETRY,
    Call,
    OnSend,
    Responses,
    Retry,
    RetryPolicy,
    Route,
    is_retriable,
    run_with_retry,
)
from ._caller import Caller
from ._coalesce import Coalescer, Coalescing
from ._defaults import USE_CLIENT_DEFAULT, UseClientDefault

__all__ = [
    "NO_RETRY",
    "USE_CLIENT_DEFAULT",
    "Call",
    "Caller",
    "Coalescer",
    "Coalescing",
    "OnSend",
    "Responses",
    "Retry",
    "RetryPolicy",
    "Route",
    "UseClientDefault",
    "is_retriable",
    "run_with_retry",
]
