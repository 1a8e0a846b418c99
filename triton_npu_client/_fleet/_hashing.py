"""Rendezvous (highest random weight) hashing: which replica holds a sequence, agreed without talking.

Every client process that sees the same replicas picks the same one for a sequence id, whatever order it was
given them in, and a replica that joins or leaves moves only the sequences whose top choice it is (about 1/n of
them). The score is a BLAKE2b of the replica's key and the sequence's identity: stable across processes,
Python versions and machines (``hash()`` is salted per process, so it would not do).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TypeVar

__all__ = ["rendezvous", "sequence_key"]

T = TypeVar("T")


def sequence_key(model: str, sequence_id: int | str) -> bytes:
    """The identity a sequence is hashed by: its model and its id (an int and its decimal string differ)."""
    kind = "i" if isinstance(sequence_id, int) else "s"
    return f"{model}\x00{kind}:{sequence_id}".encode()


def _score(replica_key: str, key: bytes) -> int:
    name = replica_key.encode()
    # Length-prefixed, so no two (replica, sequence) pairs hash the same bytes.
    digest = hashlib.blake2b(len(name).to_bytes(4, "big") + name + key, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: bytes, replicas: Iterable[tuple[str, T]]) -> T | None:
    """The replica whose ``(replica_key, value)`` pair scores highest for ``key``; None when there is none.

    Ties (astronomically unlikely with 64-bit scores) go to the smaller replica key, so the choice never depends
    on the order given.
    """
    best: tuple[int, str] | None = None
    chosen: T | None = None
    for name, value in replicas:
        rank = (_score(name, key), name)
        if best is None or rank[0] > best[0] or (rank[0] == best[0] and rank[1] < best[1]):
            best, chosen = rank, value
    return chosen
