"""Restores: a value read back out of a consumer's backward state (a zero-packed convolution's
packed input) instead of recomputed. The problem offers them, the simulator judges them, the
MILP chooses them, and the runtime runs them with the plain model's gradients."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import solver
from monet_opt.bench import loss_of
from monet_opt.calibrate import calibrate_on_schedule
from monet_opt.memory import measure_peak
from monet_opt.node_timer import RESTORE, NodeTimer
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from monet_opt.runtime.executor import ScheduleRuntimeError
from solver import Impl, Node, Problem, ProblemError, Restore, ScheduleInvalid, Stage, Step
from solver.plan import Analysis, lazy_plan, to_schedule, with_restores
from solver.schedule import SolverInfo
from solver.synthetic import resnet
from solver.synthetic import with_restores as synthetic_restores
from tests import models

K = 1000


def hand_problem() -> Problem:
    """conv0 -> relu (bit-mask state) -> conv1 (may keep relu's output packed) -> bn -> bn2 -> loss.
    Keeping conv1's packed state, bn's stage restores relu's output instead of recomputing conv0."""

    def node(name, inputs, impls, size=K, **kw):
        op = name.rstrip("0123456789")
        return Node(name, op, inputs, size, impls, grad_bytes=size, requires_backward=True, **kw)

    return Problem(
        (
            node("conv0", (), (Impl("default", 1.0, 2.0),)),
            node(
                "relu",
                ("conv0",),
                (Impl("bitmask", 0.01, 0.01, state_bytes=40, grad_in_place=0),),
                restores=(Restore("restore_from:conv1", "conv1", "packed", 0.001),),
            ),
            node(
                "conv1",
                ("relu",),
                (Impl("default", 1.0, 2.0, keeps_inputs=(0,)), Impl("packed", 1.0, 2.0, state_bytes=100)),
            ),
            node("bn", ("conv1",), (Impl("default", 0.01, 0.02, keeps_inputs=(0,)),)),
            node("bn2", ("bn",), (Impl("default", 0.01, 0.02, keeps_inputs=(0,)),)),
            node("loss", ("bn2",), (Impl("default", 0.001, 0.001, keeps_inputs=(0,)),), 4, is_output=True),
        ),
        "hand",
    )


def restores_in(schedule) -> list[str]:
    return [
        s.node
        for st in schedule.stages
        for s in st.steps
        if s.op == "compute" and s.impl.startswith("restore")
    ]


def test_problem_with_restores_round_trips_and_is_validated(tmp_path):
    p = synthetic_restores(resnet(30, seed=3))
    assert sum(len(n.restores) for n in p.nodes) >= 4
    p.to_json(tmp_path / "p.json")
    assert Problem.from_json(tmp_path / "p.json") == p
    nodes = list(hand_problem().nodes)
    bad = dataclasses.replace(nodes[1], restores=(Restore("restore_from:bn", "bn", "default", 0.0),))
    with pytest.raises(ProblemError, match="'bn' is not a node that reads 'relu'"):
        Problem((*nodes[:1], bad, *nodes[2:]), "x")
    bad = dataclasses.replace(nodes[1], restores=(Restore("r", "conv1", "zero_packed_input", 0.0),))
    with pytest.raises(ProblemError, match="no implementation 'zero_packed_input'"):
        Problem((*nodes[:1], bad, *nodes[2:]), "x")


def test_milp_restores_where_it_saves_a_recomputation_and_the_simulator_agrees():
    p = hand_problem()
    s = solver.solve(p, 3400, time_limit=10, verbose=False)
    assert restores_in(s) == ["relu"]
    sim = solver.simulate(p, s)
    assert sim.peak_bytes <= 3400
    assert sim.time_s == pytest.approx(s.predicted_time_s)
    # without the restore the same budget costs a recomputation of conv0
    plain = dataclasses.replace(p, nodes=tuple(dataclasses.replace(n, restores=()) for n in p.nodes))
    assert (
        solver.solve(plain, 3400, time_limit=10, verbose=False).predicted_time_s >= s.predicted_time_s + 0.9
    )


def test_simulator_rejects_restores_without_the_consumers_state_or_outside_the_backward():
    p = hand_problem()
    s = solver.solve(p, 3400, time_limit=10, verbose=False)
    fwd = s.stages[0]
    # conv1 computed without grad: no state to restore from
    no_state = tuple(dataclasses.replace(x, grad=False) if x.node == "conv1" else x for x in fwd.steps)
    with pytest.raises(ScheduleInvalid, match="state of 'conv1' made with 'packed', which is not held"):
        solver.simulate(p, dataclasses.replace(s, stages=(Stage("forward", no_state), *s.stages[1:])))
    early = (*fwd.steps, Step("compute", "relu", "restore_from:conv1", False))
    with pytest.raises(ScheduleInvalid, match="only in a backward stage"):
        solver.simulate(p, dataclasses.replace(s, stages=(Stage("forward", early), *s.stages[1:])))


def test_restore_pass_never_costs_time_or_memory():
    p = synthetic_restores(resnet(30, seed=3))
    an = Analysis(p)
    impl = an.default_impls()
    F = set()
    for i in range(an.n):  # keep every restoring consumer's packed state and the ReLUs' bit masks
        for c, mc, _r in an.restores[i]:
            impl[c], impl[i] = mc, an.impl_index(i, "bitmask")
            F |= {c, i}
    plan = lazy_plan(an, impl, F, set())
    info = SolverInfo("test", "heuristic", None, 0.0)
    before = to_schedule(an, plan, "lazy", info)
    after = to_schedule(an, with_restores(an, plan), "lazy+restores", info)
    assert restores_in(after)
    assert after.predicted_time_s < before.predicted_time_s
    assert after.predicted_peak_bytes <= before.predicted_peak_bytes


def _restoring_schedule(model, x):
    """A lazy plan over the real problem that keeps every zero-packed consumer's state and the
    ReLUs' bit masks, with every recomputation a consumer's state can replace restored."""
    p = build_problem(model, (x,), progress=False, repeats=1, zero_pack=True)
    # (restores made free: `with_restores` takes one only if it is no slower than the ReLU's
    # recomputation, and both are a few measured microseconds on a busy machine)
    free = [
        dataclasses.replace(n, restores=tuple(dataclasses.replace(r, time=0.0) for r in n.restores))
        for n in p.nodes
    ]
    an = Analysis(dataclasses.replace(p, nodes=tuple(free)))
    impl = an.default_impls()
    F = set()
    for i in range(an.n):
        for c, mc, _r in an.restores[i]:
            impl[c], impl[i] = mc, an.impl_index(i, "bitmask")
            F |= {c, i}
    plan = with_restores(an, lazy_plan(an, impl, F, set()))
    return p, to_schedule(an, plan, "lazy+restores", SolverInfo("test", "heuristic", None, 0.0))


def test_profile_offers_restores_only_with_zero_pack():
    torch.manual_seed(0)
    model, x = models.narrow_resnet()
    model.train()
    p = build_problem(model, (x,), progress=False, repeats=1, zero_pack=True)
    restoring = [n for n in p.nodes if n.restores]
    assert restoring and all(n.op == "relu" for n in restoring)
    for n in restoring:
        for r in n.restores:
            assert r.consumer_impl == "zero_packed_input" and 0 < r.time < 0.01
            assert n.name in p.node(r.consumer).inputs
    q = build_problem(model, (x,), progress=False, repeats=1)
    assert not any(n.restores for n in q.nodes)


def test_wrapper_restores_with_equal_gradients_and_predicted_memory():
    torch.manual_seed(0)
    model, x = models.narrow_resnet()
    model.train()
    p, schedule = _restoring_schedule(model, x)
    n_restores = len(restores_in(schedule))
    assert n_restores >= 3
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    wrapped = MonetWrapper(ours, schedule, example_inputs=(x,))
    loss_of(plain(x)).backward()
    timer = NodeTimer(wrapped.executor, (x,))
    timer.recording = True
    loss_of(wrapped(x)).backward()
    timer.close()
    assert sum(len(v) for (kind, _), v in timer.times.items() if kind == RESTORE) == n_restores
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
        b.grad = None
    peak = measure_peak(lambda: loss_of(wrapped(x)).backward()).peak_bytes
    predicted = schedule.predicted_peak_bytes
    assert peak <= predicted + 256 and predicted - peak <= 0.05 * predicted, (peak, predicted)
    # the schedule calibration times the restores where they run
    corrected = calibrate_on_schedule(model, (x,), p, schedule, steps=1)
    used = {
        s.node: s.impl for st in schedule.stages for s in st.steps if s.impl and s.impl.startswith("restore")
    }
    for name, impl in used.items():
        new = next(r for r in corrected.node(name).restores if r.name == impl)
        old = next(r for r in p.node(name).restores if r.name == impl)
        assert new.time != old.time


def test_wrapper_refuses_restores_it_cannot_run():
    torch.manual_seed(0)
    model, x = models.narrow_resnet()
    model.train()
    _p, schedule = _restoring_schedule(model, x)
    name = restores_in(schedule)[0]

    def retarget(step, impl):
        return (
            dataclasses.replace(step, impl=impl)
            if step.impl and step.impl.startswith("restore") and step.node == name
            else step
        )

    wrong = dataclasses.replace(
        schedule,
        stages=tuple(
            Stage(st.name, tuple(retarget(s, "restore_from:fc") for s in st.steps)) for st in schedule.stages
        ),
    )
    with pytest.raises(ScheduleRuntimeError, match="which does not read it"):
        MonetWrapper(copy.deepcopy(model), wrong, example_inputs=(x,))
