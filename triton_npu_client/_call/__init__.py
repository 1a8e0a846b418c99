"""Calls: what every request goes through above the transport (defaults, retries, client-side batching).

The one door below the sessions and the client: what they need of the transport layer (the :class:`Caller` and
the call's types) is re-exported here, so nothing above reaches past this layer.
"""

from .._transport import OnSend, Responses, Route
from ._caller import Caller
from ._coalesce import Coalescer, Coalescing
from ._defaults import USE_CLIENT_DEFAULT, UseClientDefault
from ._retry import NO_RETRY, RetryPolicy, is_retriable, run_with_retry

__all__ = [
    "NO_RETRY",
    "USE_CLIENT_DEFAULT",
    "Caller",
    "Coalescer",
    "Coalescing",
    "OnSend",
    "Responses",
    "RetryPolicy",
    "Route",
    "UseClientDefault",
    "is_retriable",
    "run_with_retry",
]
