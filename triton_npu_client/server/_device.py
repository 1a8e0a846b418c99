"""Which device one model instance drives: Ascend NPU, else CUDA, else CPU.

With ``KIND_CPU`` instances Triton's ``model_instance_device_id`` is always "0", so the device comes
from the model config's ``parameters`` (``device``: auto|npu|cuda|cpu, ``device_ids``: "0-3" or
"0,2") and the instance index at the end of ``args["model_instance_name"]`` (``<model>_<group>_<i>``),
the pattern NVIDIA's python_backend uses for Inferentia. With ``KIND_GPU`` instances Triton itself
places each instance on a CUDA device and says which in ``model_instance_device_id``: that is the
device. :func:`choose_instance_device` and :func:`choose_device` are pure; :func:`probe_accelerators`
and :func:`activate` touch the runtime.

torch is imported only when an accelerator may exist (:func:`accelerator_possible`): importing it
costs a CPU-only stub ~2.5 s of CPU at load, ~150 MiB of RSS and a slow interpreter shutdown, for a
state that numpy handles as well on CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import importlib.util
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import torch

__all__ = [
    "Accelerators",
    "accelerator_possible",
    "DeviceChoice",
    "activate",
    "choose_device",
    "choose_instance_device",
    "cpu_instances",
    "cpu_thread_count",
    "keep_freed_memory",
    "instance_index",
    "instance_kind",
    "parse_device_ids",
    "probe_accelerators",
    "to_host",
]

_log = logging.getLogger("triton_npu_client.server")

DeviceKind = Literal["npu", "cuda", "cpu"]
_TRAILING_INDEX = re.compile(r"_(\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Accelerators:
    """What this process can use: device counts per kind (0 when absent)."""

    npu: int = 0
    cuda: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceChoice:
    """The device one instance drives; ``torch_device`` is what tensors are created on."""

    kind: DeviceKind
    index: int = 0

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"


def instance_index(instance_name: str) -> int:
    """The instance's index within its group: the trailing ``_<n>`` of ``model_instance_name``."""
    match = _TRAILING_INDEX.search(instance_name)
    return int(match.group(1)) if match else 0


def instance_kind(args: Mapping[str, str]) -> str:
    """Triton's instance kind from ``args["model_instance_kind"]``: "GPU", "CPU", "MODEL" ("CPU" when absent)."""
    kind = str(args.get("model_instance_kind") or "CPU").strip().upper()
    return kind.removeprefix("KIND_")


def cpu_instances(config: Mapping[str, Any]) -> int:
    """How many instances of a model run on the host: the counts of its ``instance_group`` entries not on a GPU.

    ``config`` is the model config as a Python model gets it (JSON, parsed). Triton fills ``kind`` and ``count``
    in; a group without them counts as one host instance.
    """
    total = 0
    for group in config.get("instance_group") or [{}]:
        if str(group.get("kind", "KIND_CPU")).upper() != "KIND_GPU":
            total += max(int(group.get("count", 1)), 1)
    return max(total, 1)


def cpu_thread_count(value: str | None, *, instances: int = 1, cores: int | None = None) -> int:
    """torch's intra-op threads for one CPU instance, from the config parameter ``cpu_threads``.

    A positive integer is taken as it is. ``auto`` (or nothing) is one core fewer than ``cores`` (default: the cores
    this process may run on, ``os.sched_getaffinity``: a container's or a ``taskset``'s share, not the machine's
    count), divided among the model's ``instances`` on the host, at least 1. The core left over is for the threads
    beside the decode: Triton's (gRPC, the backend), the stub's send thread and, often, a client on the same machine.
    A torch parallel region waits for its slowest thread, so one torch thread preempted by them stalls the whole
    pass: on 2 cores, 2 threads never made one conversation's tokens faster than 1 (0.93x-1.47x its time per token),
    spinning OpenMP threads or not (docs/chat.md, "Threads"). Each instance is a process of its own, and instances
    that each took every core would fight over them.
    """
    text = (value or "auto").strip().lower()
    if text == "auto":
        if cores is None:
            cores = len(os.sched_getaffinity(0))
        return max((cores - 1) // max(instances, 1), 1)
    try:
        threads = int(text, 10)
    except ValueError:
        raise ValueError(f"parameter cpu_threads must be 'auto' or a positive integer, got {value!r}") from None
    if threads < 1:
        raise ValueError(f"parameter cpu_threads must be 'auto' or a positive integer, got {value!r}")
    return threads


def parse_device_ids(spec: str | None) -> list[int] | None:
    """``"0-3"`` -> [0, 1, 2, 3]; ``"0,2,5"`` -> [0, 2, 5]; ranges and lists mix; empty/None -> None."""
    if spec is None or not spec.strip():
        return None
    ids: list[int] = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if sep:
            first, last = int(low), int(high)
            if last < first:
                raise ValueError(f"device range {part!r} runs backwards")
            ids.extend(range(first, last + 1))
        else:
            ids.append(int(part))
    if any(i < 0 for i in ids):
        raise ValueError(f"device ids must be >= 0, got {spec!r}")
    return ids or None


def choose_device(
    *,
    available: Accelerators,
    instance: int = 0,
    device_ids: Sequence[int] | None = None,
    force: str | None = None,
) -> DeviceChoice:
    """Pick the device for instance number ``instance``: NPU, else CUDA, else CPU (or ``force``).

    Instances spread over ``device_ids`` (default: every device of the kind) round-robin.
    ``force`` ("npu", "cuda", "cpu"; "auto" or None = choose) fails loudly when that kind is absent.
    """
    kind: DeviceKind
    wanted = (force or "auto").lower()
    if wanted == "auto":
        kind = "npu" if available.npu else "cuda" if available.cuda else "cpu"
    elif wanted in ("npu", "cuda", "cpu"):
        kind = wanted  # type: ignore[assignment]
        if kind != "cpu" and getattr(available, kind) == 0:
            raise RuntimeError(f"device {kind!r} was forced by the model config but none is available")
    else:
        raise ValueError(f"device must be auto, npu, cuda or cpu, got {force!r}")
    if kind == "cpu":
        return DeviceChoice(kind="cpu")
    count = getattr(available, kind)
    ids = list(device_ids) if device_ids else list(range(count))
    index = ids[instance % len(ids)]
    if index >= count:
        raise ValueError(f"{kind} device {index} requested, but only {count} visible")
    return DeviceChoice(kind=kind, index=index)


def choose_instance_device(
    args: Mapping[str, str],
    *,
    available: Accelerators,
    device_ids: Sequence[int] | None = None,
    force: str | None = None,
) -> DeviceChoice:
    """The device for the instance Triton describes in ``args`` (what ``initialize`` receives).

    ``KIND_GPU``: Triton placed the instance on CUDA device ``model_instance_device_id``, and that is
    the device; ``force`` may be auto or cuda, or cpu to keep the state on the host; ``device_ids``
    does not apply. Any other kind (``KIND_CPU``, ``KIND_MODEL``, where Triton's device id is always
    0): :func:`choose_device` with the instance index from ``model_instance_name``, ``device_ids`` and
    ``force``. Raises when the wanted device is absent, as :func:`choose_device` does.
    """
    if instance_kind(args) != "GPU":
        return choose_device(
            available=available,
            instance=instance_index(args.get("model_instance_name", "")),
            device_ids=device_ids,
            force=force,
        )
    wanted = (force or "auto").strip().lower()
    if wanted == "cpu":
        return DeviceChoice(kind="cpu")
    if wanted not in ("auto", "cuda"):
        raise ValueError(
            f"a KIND_GPU instance runs on the CUDA device Triton assigns it, so device must be auto, cuda or cpu, "
            f"got {force!r}; use KIND_CPU instances with device_ids for other accelerators"
        )
    raw = args.get("model_instance_device_id") or "0"
    try:
        index = int(raw)
    except ValueError:
        raise ValueError(f"model_instance_device_id must be an integer, got {raw!r}") from None
    if available.cuda == 0:
        raise RuntimeError(f"KIND_GPU instance on CUDA device {index}, but no CUDA device is usable here")
    if not 0 <= index < available.cuda:
        raise ValueError(f"KIND_GPU instance on CUDA device {index}, but only {available.cuda} visible")
    return DeviceChoice(kind="cuda", index=index)


def accelerator_possible() -> bool:
    """Whether an NPU or a CUDA device may exist here, decided without importing torch.

    NPU: the ``torch_npu`` package is installed (found, not imported). CUDA: the NVIDIA kernel driver
    is loaded (``/proc/driver/nvidia``) or a ``/dev/nvidia<N>`` node exists. Deliberately coarse and
    independent of ``CUDA_VISIBLE_DEVICES``: True only means "ask torch"; :func:`probe_accelerators`
    then counts what is really usable.
    """
    if importlib.util.find_spec("torch_npu") is not None:
        return True
    if Path("/proc/driver/nvidia").exists():
        return True
    return any(re.fullmatch(r"nvidia\d+", p.name) for p in Path("/dev").glob("nvidia*"))


def probe_accelerators() -> Accelerators:
    """Count usable NPUs (torch_npu imports and sees devices) and CUDA devices.

    Without a possible accelerator (:func:`accelerator_possible`) this answers "none" without
    importing torch.
    """
    if not accelerator_possible():
        return Accelerators()
    import torch

    npu = 0
    try:
        # torch_npu registers torch.npu on import; it fails without CANN / an Ascend device.
        importlib.import_module("torch_npu")
    except ModuleNotFoundError as err:
        if err.name != "torch_npu":
            _log.warning("torch_npu is installed but did not import, so no NPU is used: %r", err)
        else:
            _log.info("torch_npu is not installed, so no NPU is used: %s", err)
    except Exception as err:  # CANN missing or broken, no driver: any failure means "no usable NPU here"
        _log.warning("torch_npu is installed but did not import, so no NPU is used: %r", err)
    else:
        try:
            npu = int(torch.npu.device_count())  # type: ignore[attr-defined]
        except Exception as err:
            _log.warning("torch_npu imported but could not count NPUs, so no NPU is used: %r", err)
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Accelerators(npu=npu, cuda=cuda)


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit (HEAP_MAX_SIZE / 2).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
KEEP_MMAP_THRESHOLD = 32 * 2**20
KEEP_TRIM_THRESHOLD = 64 * 2**20


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks up to 32 MiB for reuse instead of returning them to the kernel; False if not glibc.

    A decode pass allocates and frees the same temporaries (logits, attention's gathers) every time, some of them
    above glibc's mmap threshold. glibc raises that threshold by itself once it sees such a block freed, so a
    process that happened to free a large block early (the in-process benchmark) keeps its temporaries, while the
    stub's decode thread was seen mapping and unmapping them every pass in some runs: 330-670 page faults a pass at
    32 conversations, 0.03-0.08 CPU-s per 1,000 tokens in the kernel (docs/chat.md, "Where the stub's time goes"). Fixed
    thresholds make it the same in every process: blocks up to 32 MiB come from the heap, and a heap keeps up to 64
    MiB free before it is trimmed. The process holds its peak working set instead of giving it back between passes.
    ``mallopt`` is not thread-safe: call it before threads that allocate run (the chat model does, while it loads;
    called from the decode thread under load it corrupted the stub's heap).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # a C library without mallopt (musl's exists and returns 0: False below)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD))


def activate(choice: DeviceChoice, *, cpu_threads: int | None = 1) -> torch.device:
    """Make ``choice`` this thread's current device and return it.

    On CPU, limit torch's intra-op threads: several instances share few cores, and one thread each
    avoids oversubscription.
    """
    import torch

    if choice.kind == "npu":
        torch.npu.set_device(choice.index)  # type: ignore[attr-defined]
    elif choice.kind == "cuda":
        torch.cuda.set_device(choice.index)
    elif cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    return torch.device(choice.torch_device)


def to_host(tensor: torch.Tensor | NDArray[Any]) -> NDArray[Any]:
    """A device tensor as a host numpy array (pb_utils tensors take CPU or CUDA memory only).

    A numpy array (the CPU state's results) is already on the host and comes back as it is.
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    return tensor.detach().to("cpu").numpy()
