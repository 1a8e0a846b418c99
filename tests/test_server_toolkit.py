"""Pure unit tests of triton_npu_client.server: no Triton, CPU torch and numpy, injected clock (no sleeping)."""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from triton_npu_client._protocol import _markers as markers
from triton_npu_client.server import (
    Accelerators,
    DeviceChoice,
    NumpyMoments,
    RunningMoments,
    RunningStatsModel,
    SequenceBatching,
    SequenceControls,
    SequenceSlots,
    accelerator_possible,
    choose_device,
    instance_index,
    model_parameter,
    parse_device_ids,
    probe_accelerators,
    read_controls,
    to_host,
)
from triton_npu_client.server import _device as toolkit_device
from triton_npu_client.server import _model as toolkit_model
from triton_npu_client.server._device import choose_instance_device


class FakeClock:
    """A clock the test moves by hand, so the idle sweep is tested without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(seq: dict[str, object], **params: str) -> str:
    return json.dumps(
        {
            "name": "m",
            "max_batch_size": 8,
            "sequence_batching": seq,
            "parameters": {k: {"string_value": v} for k, v in params.items()},
        }
    )


def _control(name: str, kind: str, **extra: object) -> dict[str, object]:
    return {"name": name, "control": [{"kind": f"CONTROL_SEQUENCE_{kind}", **extra}]}


DIRECT = SequenceBatching.from_model_config(
    _config(
        {
            "direct": {"max_queue_delay_microseconds": 0},
            "max_sequence_idle_microseconds": 3000000,
            "control_input": [
                _control("S", "START", int32_false_true=[0, 1]),
                _control("E", "END", int32_false_true=[0, 1]),
                _control("R", "READY", int32_false_true=[0, 1]),
                _control("C", "CORRID", data_type="TYPE_UINT64"),
            ],
        }
    )
)
FLAGS_ONLY = SequenceBatching.from_model_config(_config({"oldest": {}}))


def start(key: int | str, *, end: bool = False) -> SequenceControls:
    return SequenceControls(correlation_id=key, start=True, end=end)


def step(key: int | str, *, end: bool = False) -> SequenceControls:
    return SequenceControls(correlation_id=key, end=end)


def test_config_parses_strategy_controls_and_idle_timeout() -> None:
    """The sequence_batching section yields strategy, idle timeout and the control-input names."""
    assert DIRECT.strategy == "direct"
    assert DIRECT.idle_timeout_s == 3.0
    assert dict(DIRECT.control_inputs) == {"start": "S", "end": "E", "ready": "R", "corrid": "C"}
    assert DIRECT.max_batch_size == 8
    assert FLAGS_ONLY.strategy == "oldest"
    assert FLAGS_ONLY.idle_timeout_us == 1_000_000  # Triton's default when the config says nothing
    assert dict(FLAGS_ONLY.control_inputs) == {}


def test_config_string_ids_from_control_or_parameter() -> None:
    """String ids are known from a TYPE_STRING CORRID control or the correlation_id_type parameter."""
    by_control = _config({"oldest": {}, "control_input": [_control("C", "CORRID", data_type="TYPE_STRING")]})
    assert SequenceBatching.from_model_config(by_control).string_ids
    by_param = _config({"oldest": {}}, correlation_id_type="string")
    assert SequenceBatching.from_model_config(by_param).string_ids
    assert model_parameter(by_param, "correlation_id_type") == "string"
    assert model_parameter(by_param, "absent", "dflt") == "dflt"
    with pytest.raises(ValueError, match="no sequence_batching"):
        SequenceBatching.from_model_config(json.dumps({"name": "plain"}))


def test_controls_from_tensors() -> None:
    """Declared control inputs win over the request's own flags and id."""
    tensors: dict[str, NDArray[Any] | None] = {
        "S": np.array([[1]], np.int32),
        "E": np.array([[0]], np.int32),
        "R": np.array([[1]], np.int32),
        "C": np.array([[2**63 + 5]], np.uint64),
    }
    ctl = read_controls(DIRECT, correlation_id=7, flags=2, tensors=tensors)
    assert ctl == SequenceControls(correlation_id=2**63 + 5, start=True, end=False, ready=True)


def test_dummy_slot_is_not_ready() -> None:
    """A direct-strategy dummy (READY 0, CORRID 0) reads as not ready."""
    zeros = {n: np.array([[0]], np.int32) for n in "SER"} | {"C": np.array([[0]], np.uint64)}
    assert read_controls(DIRECT, correlation_id=0, flags=0, tensors=zeros).ready is False


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(0, (False, False)), (1, (True, False)), (2, (False, True)), (3, (True, True)), (7, (True, True))],
)
def test_flags_are_tested_bitwise(flags: int, expected: tuple[bool, bool]) -> None:
    """request.flags() is a bitmask: START=1, END=2, other bits ignored."""
    ctl = read_controls(FLAGS_ONLY, correlation_id="abc", flags=flags, tensors={})
    assert (ctl.start, ctl.end) == expected
    assert ctl.correlation_id == "abc"


def test_string_model_keys_integer_and_string_ids_apart() -> None:
    """A string-id model reads str ids as given and integer ids as ints: 5 and "5" stay different sequences."""
    batching = SequenceBatching.from_model_config(_config({"oldest": {}}, correlation_id_type="string"))
    as_int = read_controls(batching, correlation_id=5, flags=1, tensors={})
    as_str = read_controls(batching, correlation_id="5", flags=1, tensors={})
    assert (as_int.correlation_id, as_str.correlation_id) == (5, "5")
    assert as_int.ready
    assert as_str.ready


def test_start_admits_end_frees() -> None:
    """START takes a slot, END frees it after the step; the live count follows."""
    slots = SequenceSlots(capacity=4, idle_timeout_s=3.0, clock=FakeClock())
    plan = slots.plan([start(1), start(2)])
    assert plan.rows == (0, 1)
    assert plan.fresh == (True, True)
    assert slots.live == 2
    plan = slots.plan([step(1, end=True), step(2)])
    assert plan.ending == (1,)
    assert slots.live == 2  # freed only once the step is computed
    slots.finish(plan)
    assert slots.live == 1
    assert 1 not in slots
    assert 2 in slots


def test_one_request_sequence_leaves_nothing() -> None:
    """START and END together: one step, then the slot is free again."""
    slots = SequenceSlots(capacity=1, idle_timeout_s=1.0, clock=FakeClock())
    plan = slots.plan([start(9, end=True)])
    assert plan.rows == (0,)
    slots.finish(plan)
    assert slots.live == 0


def test_step_without_start_is_refused() -> None:
    """A step for a sequence the instance does not hold gets an 'unknown' refusal naming START."""
    slots = SequenceSlots(capacity=2, idle_timeout_s=1.0, clock=FakeClock())
    plan = slots.plan([step(5)])
    assert plan.rows == ()
    assert plan.errors[0].reason == "unknown"
    assert "START" in plan.errors[0].message


def test_cap_refuses_start_and_others_go_on() -> None:
    """A START beyond the cap is refused with a message naming the cap; the rest of the batch proceeds."""
    slots = SequenceSlots(capacity=2, idle_timeout_s=1.0, clock=FakeClock())
    slots.plan([start(1), start(2)])
    plan = slots.plan([step(1), start(3), step(2)])
    assert plan.rows == (0, 2)
    assert plan.errors[1].reason == "capacity"
    assert "cap of 2" in plan.errors[1].message
    assert slots.live == 2


def test_duplicate_steps_in_one_batch_refused() -> None:
    """Two steps of one sequence in a batch: the second is refused, never computed twice."""
    slots = SequenceSlots(capacity=2, idle_timeout_s=1.0, clock=FakeClock())
    plan = slots.plan([start(1), step(1)])
    assert plan.rows == (0,)
    assert plan.errors[1].reason == "duplicate"


def test_sweep_by_age_with_injected_clock() -> None:
    """Sequences idle longer than timeout + grace are swept at the next plan; active ones stay."""
    clock = FakeClock()
    slots = SequenceSlots(capacity=4, idle_timeout_s=3.0, grace_s=0.5, clock=clock)
    slots.plan([start(1), start(2)])
    clock.now += 2.0
    slots.plan([step(2)])
    clock.now += 1.4  # seq 1 idle 3.4 s: inside timeout + grace
    slots.plan([])
    assert slots.live == 2
    clock.now += 0.2  # seq 1 idle 3.6 s > 3.5 s; seq 2 idle 1.6 s
    slots.plan([])
    assert 1 not in slots
    assert slots.live == 1
    assert slots.plan([step(1)]).errors[0].reason == "unknown"


def test_sweep_keeps_a_sequence_stepping_in_this_batch() -> None:
    """An old sequence whose step is in the batch being planned is not swept under it."""
    clock = FakeClock()
    slots = SequenceSlots(capacity=2, idle_timeout_s=1.0, grace_s=0.0, clock=clock)
    slots.plan([start(1)])
    clock.now += 5.0
    plan = slots.plan([step(1)])
    assert plan.rows == (0,)
    assert plan.fresh == (False,)


def test_restart_of_live_sequence_resets_state() -> None:
    """A START for a live id keeps its slot but the step ignores the old state."""
    slots = SequenceSlots(capacity=2, idle_timeout_s=1.0, clock=FakeClock())
    moments = RunningMoments(capacity=2, dim=2)
    p1 = slots.plan([start(1)])
    moments.step(torch.tensor(p1.slots), torch.tensor([[10.0, 10.0]]), torch.tensor(p1.fresh))
    p2 = slots.plan([start(1)])
    assert p2.slots == p1.slots
    count, mean, var = moments.step(torch.tensor(p2.slots), torch.tensor([[2.0, 4.0]]), torch.tensor(p2.fresh))
    assert count.tolist() == [1.0]
    assert mean.tolist() == [[2.0, 4.0]]
    assert var.tolist() == [[0.0, 0.0]]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=6),
    st.integers(min_value=0, max_value=2**31),
)
def test_batched_step_equals_per_sequence_reference(lengths: list[int], seed: int) -> None:
    """Interleaved batched steps give each sequence numpy's mean/var of its own vectors."""
    rng = np.random.default_rng(seed)
    dim = 3
    data = [rng.normal(size=(n, dim)) * 10 for n in lengths]
    slots = SequenceSlots(capacity=len(lengths), idle_timeout_s=1.0, clock=FakeClock())
    moments = RunningMoments(capacity=len(lengths), dim=dim)
    done = [0] * len(lengths)
    results: dict[int, tuple[float, NDArray[Any], NDArray[Any]]] = {}
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        # A random subset of the unfinished sequences steps in each batch, in random order.
        pending = [i for i, n in enumerate(lengths) if done[i] < n]
        chosen = [int(i) for i in rng.permutation(pending)[: rng.integers(1, len(pending) + 1)]]
        ctl = [
            SequenceControls(correlation_id=i + 1, start=done[i] == 0, end=done[i] == lengths[i] - 1) for i in chosen
        ]
        plan = slots.plan(ctl)
        assert plan.rows == tuple(range(len(chosen)))
        x = torch.from_numpy(np.stack([data[i][done[i]] for i in chosen]).astype(np.float32))
        count, mean, var = moments.step(torch.tensor(plan.slots), x, torch.tensor(plan.fresh))
        for j, i in enumerate(chosen):
            done[i] += 1
            results[i] = (float(count[j]), mean[j].numpy(), var[j].numpy())
        slots.finish(plan)
    assert slots.live == 0
    for i, seq in enumerate(data):
        count_i, mean_i, var_i = results[i]
        assert count_i == len(seq)
        np.testing.assert_allclose(mean_i, seq.mean(axis=0), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(var_i, seq.var(axis=0), rtol=1e-4, atol=1e-3)


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=10), min_size=1, max_size=6),
    st.integers(min_value=0, max_value=2**31),
)
def test_numpy_state_equals_torch_state(lengths: list[int], seed: int) -> None:
    """NumpyMoments and RunningMoments (torch, CPU) give bit-identical count/mean/var on random interleaved steps."""
    rng = np.random.default_rng(seed)
    dim = 3
    slots = SequenceSlots(capacity=len(lengths), idle_timeout_s=1.0, clock=FakeClock())
    host = NumpyMoments(capacity=len(lengths), dim=dim)
    dev = RunningMoments(capacity=len(lengths), dim=dim)
    done = [0] * len(lengths)
    # Sequences restart (fresh) after they end, so stale rows of freed slots must be ignored by both.
    while any(d < 2 * n for d, n in zip(done, lengths, strict=True)):
        pending = [i for i, n in enumerate(lengths) if done[i] < 2 * n]
        chosen = [int(i) for i in rng.permutation(pending)[: rng.integers(1, len(pending) + 1)]]
        ctl = [
            SequenceControls(
                correlation_id=i + 1, start=done[i] % lengths[i] == 0, end=done[i] % lengths[i] == lengths[i] - 1
            )
            for i in chosen
        ]
        plan = slots.plan(ctl)
        x = (rng.normal(size=(len(chosen), dim)) * 10).astype(np.float32)
        got = host.step(np.array(plan.slots), x, np.array(plan.fresh))
        want = dev.step(torch.tensor(plan.slots), torch.from_numpy(x.copy()), torch.tensor(plan.fresh))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == np.float32
            np.testing.assert_array_equal(to_host(g), to_host(w))
        for i in chosen:
            done[i] += 1
        slots.finish(plan)
    np.testing.assert_array_equal(host.mean, to_host(dev.mean))
    np.testing.assert_array_equal(host.m2, to_host(dev.m2))


def _state_in_fresh_interpreter(device: str) -> list[str]:
    """Build RunningStatsModel for a ``device`` config in a new interpreter; report state class, torch loaded."""
    config = {
        "name": "m",
        "max_batch_size": 8,
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}],
        "sequence_batching": {"oldest": {}},
        "parameters": {"device": {"string_value": device}},
    }
    code = (
        "import json, sys\n"
        "import triton_npu_client.server as tk\n"
        f"m = tk.RunningStatsModel({{'model_config': {json.dumps(json.dumps(config))}, "
        "'model_instance_name': 'm_0_0'}, pb=None)\n"
        "print(type(m.state).__name__, m.device_choice.kind, 'torch' in sys.modules, tk.accelerator_possible())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()


def test_cpu_instance_never_imports_torch() -> None:
    """A device: cpu instance keeps its state in numpy and its interpreter never imports torch."""
    assert _state_in_fresh_interpreter("cpu") == ["NumpyMoments", "cpu", "False", str(accelerator_possible())]


def test_auto_instance_imports_torch_only_if_an_accelerator_may_exist() -> None:
    """device: auto loads torch (RunningMoments) exactly when accelerator_possible() says an accelerator may exist."""
    possible = accelerator_possible()
    state, _kind, torch_loaded, _ = _state_in_fresh_interpreter("auto")
    assert torch_loaded == str(possible)
    assert state == ("RunningMoments" if possible else "NumpyMoments")


def test_to_host_passes_numpy_through_and_copies_tensors() -> None:
    """to_host returns a numpy array unchanged and a torch tensor as its numpy values."""
    a = np.arange(3, dtype=np.float32)
    assert to_host(a) is a
    np.testing.assert_array_equal(to_host(torch.arange(3, dtype=torch.float32)), a)


@pytest.mark.parametrize(
    ("name", "index"), [("seq_stats_oldest_0_0", 0), ("tmm_0_1", 1), ("m_2_13", 13), ("plain", 0), ("m_x", 0)]
)
def test_instance_index_from_name(name: str, index: int) -> None:
    """The instance index is the trailing _<n> of model_instance_name (0 when absent)."""
    assert instance_index(name) == index


def test_parse_device_ids() -> None:
    """Device id specs: ranges, lists, both mixed; empty means 'all'; bad ones refused."""
    assert parse_device_ids("0-3") == [0, 1, 2, 3]
    assert parse_device_ids("0,2, 5") == [0, 2, 5]
    assert parse_device_ids("1,4-5") == [1, 4, 5]
    assert parse_device_ids("") is None
    assert parse_device_ids(None) is None
    with pytest.raises(ValueError, match="backwards"):
        parse_device_ids("3-1")


@pytest.mark.parametrize(
    ("available", "force", "expected"),
    [
        (Accelerators(npu=8, cuda=2), None, DeviceChoice(kind="npu", index=1)),
        (Accelerators(npu=0, cuda=2), "auto", DeviceChoice(kind="cuda", index=1)),
        (Accelerators(), None, DeviceChoice(kind="cpu")),
        (Accelerators(npu=8, cuda=2), "cuda", DeviceChoice(kind="cuda", index=1)),
        (Accelerators(npu=8), "cpu", DeviceChoice(kind="cpu")),
    ],
)
def test_choose_device_order_and_force(available: Accelerators, force: str | None, expected: DeviceChoice) -> None:
    """NPU before CUDA before CPU; a forced kind wins; instance 1 gets device 1."""
    assert choose_device(available=available, instance=1, force=force) == expected


def test_choose_device_spreads_instances_over_ids() -> None:
    """Instances go round-robin over the configured device ids."""
    picks = [choose_device(available=Accelerators(npu=8), instance=i, device_ids=[4, 6]).index for i in range(4)]
    assert picks == [4, 6, 4, 6]
    assert DeviceChoice(kind="npu", index=6).torch_device == "npu:6"


def test_choose_device_refuses_what_is_missing() -> None:
    """Forcing an absent accelerator, or an id beyond the visible count, fails loudly."""
    with pytest.raises(RuntimeError, match="forced"):
        choose_device(available=Accelerators(cuda=1), force="npu")
    with pytest.raises(ValueError, match="only 2 visible"):
        choose_device(available=Accelerators(cuda=2), device_ids=[3])
    with pytest.raises(ValueError, match="auto, npu"):
        choose_device(available=Accelerators(), force="tpu")


def test_toolkit_imports_without_client_or_pb_utils() -> None:
    """The toolkit's modules import neither tritonclient, grpc nor triton_python_backend_utils."""
    code = (
        "import sys, importlib.util, pathlib\n"
        "import triton_npu_client\n"  # the parent package's own imports are the lead's to keep lazy
        "before = set(sys.modules)\n"
        "import triton_npu_client.server\n"
        "new = set(sys.modules) - before\n"
        "bad = sorted(m for m in new if m.split('.')[0] in ('tritonclient', 'grpc', 'triton_python_backend_utils',"
        " 'attrs'))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_device_check_script_runs_on_cpu() -> None:
    """bench/device_check.py runs with the toolkit alone (no tritonclient) and reports OK on CPU."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "bench/device_check.py", "--sequences", "300", "--steps", "4", "--batch", "64"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cpu" in out.stdout
    assert out.stdout.strip().endswith("OK")


# --- device choice for KIND_GPU instances ----------------------------------------------------------


def _instance_args(kind: str, device_id: str, name: str = "m_0_2") -> dict[str, str]:
    return {"model_instance_kind": kind, "model_instance_device_id": device_id, "model_instance_name": name}


@pytest.mark.parametrize(
    ("args", "device_ids", "force", "expected"),
    [
        # KIND_GPU: Triton's device id is the device, whatever the instance index or device_ids say.
        (_instance_args("GPU", "3"), None, None, DeviceChoice(kind="cuda", index=3)),
        (_instance_args("GPU", "1", "m_0_0"), [0], "auto", DeviceChoice(kind="cuda", index=1)),
        (_instance_args("GPU", "2"), None, "cuda", DeviceChoice(kind="cuda", index=2)),
        (_instance_args("GPU", "2"), None, "cpu", DeviceChoice(kind="cpu")),
        # KIND_CPU: the device id is always 0; instance index 2 of the name picks, round-robin.
        (_instance_args("CPU", "0"), None, None, DeviceChoice(kind="cuda", index=2)),
        (_instance_args("CPU", "0"), [1, 3], None, DeviceChoice(kind="cuda", index=1)),
        ({"model_instance_name": "m_0_3"}, None, None, DeviceChoice(kind="cuda", index=3)),
    ],
)
def test_instance_device_follows_triton_for_kind_gpu(
    args: dict[str, str], device_ids: list[int] | None, force: str | None, expected: DeviceChoice
) -> None:
    """KIND_GPU uses model_instance_device_id; other kinds keep the name's index and device/device_ids."""
    choice = choose_instance_device(args, available=Accelerators(cuda=4), device_ids=device_ids, force=force)
    assert choice == expected


def test_instance_device_kind_gpu_refuses_what_cannot_be() -> None:
    """KIND_GPU with an NPU forced, no CUDA device, or a device id beyond the visible ones fails loudly."""
    with pytest.raises(ValueError, match="KIND_GPU"):
        choose_instance_device(_instance_args("GPU", "0"), available=Accelerators(npu=2, cuda=1), force="npu")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        choose_instance_device(_instance_args("GPU", "0"), available=Accelerators(npu=2))
    with pytest.raises(ValueError, match="only 2 visible"):
        choose_instance_device(_instance_args("GPU", "5"), available=Accelerators(cuda=2))


def test_model_state_lands_on_triton_gpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """RunningStatsModel for a KIND_GPU instance on device 3 activates cuda:3, not cuda:0."""
    activated: list[DeviceChoice] = []

    def fake_activate(choice: DeviceChoice, **_: object) -> torch.device:
        activated.append(choice)
        return torch.device("cpu")  # no GPU here: the state itself stays on the CPU

    monkeypatch.setattr(toolkit_model, "accelerator_possible", lambda: True)
    monkeypatch.setattr(toolkit_model, "probe_accelerators", lambda: Accelerators(cuda=4))
    monkeypatch.setattr(toolkit_model, "activate", fake_activate)
    config = {
        "name": "m",
        "max_batch_size": 8,
        "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": ["4"]}],
        "sequence_batching": {"oldest": {}},
    }
    args = {"model_config": json.dumps(config), **_instance_args("GPU", "3", "m_0_0")}
    model = RunningStatsModel(args, pb=None)
    assert model.device_choice == DeviceChoice(kind="cuda", index=3)
    assert [c.torch_device for c in activated] == ["cuda:3"]


# --- torch_npu import failures are logged -------------------------------------------------------------


class _BrokenTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu`` (so it looks installed) and fails to import it, as torch_npu does without CANN."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == "torch_npu" else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: object) -> None:
        raise OSError("libascendcl.so: cannot open shared object file")


def test_failed_torch_npu_import_is_logged_with_its_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An installed torch_npu that fails to import: a warning naming the exception, and no NPU counted."""
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpu(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with caplog.at_level(logging.INFO, logger="triton_npu_client.server"):
        found = probe_accelerators()
    assert found.npu == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "torch_npu" in warnings[0].getMessage()
    assert "libascendcl.so: cannot open shared object file" in warnings[0].getMessage()


def test_absent_torch_npu_is_logged_as_info(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """torch_npu not installed (an accelerator may still be CUDA): said at info level, no warning."""
    monkeypatch.setattr(toolkit_device, "accelerator_possible", lambda: True)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` raise ModuleNotFoundError
    with caplog.at_level(logging.INFO, logger="triton_npu_client.server"):
        found = probe_accelerators()
    assert found.npu == 0
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "torch_npu is not installed" in caplog.records[0].getMessage()


# --- RunningMoments honours its dtype ----------------------------------------------------------------


def test_running_moments_state_in_its_dtype() -> None:
    """The state tensors and the step's results are in the dtype asked for (float32 when None)."""
    wide = RunningMoments(capacity=2, dim=3, dtype=torch.float64)
    assert {t.dtype for t in (wide.count, wide.mean, wide.m2)} == {torch.float64}
    count, mean, var = wide.step(torch.tensor([1]), torch.ones(1, 3), torch.tensor([True]))
    assert {t.dtype for t in (count, mean, var)} == {torch.float64}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        # None means float32, not whatever torch's global default happens to be.
        default = RunningMoments(capacity=2, dim=3)
    finally:
        torch.set_default_dtype(previous)
    assert default.dtype == torch.float32
    assert {t.dtype for t in (default.count, default.mean, default.m2)} == {torch.float32}


# --- the idle sweep visits only what expired ---------------------------------------------------------


class CountingTime(float):
    """A timestamp that counts the comparisons made with it: how many sequences a sweep examined."""

    compared = 0

    def _count(self, other: object, op: str) -> bool:
        CountingTime.compared += 1
        return bool(getattr(float(self), op)(other))

    def __lt__(self, other: object) -> bool:
        return self._count(other, "__lt__")

    def __le__(self, other: object) -> bool:
        return self._count(other, "__le__")

    def __gt__(self, other: object) -> bool:
        return self._count(other, "__gt__")

    def __ge__(self, other: object) -> bool:
        return self._count(other, "__ge__")


def test_sweep_work_is_proportional_to_expired_sequences() -> None:
    """With 5000 live sequences and 3 idle, a sweep examines about 3, not 5000; a sweep with none idle examines 1."""
    now = [1000.0]
    slots = SequenceSlots(capacity=6000, idle_timeout_s=3.0, grace_s=0.5, clock=lambda: CountingTime(now[0]))
    slots.plan([start(k) for k in (1, 2, 3)])
    now[0] += 1.0
    busy = list(range(100, 5100))
    assert len(slots.plan([start(k) for k in busy]).rows) == len(busy)
    now[0] += 2.6  # 1..3 idle 3.6 s > 3.5 s; the 5000 idle 2.6 s
    CountingTime.compared = 0
    assert sorted(slots.sweep()) == [1, 2, 3]
    assert CountingTime.compared <= 4
    CountingTime.compared = 0
    slots.plan([step(100)])
    assert CountingTime.compared <= 1
    assert slots.live == len(busy)
    now[0] += 0.95  # 101.. idle 3.55 s; 100 was touched 0.95 s ago, so it goes last and stays
    assert sorted(slots.sweep()) == busy[1:]
    assert [k for k in (1, 100, 101) if k in slots] == [100]


class ReferenceSlots:
    """The sweep's meaning, spelled out plainly: every sequence idle past the deadline goes, except kept ones."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.seen: dict[int, float] = {}

    def sweep(self, now: float, keep: set[int]) -> set[int]:
        stale = {k for k, t in self.seen.items() if t < now - self.limit and k not in keep}
        for k in stale:
            del self.seen[k]
        return stale

    def plan(self, now: float, ops: list[tuple[int, bool, bool]]) -> list[int]:
        self.sweep(now, {k for k, _, _ in ops})
        rows = []
        for row, (k, is_start, _) in enumerate(ops):
            if is_start or k in self.seen:
                self.seen[k] = now
                rows.append(row)
        for k, _, is_end in ops:
            if is_end:
                self.seen.pop(k, None)
        return rows


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.75, 3.5, 4.0]),
            st.lists(st.tuples(st.integers(1, 8), st.booleans(), st.booleans()), max_size=5, unique_by=lambda o: o[0]),
            st.one_of(st.none(), st.sets(st.integers(1, 8))),
        ),
        max_size=25,
    )
)
def test_sweep_semantics_match_the_plain_reading(
    rounds: list[tuple[float, list[tuple[int, bool, bool]], set[int] | None]],
) -> None:
    """Random steps, starts, ends, clock moves and direct sweeps: who is swept, and when, is the plain reading's."""
    clock = FakeClock()
    slots = SequenceSlots(capacity=16, idle_timeout_s=1.0, grace_s=0.5, clock=clock)
    ref = ReferenceSlots(1.5)
    for dt, ops, keep in rounds:
        clock.now += dt
        if keep is not None:
            assert set(slots.sweep(keep=keep)) == ref.sweep(clock.now, keep)
        plan = slots.plan([SequenceControls(correlation_id=k, start=s, end=e) for k, s, e in ops])
        assert list(plan.rows) == ref.plan(clock.now, ops)
        slots.finish(plan)
        assert {k for k in range(1, 9) if k in slots} == set(ref.seen)


# --- default sequence strategy ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "strategy"),
    [
        ({}, "direct"),
        ({"max_sequence_idle_microseconds": 5000000}, "direct"),
        ({"direct": {}}, "direct"),
        ({"direct": {"max_queue_delay_microseconds": 100}}, "direct"),
        ({"oldest": {}}, "oldest"),
        ({"oldest": {"max_candidate_sequences": 4}}, "oldest"),
    ],
)
def test_strategy_defaults_to_direct_like_triton(section: dict[str, object], strategy: str) -> None:
    """A sequence_batching section with neither direct nor oldest is direct; an empty block still selects."""
    assert SequenceBatching.from_model_config(_config(section)).strategy == strategy


# --- refusal markers ------------------------------------------------------------------------------------


def test_refusal_messages_start_with_their_markers() -> None:
    """'unknown' and 'capacity' refusals begin with their stable marker, then name the sequence and what to do."""
    slots = SequenceSlots(capacity=1, idle_timeout_s=1.0, clock=FakeClock())
    slots.plan([start(1)])
    plan = slots.plan([start(2), step(3)])
    capacity, unknown = plan.errors[0], plan.errors[1]
    assert capacity.reason == "capacity"
    assert capacity.message.startswith(markers.SEQUENCE_CAPACITY + " ")
    assert "sequence 2" in capacity.message
    assert "retry later" in capacity.message
    assert unknown.reason == "unknown"
    assert unknown.message.startswith(markers.SEQUENCE_UNKNOWN + " ")
    assert "sequence 3" in unknown.message
    assert "START" in unknown.message
    assert markers.marker_in("rpc error: " + unknown.message) == markers.SEQUENCE_UNKNOWN
    assert markers.marker_in("sequence 3 is unknown") is None


def test_markers_module_imports_nothing() -> None:
    """_markers.py has no import statement, so the client can load it with no dependency at all."""
    tree = ast.parse(Path(markers.__file__).read_text())
    assert [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)] == []
    assert len(set(markers.MARKERS)) == len(markers.MARKERS) == 4  # unknown, capacity, busy, invalid input


# --- END-only requests in the plan --------------------------------------------------------------------


def test_end_only_closes_without_a_step() -> None:
    """END with no data: no step row, its slot reported in closes, freed at finish; START+END reports nothing."""
    slots = SequenceSlots(capacity=4, idle_timeout_s=1.0, clock=FakeClock())
    first = slots.plan([start(1), start(2)])
    plan = slots.plan([step(1, end=True), step(2)], has_data=[False, True])
    assert plan.rows == (1,)
    assert plan.closes == {0: first.slots[0]}
    assert plan.ending == (1,)
    assert slots.live == 2
    slots.finish(plan)
    assert slots.live == 1
    assert 1 not in slots
    empty = slots.plan([start(7, end=True), start(2, end=True)], has_data=[False, False])
    assert empty.rows == ()
    assert empty.closes == {0: None, 1: None}
    slots.finish(empty)
    assert slots.live == 0  # the live 2 was restarted empty and closed


def test_end_only_for_an_unknown_sequence_is_refused() -> None:
    """END with no data for a sequence this instance does not hold: the same 'unknown' refusal as a step."""
    slots = SequenceSlots(capacity=2, idle_timeout_s=1.0, clock=FakeClock())
    plan = slots.plan([step(5, end=True)], has_data=[False])
    assert plan.closes == {}
    assert plan.errors[0].reason == "unknown"
    assert plan.errors[0].message.startswith(markers.SEQUENCE_UNKNOWN)


def test_state_read_reports_without_stepping() -> None:
    """read() gives count/mean/var as they stand, the same in numpy and torch, and changes nothing."""
    host = NumpyMoments(capacity=2, dim=2)
    dev = RunningMoments(capacity=2, dim=2)
    x = np.array([[1.0, 2.0]], np.float32)
    for v in (x, x * 3):
        host.step(np.array([1]), v, np.array([v is x]))
        dev.step(torch.tensor([1]), torch.from_numpy(v.copy()), torch.tensor([v is x]))
    for state, got in ((host, host.read(np.array([1, 0]))), (dev, dev.read(torch.tensor([1, 0])))):
        count, mean, var = (to_host(t) for t in got)
        np.testing.assert_array_equal(count, [2.0, 0.0])
        np.testing.assert_array_equal(mean, [[2.0, 4.0], [0.0, 0.0]])
        np.testing.assert_array_equal(var, [[1.0, 4.0], [0.0, 0.0]])
        assert float(to_host(state.count)[1]) == 2.0
