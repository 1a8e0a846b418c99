"""``triton-npu fleet``: one line per replica behind ``--url``: health, models READY, load, last error.

``--url`` takes the client's forms: one URL, several (repeat the flag or a comma-separated list), or
``dns+grpc://NAME:PORT`` (every address record of NAME is a replica: a Kubernetes headless Service). Every replica is
checked now (server ready, then the models READY in its repository). The load figures are the server's own, so they
cover every client: inferences answered and failed since each model loaded (Triton's statistics, summed over the
models; an ensemble and its steps each count) and their average queue + compute time; with ``--metrics-port``, the
requests pending there now (queued or executing, from Prometheus). A client's own view (requests it has in flight
per replica, its latency percentiles) lives in the process that sends the traffic: ``await client.replicas()``.

Exit status: 0 when every replica is ready, 1 when one is not (or the name has no replica), 2 for a usage mistake
(a malformed URL, gRPC and HTTP URLs mixed), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from ._urls import URL_HELP, add_url_argument, checked_urls

if TYPE_CHECKING:
    from .._client import ModelStatistics
    from .._errors import TritonError
    from .._fleet import ReplicaStatus

__all__ = ["add_arguments", "render", "run"]

EXIT_ALL_READY = 0
EXIT_NOT_ALL_READY = 1

# Requests queued or executing now, per model (Triton >= 2.38 exports it by default).
_PENDING = re.compile(r"^nv_inference_pending_request_count(?:\{[^}]*\})?\s+(\S+)\s*$", re.M)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, given {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, given {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, given {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, given {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_url_argument(p, required=True, help=URL_HELP)
    p.add_argument("--models", action="store_true", help="also list each replica's READY models")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="each replica's Prometheus port (Triton's default 8002): adds the requests pending now")
    p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds for each replica to answer (default 5)")
    p.epilog = "exit status: 0 every replica ready, 1 a replica not ready (or none found), 2 usage error"


def _pending(text: str) -> int:
    return sum(int(float(v)) for v in _PENDING.findall(text))


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render(
    statuses: Sequence[ReplicaStatus],
    stats: Mapping[str, tuple[ModelStatistics, ...] | TritonError],
    metrics: Mapping[str, str | TritonError] | None,
    *,
    show_models: bool,
) -> list[str]:
    """The printed lines: a header and one line per replica (plus its models with ``show_models``)."""
    rows: list[list[str]] = [["REPLICA", "HEALTH", "READY", "PENDING", "OK", "FAILED", "AVG MS", "LAST ERROR"]]
    extra: dict[int, str] = {}
    for status in statuses:
        health = {True: "ready", False: "DOWN", None: "unchecked"}[status.healthy]
        ok = failed = avg = pending = "-"
        answer = stats.get(status.url)
        if status.healthy and isinstance(answer, tuple):
            n_ok = sum(s.success_count for s in answer)
            ok, failed = f"{n_ok:,}", f"{sum(s.fail_count for s in answer):,}"
            ns = sum(s.queue_ns + s.compute_infer_ns for s in answer)
            avg = f"{ns / n_ok / 1e6:.2f}" if n_ok else "-"
        if metrics is not None and status.healthy:
            # Only for a ready replica: the metrics port is asked on the replica's host, where a down gRPC
            # endpoint may sit beside another server's metrics.
            text = metrics.get(status.url)
            pending = str(_pending(text)) if isinstance(text, str) else "?"
        error = status.last_error if not status.healthy else None
        rows.append([status.url, health, str(len(status.models)), pending, ok, failed, avg, error or "-"])
        if show_models:
            extra[len(rows) - 1] = "    models: " + (", ".join(status.models) or "(none)")
    lines = _table(rows)
    out: list[str] = []
    for i, line in enumerate(lines):
        out.append(line)
        if i in extra:
            out.append(extra[i])
    return out


class _Notes(logging.Handler):
    """The fleet's "resolving NAME failed" lines, each once, for stderr: the table shows why a replica is down,
    not why a ``dns+`` name stood for none. The other log lines would repeat the table."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: dict[str, None] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("resolving"):
            self.lines[record.getMessage()] = None


async def _main(ns: argparse.Namespace, urls: tuple[str, ...], out: TextIO) -> int:
    notes = _Notes()
    log = logging.getLogger("triton_npu_client.fleet")
    log.addHandler(notes)
    try:
        return await _report(ns, urls, out)
    finally:
        log.removeHandler(notes)
        for line in notes.lines:
            print(f"triton-npu fleet: {line}", file=sys.stderr)


async def _report(ns: argparse.Namespace, urls: tuple[str, ...], out: TextIO) -> int:
    from .._client import Client
    from .._fleet import FleetOptions

    fleet = FleetOptions(health_timeout_s=ns.timeout)
    async with Client(urls, timeout_s=ns.timeout, fleet=fleet) as client:
        statuses = await client.replicas(refresh=True)
        if not statuses:
            print(f"triton-npu fleet: no replica found for {', '.join(urls)} (a name without address records?)",
                  file=sys.stderr)  # fmt: skip
            return EXIT_NOT_ALL_READY
        stats = await client.replica_statistics("")
        metrics = None if ns.metrics_port is None else await client.replica_metrics(port=ns.metrics_port)
    for line in render(statuses, stats, metrics, show_models=ns.models):
        print(line, file=out)
    return EXIT_ALL_READY if all(s.healthy for s in statuses) else EXIT_NOT_ALL_READY


def run(ns: argparse.Namespace) -> int:
    """``triton-npu fleet``: see the module docstring."""
    # A usage mistake raises UsageError here: one line and exit 2 (cli.main), before any connection.
    urls = checked_urls(ns.url)
    assert urls is not None  # --url is required
    return asyncio.run(_main(ns, urls, sys.stdout))
