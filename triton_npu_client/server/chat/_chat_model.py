"""The chat model inside Triton's Python stub: reads requests, hands turns to a StepLoop running a ChatEngine.

``server_models/chat`` (sequence batching: the conversation lives on the server) and
``server_models/chat_stateless`` (no sequence batching: each request carries a whole conversation, the
baseline a stateless server gives) are both this class. ``execute`` only parses each request into a turn
and hands its response sender to the loop; everything else runs on the loop's thread (see ``_chat``).

Config ``parameters`` read: ``checkpoint`` (a Hugging Face folder: config.json, weights, tokenizer.json,
tokenizer_config.json with its chat template; relative to the model's folder or absolute; default ``demo_gpt2``;
the decoder is chosen by config.json's ``model_type``: gpt2, llama, qwen2, mistral), ``dtype`` (``auto``:
float32 on a CPU instance, the checkpoint's own on an accelerator; or float32, float16, bfloat16), ``max_ctx``
(positions per conversation; default the model's), ``max_sequences`` (live conversations), ``max_cache_mb`` (the
paged KV cache's memory: blocks of ``kv_block_size`` positions, default 16), ``share_prefixes`` (equal prefixes
computed once and shared; default true with sequence batching, false for the stateless twin),
``default_max_tokens``, ``device`` / ``device_ids`` (see ``_device``), ``cpu_threads`` (torch threads on a CPU
instance: a number, or ``auto``, the default: one fewer than the cores the stub may run on, shared among the model's
CPU instances), ``keep_freed_memory`` (default true: glibc keeps freed blocks for reuse, see
``_device.keep_freed_memory``),
``overlap_sends`` (default true: responses leave while the next pass computes), ``sweep_grace_us``,
``stream_interval_ms`` (0: a response per token; above, a turn's pieces in mid-reply are merged into at most one
response per interval), ``evict_min_idle_ms`` (at the cap of conversations, or
when the KV cache has no free block, the conversation idle longest gives way if it has idled at least this long;
default 60000; negative: never evict), and the input caps of :class:`~._chat.InputLimits`:
``max_messages`` (512), ``max_message_bytes`` (65536), ``max_request_bytes`` (262144), ``max_stops`` (16),
``max_stop_bytes`` (256), ``max_constraint_bytes`` (65536: the CONSTRAINT input), ``max_tools_bytes`` (65536: the
TOOLS input), ``constraint_cache`` (64:
distinct constraints kept compiled, least recently used dropped first), ``compile_decode`` (``off``, ``cpu`` or
``cuda-graphs``: the decode pass compiled as one
graph per batch bucket, see docs/chat.md).

Every refusal of a request's own input (a bad option, an input over a cap, a malformed turn) begins with the
``INVALID_INPUT`` marker and is sent with ``INVALID_ARG``; it is found in ``execute`` (or in admission, for a turn
that cannot fit the context), never by failing a decode step. A turn for a conversation that is already
streaming one supersedes it: the old turn is stopped and rolled back (an END-only close included), see
``_generate``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..._protocol import INVALID_INPUT
from ..._protocol import chat as proto
from .._config import SequenceBatching, model_parameter, parse_model_config
from .._controls import CorrelationId, read_controls
from .._device import (
    Accelerators,
    accelerator_possible,
    activate,
    choose_instance_device,
    cpu_instances,
    cpu_thread_count,
    keep_freed_memory,
    parse_device_ids,
    probe_accelerators,
)
from .._generate import StepLoop
from .._state import SequenceSlots
from .._timing import StepTrace
from ._blocks import PagedKVCache
from ._chat import ChatEngine, ChatResponse, InputLimits, RefusalKind
from ._decoders import load_decoder
from ._runner import Compile
from ._template import CheckpointTokenizer

__all__ = ["ChatModel"]

_log = logging.getLogger("triton_npu_client.server")


class ChatModel:
    """A chat model instance; ``pb`` is ``triton_python_backend_utils``. See the module docstring."""

    def __init__(self, args: Mapping[str, str], pb: Any) -> None:
        self._pb = pb
        self._final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        config = parse_model_config(args["model_config"])
        self._batching = SequenceBatching.from_model_config(config) if config.get("sequence_batching") else None
        # INPUT_TOKENS came later than the other counts: a config written before it does not declare it, and a
        # response may carry only the outputs its config declares.
        self._input_tokens = any(o.get("name") == "INPUT_TOKENS" for o in config.get("output") or [])
        self._logprobs = any(o.get("name") == proto.LOGPROBS for o in config.get("output") or [])
        self._tool_calls = any(o.get("name") == proto.TOOL_CALLS for o in config.get("output") or [])

        def param(key: str, default: str) -> str:
            return model_parameter(config, key) or default

        force = model_parameter(config, "device")
        host_only = (force or "").strip().lower() == "cpu" or not accelerator_possible()
        choice = choose_instance_device(
            args,
            available=Accelerators() if host_only else probe_accelerators(),
            device_ids=parse_device_ids(model_parameter(config, "device_ids")),
            force=force,
        )
        # "auto" (what a generated entry says): one fewer than the cores this stub may run on, shared among the
        # model's CPU instances (see _device.cpu_thread_count and docs/chat.md, "Threads").
        threads = cpu_thread_count(param("cpu_threads", "auto"), instances=cpu_instances(config))
        if _flag(param("keep_freed_memory", "true")):
            # Before the model loads: the decode passes' temporaries stay in the heap instead of being unmapped and
            # faulted in again every pass (see _device.keep_freed_memory).
            keep_freed_memory()
        device = activate(choice, cpu_threads=threads)
        checkpoint = Path(args["model_repository"]) / param("checkpoint", "demo_gpt2")
        model = load_decoder(checkpoint, device=device, dtype=_dtype(param("dtype", "auto"), checkpoint, device))
        tokenizer = CheckpointTokenizer(checkpoint)

        max_ctx = int(param("max_ctx", str(model.max_positions)))
        max_sequences = int(param("max_sequences", "64"))
        max_cache_mb = float(param("max_cache_mb", "1024"))
        block_size = int(param("kv_block_size", "16"))
        block_bytes = PagedKVCache.bytes_per_block(model, block_size)
        num_blocks = int(max_cache_mb * 2**20 // block_bytes)
        if num_blocks < -(-max_ctx // block_size):
            raise ValueError(
                f"max_cache_mb={max_cache_mb:g} holds {num_blocks} blocks of {block_size} positions "
                f"({block_bytes / 2**20:.2f} MiB each), fewer than one conversation of max_ctx {max_ctx} needs"
            )
        capacity = max_sequences
        note = f"parameter max_sequences={max_sequences}"
        # Stateless: every request starts and ends its conversation, so nothing ever idles.
        idle_s = self._batching.idle_timeout_s if self._batching else 3600.0
        grace_us = int(param("sweep_grace_us", "500000"))
        evict_ms = float(param("evict_min_idle_ms", "60000"))
        slots = SequenceSlots(
            capacity=capacity,
            idle_timeout_s=idle_s,
            grace_s=grace_us / 1e6,
            capacity_note=note,
            # Stateless: every conversation is generating while it holds a slot; there is never one to evict.
            evict_min_idle_s=evict_ms / 1000 if evict_ms >= 0 and self._batching is not None else None,
        )
        default = InputLimits()
        limits = InputLimits(
            max_messages=int(param("max_messages", str(default.max_messages))),
            max_message_bytes=int(param("max_message_bytes", str(default.max_message_bytes))),
            max_request_bytes=int(param("max_request_bytes", str(default.max_request_bytes))),
            max_stops=int(param("max_stops", str(default.max_stops))),
            max_stop_bytes=int(param("max_stop_bytes", str(default.max_stop_bytes))),
            max_constraint_bytes=int(param("max_constraint_bytes", str(default.max_constraint_bytes))),
            max_tools_bytes=int(param("max_tools_bytes", str(default.max_tools_bytes))),
        )
        # Only a model keeping conversations shares prefixes by default: the stateless twin is the baseline of
        # a server that keeps nothing between requests.
        share = param("share_prefixes", "true" if self._batching is not None else "false").strip().lower()
        cache = PagedKVCache.for_model(
            model, num_blocks=num_blocks, block_size=block_size, share_prefixes=share in ("1", "true", "yes")
        )
        self.engine = ChatEngine(
            model,
            tokenizer,
            cache,
            slots,
            respond=self._respond,
            refuse=self._refuse,
            max_ctx=max_ctx,
            default_max_tokens=int(param("default_max_tokens", "64")),
            stream_interval_s=float(param("stream_interval_ms", "0")) / 1000,
            limits=limits,
            # Device context is per thread: the loop's thread makes the instance's device current too.
            on_thread=lambda: _activate(choice, threads),
            compile=_compile_mode(param("compile_decode", "off")),
            constraint_cache=int(param("constraint_cache", "64")),
        )
        self._keys = itertools.count(1)
        self._control_names = () if self._batching is None else tuple(self._batching.control_inputs.values())
        # Off unless the stub's environment names a trace file (the benchmarks' stage timings; see _timing).
        self._trace = StepTrace.from_env(args.get("model_instance_name", "chat"))
        self._loop = StepLoop(
            step=self.engine.step,
            admit=self.engine.admit,
            on_exit=self.engine.on_exit,
            final_flag=self._final,
            error_response=self._error,
            # A turn sent while its conversation streams one (the client cancelled and went on, or closed) stops
            # the old one: never refused as busy, never a grace wait on an execute thread.
            overlap="supersede",
            name=args.get("model_instance_name", "chat"),
            overlap_sends=_flag(param("overlap_sends", "true")),
            trace=self._trace,
        )
        _log.info(
            "%s on %s: up to %d conversations of up to %d tokens (%s), %d KV blocks of %d positions (%.1f MiB), %s",
            args.get("model_instance_name"),
            device,
            capacity,
            max_ctx,
            note,
            num_blocks,
            block_size,
            num_blocks * block_bytes / 2**20,
            "stateless" if self._batching is None else f"idle timeout {idle_s:g} s",
        )

    def execute(self, requests: list[Any]) -> None:
        pb = self._pb
        trace = self._trace
        for request in requests:
            sender = request.get_response_sender()
            begun = 0.0 if trace is None else trace.clock()
            try:
                key: CorrelationId
                if self._batching is None:
                    key, start, end = next(self._keys), True, True
                else:
                    tensors = {
                        name: None if (t := pb.get_input_tensor_by_name(request, name)) is None else t.as_numpy()
                        for name in self._control_names
                    }
                    controls = read_controls(
                        self._batching, correlation_id=request.correlation_id(), flags=request.flags(), tensors=tensors
                    )
                    if not controls.ready:
                        sender.send(flags=self._final)
                        continue
                    key, start, end = controls.correlation_id, controls.start, controls.end
                    if not end and self._scalar(request, proto.CANCEL):
                        # The client's cooperative cancel of the turn in flight (see proto.CANCEL): that turn ends
                        # as a cancelled one (rolled back, an empty FINAL), and this request is answered at once.
                        self._loop.cancel(key)
                        sender.send(flags=self._final)
                        continue
                options = {name.lower(): self._scalar(request, name) for name in proto.OPTION_INPUTS}
                turn = self.engine.parse(
                    key=key,
                    start=start,
                    end=end,
                    roles=self._strings(request, "ROLE"),
                    texts=self._strings(request, "TEXT"),
                    stop=self._strings(request, "STOP") or (),
                    tool_meta=self._strings(request, proto.TOOL_META),
                    digest=self._scalar(request, "DIGEST"),
                    **options,
                )
            except ValueError as err:
                sender.send(self._error(_invalid(str(err)), pb.TritonError.INVALID_ARG), flags=self._final)
                continue
            if trace is not None:
                trace.request(sender, key, execute=begun, parsed=trace.clock())
            refusal = self._loop.submit(key, sender, turn)
            if trace is not None:
                trace.mark(sender, "submitted")
            if refusal is not None:
                sender.send(self._error(refusal.message, pb.TritonError.UNAVAILABLE), flags=self._final)
                if trace is not None:
                    trace.finish(sender)

    def finalize(self) -> None:
        self._loop.close()

    def _error(self, message: str, code: Any = None) -> Any:
        pb = self._pb
        error = pb.TritonError(message) if code is None else pb.TritonError(message, code)
        return pb.InferenceResponse(output_tensors=[], error=error)

    def _refuse(self, kind: RefusalKind, message: str) -> Any:
        errors = self._pb.TritonError
        if kind == "capacity":
            return self._error(message, errors.UNAVAILABLE)
        # Over the gRPC stream an error is its text alone: the marker is what says it is the request's fault.
        return self._error(message if kind == "unknown" else _invalid(message), errors.INVALID_ARG)

    def _respond(self, r: ChatResponse) -> Any:
        pb = self._pb

        def one(name: str, value: object, dtype: Any) -> Any:
            return pb.Tensor(name, np.array([[value]], dtype=dtype))

        # Only for a turn that asked (and a config that declares it).
        extra = [one(proto.LOGPROBS, r.logprobs.encode(), np.object_)] if r.logprobs and self._logprobs else []
        if not r.finish:
            # A response in mid-turn carries its piece alone: it is sent once per token per conversation, and
            # every tensor costs the stub, Triton and the client a serialisation. The last one says it all.
            return pb.InferenceResponse(output_tensors=[one("PIECE", r.piece, np.object_), *extra])
        return pb.InferenceResponse(
            output_tensors=[
                one("PIECE", r.piece, np.object_),
                one("FINISH", r.finish.encode(), np.object_),
                one("TOKENS", r.tokens, np.int32),
                one("PROMPT_TOKENS", r.prompt_tokens, np.int32),
                one("CONTEXT_TOKENS", r.context_tokens, np.int32),
                one("DROPPED", r.dropped, np.int32),
                one("LIVE", r.live, np.int32),
                one("KV_BYTES", r.kv_bytes, np.int64),
                one("DIGEST", r.digest.encode(), np.object_),
                *([one("INPUT_TOKENS", r.input_tokens, np.int32)] if self._input_tokens else []),
                *extra,
                *([one(proto.TOOL_CALLS, r.tool_calls.encode(), np.object_)] if self._tool_calls else []),
            ]
        )

    def _strings(self, request: Any, name: str) -> list[bytes] | None:
        tensor = self._pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else list(tensor.as_numpy().reshape(-1))

    def _scalar(self, request: Any, name: str) -> Any:
        tensor = self._pb.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        flat = tensor.as_numpy().reshape(-1)
        if flat.size != 1:
            raise ValueError(f"input {name!r} must hold one value, got {flat.size}")
        value = flat[0]
        return value if isinstance(value, bytes) else value.item()


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes")


def _invalid(message: str) -> str:
    return f"{INVALID_INPUT} invalid input: {message}"


def _activate(choice: Any, threads: int) -> None:
    activate(choice, cpu_threads=threads)


def _dtype(name: str, checkpoint: Path, device: Any) -> Any:
    """The weights' and cache's dtype: ``auto`` is float32 on a host CPU and the checkpoint's own on an accelerator.

    A CPU runs half precision slowly (and bfloat16 matmuls are emulated on many), so a CPU instance computes in
    float32 whatever the checkpoint was saved in; an accelerator keeps the checkpoint's dtype.
    """
    import torch

    from .._files import read_json_config

    choices = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    name = name.strip().lower()
    if name in choices:
        return choices[name]
    if name != "auto":
        raise ValueError(f"parameter dtype must be auto, {', '.join(choices)}; got {name!r}")
    if torch.device(device).type == "cpu":
        return torch.float32
    raw = read_json_config(checkpoint)
    saved = raw.get("torch_dtype", raw.get("dtype"))  # transformers 5 writes "dtype"
    return choices.get(str(saved), torch.float32)


def _compile_mode(name: str) -> Compile:
    """Parameter ``compile_decode``: ``off`` (eager), ``cpu`` (torch.compile per batch bucket) or ``cuda-graphs``."""
    name = name.strip().lower()
    if name not in ("off", "cpu", "cuda-graphs"):
        raise ValueError(f"parameter compile_decode must be off, cpu or cuda-graphs; got {name!r}")
    return name  # type: ignore[return-value]
