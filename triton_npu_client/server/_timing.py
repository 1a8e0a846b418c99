"""An opt-in timing trace of a step loop: where each request's time goes, and what each pass cost.

Off unless the stub's environment sets ``TNC_STEP_TRACE`` to a file path (``LocalTriton(env={...})`` passes it to
the stubs): then every instance that builds a :class:`StepTrace` appends JSON lines to that file, and nothing is
traced otherwise (the loop tests one attribute for None). For the benchmarks (``bench/chat_ttft.py``,
``bench/chat_stub.py``), never for production: it takes a lock per mark.

Two kinds of line, each with the instance's name and pid:

- ``{"kind": "request", "key": ..., "serial": n, "execute": t, "parsed": t, "submitted": t, "taken": t,
  "admit_start": t, "admit_end": t, "step_end": t, "queued": t, "send_start": t, "send_end": t, "final_end": t}``:
  one per request, written once its FINAL response has been sent. ``serial`` counts the instance's requests.
  Each mark is the first time that point was reached for that request (``send_start`` / ``send_end``: its first
  response), on ``time.monotonic()``, which is CLOCK_MONOTONIC on Linux: one clock for every process of the
  machine, so a client on the same machine can put its own send and receipt times beside these.
- ``{"kind": "pass", "start": t, "end": t, "cpu_s": s, "admitted": n, "stepped": n, "running": n}``: one per
  pass of the loop that did anything, ``cpu_s`` the loop thread's CPU time in that pass (``time.thread_time``).
  Buffered, and written when the loop has nothing running (so not between two passes of one batch).

Which stage each gap is: ``execute`` (Triton called the model) to ``parsed`` is parsing the request and rendering
the conversation's template; ``submitted`` to ``taken`` waiting for the loop to start its next pass; ``taken`` to
``admit_start`` the cancellation check of new requests; ``admit_start`` to ``admit_end`` admission and prefill
(all the pass's new requests together); ``admit_end`` to ``step_end`` the first step (sampling the first token,
then the next token's decode forward of the whole batch); ``queued`` to ``send_end`` the response sender's round
trip to Triton's process (after whatever the send thread had queued before it).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["TRACE_ENV", "StepTrace"]

#: The environment variable that turns the trace on: the file to append JSON lines to.
TRACE_ENV = "TNC_STEP_TRACE"


class StepTrace:
    """Marks per request (keyed by its response sender) and per pass, appended as JSON lines to ``path``."""

    def __init__(self, path: str, *, instance: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.instance = instance
        self.clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, dict[str, Any]] = {}
        self._passes: list[str] = []
        self._serial = itertools.count(1)
        self._pid = os.getpid()

    @classmethod
    def from_env(cls, instance: str) -> StepTrace | None:
        """A trace writing to ``$TNC_STEP_TRACE``; None (no tracing) when it is unset or empty."""
        path = os.environ.get(TRACE_ENV, "")
        return cls(path, instance=instance) if path else None

    def request(self, sender: Any, key: object, **marks: float) -> None:
        """Open the record of the request answered through ``sender`` (its sequence ``key``, marks known so far)."""
        record: dict[str, Any] = {"kind": "request", "instance": self.instance, "pid": self._pid, "key": key}
        record.update(marks)
        with self._lock:
            record["serial"] = next(self._serial)
            self._open[id(sender)] = record

    def mark(self, sender: Any, name: str, when: float | None = None) -> None:
        """Record ``name`` for ``sender``'s request, unless it was reached before (the first time counts)."""
        now = self.clock() if when is None else when
        with self._lock:
            record = self._open.get(id(sender))
            if record is not None and name not in record:
                record[name] = now

    def finish(self, sender: Any) -> None:
        """``sender``'s FINAL went out: mark it, write its record and forget it."""
        now = self.clock()
        with self._lock:
            record = self._open.pop(id(sender), None)
        if record is None:
            return
        record.setdefault("final_end", now)
        self._write([json.dumps(record, default=str)])

    def pass_done(self, *, start: float, end: float, cpu_s: float, admitted: int, stepped: int, running: int) -> None:
        line = {
            "kind": "pass", "instance": self.instance, "pid": self._pid, "start": start, "end": end, "cpu_s": cpu_s,
            "admitted": admitted, "stepped": stepped, "running": running,
        }  # fmt: skip
        self._passes.append(json.dumps(line))

    def flush_passes(self) -> None:
        """Write the buffered pass lines (the loop calls it when nothing is running)."""
        lines, self._passes = self._passes, []
        if lines:
            self._write(lines)

    def _write(self, lines: list[str]) -> None:
        # One write per call on an O_APPEND descriptor: lines of several threads and instances never interleave.
        data = ("\n".join(lines) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
