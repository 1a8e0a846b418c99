"""OpenTelemetry traces: the spans of requests, sequence steps and chat turns, the trace context reaching Triton (whose
own spans join the client's trace), and nothing imported when opentelemetry is absent.

Spans are read from the SDK's in-memory exporter on a provider given to ``_trace.use_tracer_provider`` (the global
provider is never set). Triton's side is read from a Triton started with ``--trace-config mode=opentelemetry``
that exports OTLP/JSON to a small HTTP collector this module runs on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, cast

import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from triton_npu_client import Client, LocalTriton, RequestTimeout, SequenceLost
from triton_npu_client import _trace as trace_module


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """This package's spans, recorded in memory for one test."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_module.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        trace_module.use_tracer_provider(None)
        provider.shutdown()


@pytest.fixture
async def client(triton_server: LocalTriton) -> AsyncIterator[Client]:
    async with Client(triton_server.grpc_url, timeout_s=60) as c:
        yield c


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


# --- spans, against the session's server ------------------------------------------------------------


async def test_a_stateless_request_has_one_span_with_model_outcome_and_ttfr(
    client: Client, spans: InMemorySpanExporter
) -> None:
    scale = await client.model("scale_fp32")
    await scale.infer(INPUT0=np.arange(4, dtype=np.float32))
    (span,) = named(spans, "triton.infer")
    a = attrs(span)
    assert a["triton.model"] == "scale_fp32"
    assert a["triton.outcome"] == "ok"
    assert a["triton.ttfr_ms"] > 0
    assert span.status.status_code is StatusCode.UNSET


async def test_a_refused_request_has_outcome_the_error_class_and_status_error(
    client: Client, spans: InMemorySpanExporter
) -> None:
    """A 1 µs timeout cannot be met: the request fails, and its span says how."""
    scale = await client.model("scale_fp32")
    with pytest.raises(RequestTimeout):
        await scale.infer(INPUT0=np.arange(4, dtype=np.float32), timeout_s=1e-6)
    (span,) = named(spans, "triton.infer")
    assert attrs(span)["triton.outcome"] == "RequestTimeout"
    assert span.status.status_code is StatusCode.ERROR
    assert "triton.ttfr_ms" not in attrs(span)


async def test_sequence_steps_share_the_sequence_id_and_a_failing_step_is_an_error(
    client: Client, spans: InMemorySpanExporter
) -> None:
    stats = await client.model("seq_stats_oldest")
    x = np.array([1, 2, 3, 4], np.float32)
    async with stats.sequence() as seq:
        await seq.infer(X=x)
        await seq.infer(X=x)
        with pytest.raises((RequestTimeout, SequenceLost)) as timed_out:
            await seq.infer(X=x, timeout_s=1e-6)  # past its deadline before it leaves: outcome unknown
        with pytest.raises(SequenceLost):
            await seq.infer(X=x)
    steps = named(spans, "triton.sequence.step")
    assert len(steps) == 4
    assert {attrs(s)["triton.sequence_id"] for s in steps} == {str(seq.sequence_id)}
    assert {attrs(s)["triton.model"] for s in steps} == {"seq_stats_oldest"}
    outcomes = [attrs(s)["triton.outcome"] for s in steps]
    assert outcomes == ["ok", "ok", type(timed_out.value).__name__, "SequenceLost"]
    assert [s.status.status_code for s in steps] == [StatusCode.UNSET] * 2 + [StatusCode.ERROR] * 2
    assert all(attrs(s)["triton.ttfr_ms"] > 0 for s in steps[:2])


async def test_a_streamed_step_records_its_first_response_and_a_cut_one_is_cancelled(
    client: Client, spans: InMemorySpanExporter
) -> None:
    counter = await client.model("seq_count_stream")
    async with counter.sequence() as seq:
        values = [int(r["VALUE"][0, 0]) async for r in seq.stream(N=np.array([3], np.int32))]
        # Leaving the loop early inside aclosing cancels the step on the server at once.
        stream = seq.stream(N=np.array([50], np.int32), DELAY_MS=np.array([20], np.int32))
        async with contextlib.aclosing(cast(AsyncGenerator[Any, None], stream)) as cut_short:
            async for _ in cut_short:
                break
    assert values == [1, 2, 3]
    whole, cut = named(spans, "triton.sequence.step")
    assert attrs(whole)["triton.outcome"] == "ok"
    assert attrs(whole)["triton.ttfr_ms"] > 0
    assert attrs(cut)["triton.outcome"] == "cancelled"
    assert "triton.ttfr_ms" in attrs(cut)
    assert cut.status.status_code is StatusCode.UNSET


async def test_a_chat_turn_has_a_span_with_ttfr_tokens_and_its_step_under_it(
    client: Client, spans: InMemorySpanExporter
) -> None:
    async with client.chat("chat", max_tokens=4) as chat:
        reply = await chat.ask("Hello there.")
    (turn,) = named(spans, "triton.chat.turn")
    (step,) = named(spans, "triton.sequence.step")
    a = attrs(turn)
    assert a["triton.model"] == "chat"
    assert a["triton.outcome"] == "ok"
    assert a["triton.sequence_id"] == str(chat.sequence_id)
    assert a["triton.chat.tokens"] == reply.tokens > 0
    assert a["triton.chat.replayed"] is False
    assert a["triton.ttfr_ms"] > 0
    assert turn.context is not None
    assert step.parent is not None
    assert step.parent.span_id == turn.context.span_id
    assert attrs(step)["triton.sequence_id"] == str(chat.sequence_id)


async def test_note_replica_marks_the_current_span_and_the_chat_turn_above_a_step(
    spans: InMemorySpanExporter,
) -> None:
    trace_module.note_replica("grpc://nobody:1")  # no span of ours current: nothing, no error
    turn = trace_module.start("triton.chat.turn", model="m")
    assert turn is not None
    step = trace_module.start("triton.sequence.step", model="m", sequence_id=7, parent=turn)
    assert step is not None
    token = step.attach()
    try:
        trace_module.note_replica("grpc://10.0.0.2:8001")
    finally:
        step.detach(token)
    trace_module.note_replica("grpc://nobody:2")  # detached: nothing current again
    step.finish()
    turn.finish()
    got = {s.name: attrs(s).get("triton.replica") for s in spans.get_finished_spans()}
    assert got == {"triton.sequence.step": "grpc://10.0.0.2:8001", "triton.chat.turn": "grpc://10.0.0.2:8001"}


async def test_a_fleets_replica_is_on_the_spans_of_requests_steps_and_turns(
    triton_server: LocalTriton, spans: InMemorySpanExporter
) -> None:
    """The fleet notes the replica it picks on the current span: a request's, a step's (unary and streamed) and,
    through the step, the chat turn's."""
    async def resolve(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]  # a headless Service of one pod: the session's server

    url = f"dns+grpc://triton.test:{triton_server.grpc_port}"
    async with Client(url, timeout_s=60, resolver=resolve) as client:
        (replica,) = await client.replicas()
        scale = await client.model("scale_fp32")
        await scale.infer(INPUT0=np.arange(4, dtype=np.float32))
        stats = await client.model("seq_stats_oldest")
        async with stats.sequence() as seq:
            await seq.infer(X=np.arange(4, dtype=np.float32))
        counter = await client.model("seq_count_stream")
        async with counter.sequence() as seq:
            assert [r async for r in seq.stream(N=np.array([2], np.int32))]
        async with client.chat("chat", max_tokens=2) as chat:
            await chat.ask("Hi.")
    got = [(s.name, attrs(s).get("triton.replica")) for s in spans.get_finished_spans()]
    assert sorted(got) == sorted(
        [("triton.infer", replica.url)]
        + [("triton.sequence.step", replica.url)] * 3
        + [("triton.chat.turn", replica.url)]
    )


# --- Triton's own spans join the client's trace ---------------------------------------------------------


class Collector:
    """An OTLP/HTTP (JSON) receiver on loopback: every span Triton exports."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                found = [
                    span
                    for resource in json.loads(body).get("resourceSpans", ())
                    for scope in resource.get("scopeSpans", ())
                    for span in scope.get("spans", ())
                ]
                with outer._changed:
                    outer.spans.extend(found)
                    outer._changed.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def wait_for(self, match: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
        """The first exported span that ``match`` accepts, once it has arrived (AssertionError after ``timeout_s``)."""
        with self._changed:
            got = self._changed.wait_for(lambda: next((s for s in self.spans if match(s)), None), timeout_s)
        assert got is not None, f"no matching span from Triton within {timeout_s} s; it sent {self.spans}"
        return got

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def traced_server() -> Iterator[tuple[LocalTriton, Collector]]:
    """A Triton that traces (OpenTelemetry mode) only the requests that bring a trace context (rate=0)."""
    collector = Collector()
    args = [
        "--trace-config", "mode=opentelemetry",
        "--trace-config", "rate=0",
        "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "count=-1",
        "--trace-config", f"opentelemetry,url={collector.url}",
        "--trace-config", "opentelemetry,bsp_schedule_delay=50",
    ]  # fmt: skip
    server = LocalTriton(
        model_control_mode="explicit", load_models=["scale_fp32", "seq_count_stream"], extra_args=args,
        stop_grace_s=0,
    )  # fmt: skip
    try:
        with server:
            yield server, collector
    finally:
        collector.close()


def _hex(value: int, digits: int) -> str:
    return f"{value:0{digits}x}"


def _joins(span: ReadableSpan) -> Callable[[dict[str, Any]], bool]:
    """Whether a Triton span is a child of ``span``: same trace, ``span`` its parent."""
    assert span.context is not None
    trace_id, span_id = _hex(span.context.trace_id, 32), _hex(span.context.span_id, 16)
    return lambda s: s.get("traceId") == trace_id and s.get("parentSpanId") == span_id


async def _joined(collector: Collector, attempt: Callable[[], Awaitable[ReadableSpan]]) -> dict[str, Any]:
    """Triton's span that sits exactly under the client span of one of up to three attempts.

    Triton's OTLP export is best effort: beside two busy loops its batch exporter once delivered nothing at all
    for a request within 30 s. Each attempt is a new request with a span of its own, and only a Triton span whose
    parent is that very span counts.
    """
    failed: AssertionError | None = None
    for _ in range(3):
        span = await attempt()
        try:
            return await asyncio.to_thread(collector.wait_for, _joins(span), 15.0)
        except AssertionError as err:
            failed = err
    assert failed is not None
    raise failed


@pytest.mark.parametrize("protocol", ["grpc", "http"])
async def test_tritons_span_of_a_request_is_a_child_of_the_clients_span(
    traced_server: tuple[LocalTriton, Collector], spans: InMemorySpanExporter, protocol: str
) -> None:
    server, collector = traced_server
    url = server.grpc_url if protocol == "grpc" else server.http_url
    async with Client(url, timeout_s=60, coalescing=None) as client:
        scale = await client.model("scale_fp32")

        async def attempt() -> ReadableSpan:
            await scale.infer(INPUT0=np.arange(4, dtype=np.float32))
            return named(spans, "triton.infer")[-1]

        theirs = await _joined(collector, attempt)
    assert theirs["name"] == "InferRequest"  # Triton's top span of a request; its model span hangs under it


async def test_tritons_span_of_a_streamed_sequence_step_is_a_child_of_the_step(
    traced_server: tuple[LocalTriton, Collector], spans: InMemorySpanExporter
) -> None:
    """A decoupled model's stream step takes a gRPC call of its own, whose metadata carries the step's context."""
    server, collector = traced_server
    async with Client(server.grpc_url, timeout_s=60) as client:
        counter = await client.model("seq_count_stream")

        async def attempt() -> ReadableSpan:
            async with counter.sequence() as seq:
                values = [int(r["VALUE"][0, 0]) async for r in seq.stream(N=np.array([2], np.int32))]
            assert values == [1, 2]
            return [s for s in named(spans, "triton.sequence.step") if not attrs(s).get("triton.sequence.end")][-1]

        # Waited for with the connection still open: a client that closed the channel before the server had ended
        # the step's call would cancel that end.
        theirs = await _joined(collector, attempt)
    assert theirs["name"] == "InferRequest"


# --- nothing when opentelemetry is absent ------------------------------------------------------------------

# Run in a fresh interpreter: every finder answers "not found" for opentelemetry (as when it is not installed)
# and notes each *import* of it (importlib.util.find_spec's probe is not one).
_ABSENT = textwrap.dedent(
    """
    import asyncio, sys

    attempts = []

    class Hide:
        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                # Called by importlib's _find_spec, itself called by an import or by importlib.util.find_spec.
                if sys._getframe(2).f_code.co_name == "_find_and_load_unlocked":
                    attempts.append(name)
                return None
            return self.inner.find_spec(name, path, target)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]

    import numpy as np
    import triton_npu_client
    from triton_npu_client import Client, _trace

    async def main():
        async with Client(sys.argv[1]) as client:
            scale = await client.model("scale_fp32")
            await scale.infer(INPUT0=np.arange(4, dtype=np.float32))
            stats = await client.model("seq_stats_oldest")
            async with stats.sequence() as seq:
                await seq.infer(X=np.arange(4, dtype=np.float32))
            counter = await client.model("seq_count_stream")
            async with counter.sequence() as seq:
                assert [r async for r in seq.stream(N=np.array([2], np.int32))]
        _trace.note_replica("grpc://x:1")

    asyncio.run(main())
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    print("RESULT", _trace.AVAILABLE, loaded, sorted(set(attempts)))
    """
)


def test_without_opentelemetry_nothing_is_imported_and_requests_work(triton_server: LocalTriton) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _ABSENT, triton_server.grpc_url], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "RESULT False [] []"


def test_the_same_check_sees_an_import_when_there_is_one(triton_server: LocalTriton) -> None:
    """The check above can fail: the same script, after an ``import opentelemetry`` of its own, reports it."""
    script = _ABSENT.replace("import numpy as np\n", "import numpy as np\ntry:\n    import opentelemetry.trace\n"
                             "except ImportError:\n    pass\n", 1)
    out = subprocess.run(
        [sys.executable, "-c", script, triton_server.grpc_url], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "RESULT False [] ['opentelemetry']"
