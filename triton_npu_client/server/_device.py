"""Which device one model instance drives: Ascend NPU, else CUDA, else CPU.

With ``KIND_CPU`` instances Triton's ``model_instance_device_id`` is always "0", so the device comes
from the model config's ``parameters`` (``device``: auto|npu|cuda|cpu, ``device_ids``: "0-3" or
"0,2") and the instance index at the end of ``args["model_instance_name"]`` (``<model>_<group>_<i>``),
the pattern NVIDIA's python_backend uses for Inferentia. :func:`choose_device` is pure;
:func:`probe_accelerators` and :func:`activate` touch the runtime.

torch is imported only when an accelerator may exist (:func:`accelerator_possible`): importing it
costs a CPU-only stub ~2.5 s of CPU at load, ~150 MiB of RSS and a slow interpreter shutdown, for a
state that numpy handles as well on CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Sequence
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
    "instance_index",
    "parse_device_ids",
    "probe_accelerators",
    "to_host",
]

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
        npu = int(torch.npu.device_count())  # type: ignore[attr-defined]
    except Exception:  # any failure means "no usable NPU here"
        npu = 0
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Accelerators(npu=npu, cuda=cuda)


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
