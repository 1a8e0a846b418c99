"""Pure unit tests of triton_npu_client.server: no Triton, CPU torch and numpy, injected clock (no sleeping)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from triton_npu_client.server import (
    Accelerators,
    DeviceChoice,
    NumpyMoments,
    RunningMoments,
    SequenceBatching,
    SequenceControls,
    SequenceSlots,
    accelerator_possible,
    choose_device,
    instance_index,
    model_parameter,
    parse_device_ids,
    read_controls,
    to_host,
)


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
