"""Delayed scaling's scales, made once a step for every amax history rolled together (`amax_history.AmaxHistory.scale`).

A step's scales do not change until the next step's roll, so they are made for the whole model in a few kernels the
first time one is asked for, where each layer took its own (and an eager layer's every call took six a history)."""

from __future__ import annotations

import pytest
import torch

from megalm.precision import fp8
from megalm.precision.layer_state import LinearState, set_steps
from tests.conftest import LaunchedOps

FORMATS = {"x": fp8.E4M3, "w": fp8.E4M3, "dy": fp8.E5M2}


def rolled_states(layers: int, seed: int, steps: int = 2) -> list[LinearState]:
    """`layers` layers' states after `steps` steps of random amaxes (the first roll allocates the rings)."""
    g = torch.Generator().manual_seed(seed)
    states = [LinearState(f"layer{i}", amax_history_len=4) for i in range(layers)]
    for step in range(steps):
        for state in states:
            for history in state.amax.values():
                history.pending = [torch.rand((), generator=g) * 10 for _ in range(2)]
        set_steps(states, step + 1)
    return states


def asked(states: list[LinearState]) -> list[torch.Tensor]:
    return [state.amax[name].scale(None, dtype) for state in states for name, dtype in FORMATS.items()]


def test_a_steps_scales_are_made_once_for_every_history_rolled_together():
    """The same few ops for 4 layers as for 40, none when asked again within the step, each scale the one-history
    `scale_from_amax(history.amax())` to the bit and 16 bytes aligned (a compiled graph's input). The first roll
    allocates every ring in a fixed number of ops too."""
    counted = {}
    for layers in (4, 40):
        states = [LinearState(f"layer{i}", amax_history_len=4) for i in range(layers)]
        for state in states:
            for history in state.amax.values():
                history.pending = [torch.tensor(float(layers))]
        with LaunchedOps() as first_roll:
            set_steps(states, 1)
        states = rolled_states(layers, seed=layers)
        with LaunchedOps() as made:
            scales = asked(states)
        with LaunchedOps() as again:
            assert all(a is b for a, b in zip(asked(states), scales, strict=True))
        assert again.ops == []
        histories = [(state.amax[name], dtype) for state in states for name, dtype in FORMATS.items()]
        for scale, (history, dtype) in zip(scales, histories, strict=True):
            assert torch.equal(scale, fp8.scale_from_amax(history.history.amax(), dtype))
            assert scale.storage_offset() * scale.element_size() % 16 == 0
        kernels = sorted(op for op in first_roll.ops if op != "aten.empty")  # an allocation launches no kernel
        counted[layers] = (kernels, sorted(made.ops))
    assert counted[4] == counted[40], counted
    assert len(counted[4][1]) <= 2 * 10, counted[4]  # two formats: stack, non-finite amaxes out, amax, the scale each


@pytest.mark.parametrize("change", ["written in place", "replaced", "replaced at the same version", "loaded",
                                    "rolled"])
def test_a_history_changed_since_its_scale_was_made_is_scaled_by_what_it_holds(change):
    """Its scale is made again from its contents, whatever changed it: a write in place, another tensor (even one
    whose version counter reads the same), a checkpoint's load or the next step's roll; the other layers' scales
    stay right."""
    states = rolled_states(3, seed=0)
    before = asked(states)
    history = states[1].amax["x"]
    if change == "written in place":
        history.history[2] = 1000.0
    elif change.startswith("replaced"):
        ring = torch.full((4,), 500.0)
        while change.endswith("version") and ring._version < history.history._version:
            ring.add_(0.0)
        assert change == "replaced" or ring._version == history.history._version
        history.history = ring
    elif change == "loaded":
        history.load_state_dict({"history": torch.full((4,), 250.0), "count": 9, "pending": None})
    else:
        for state in states:
            state.amax["x"].pending = [torch.tensor(2000.0)]
        set_steps(states, 3)
    after = asked(states)
    for state, name in ((s, n) for s in states for n in FORMATS):
        expected = fp8.scale_from_amax(state.amax[name].history.amax(), FORMATS[name])
        assert torch.equal(after.pop(0), expected), (state.name, name)
    assert not torch.equal(history.scale(None, fp8.E4M3), before[3])


def test_a_ring_of_another_length_is_scaled_once_a_step_in_a_group_of_its_own():
    """A checkpoint may restore a ring of another length than the layer's (`amax_history_len` changed): the next roll
    groups it apart, and asking for every scale again within the step launches nothing."""
    states = rolled_states(3, seed=1)
    states[0].amax["dy"].load_state_dict({"history": torch.rand(6) * 10, "count": 6, "pending": None})
    for state in states:
        for history in state.amax.values():
            history.pending = [torch.tensor(3.0)]
    set_steps(states, 3)
    scales = asked(states)
    with LaunchedOps() as again:
        asked(states)
    assert again.ops == []
    for scale, (state, name) in zip(scales, [(s, n) for s in states for n in FORMATS], strict=True):
        assert torch.equal(scale, fp8.scale_from_amax(state.amax[name].history.amax(), FORMATS[name]))
