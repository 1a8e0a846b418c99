"""Calls: what every request goes through above the transport (defaults, retries, client-side batching)."""

from ._coalesce import Coalescer, Coalescing
from ._defaults import USE_CLIENT_DEFAULT, UseClientDefault
from ._retry import NO_RETRY, RetryPolicy, is_retriable, run_with_retry

__all__ = [
    "NO_RETRY",
    "USE_CLIENT_DEFAULT",
    "Coalescer",
    "Coalescing",
    "RetryPolicy",
    "UseClientDefault",
    "is_retriable",
    "run_with_retry",
]
