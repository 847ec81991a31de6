"""solver.gather: backward steps moved together so the runtime runs them in one autograd call,
judged by the simulator (valid, no higher peak, the same time); plan_of_schedule reads a gathered
schedule as its plan; the simulator refuses a backward before a consumer's."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from solver import InfeasibleBudget, ScheduleInvalid, Stage, gather_backwards, no_recompute, simulate, solve
from solver import baselines as B
from solver.plan import plan_of_schedule, to_schedule
from solver.schedule import SolverInfo
from solver.synthetic import chain, problem_zoo, resnet

ZOO = problem_zoo()


def recomputing_convolution_inputs(problem):
    """A deterministic recomputing schedule: every state and value kept but each convolution's
    (its state made from its input in its own stage) and that input's (recomputed with grad
    there): each such stage computes the input, makes the convolution's state and runs its
    backward, the input's backward comes a stage later, and other backward steps run between."""
    an = B.analysis(problem)
    convs = {i for i, nd in enumerate(problem.nodes) if nd.op == "conv2d"}
    inputs = {an.idx[problem.nodes[i].inputs[0]] for i in convs if problem.nodes[i].inputs} - convs
    F = {i for i in range(an.n) if an.rb[i]} - convs - inputs
    return B.policy_schedule(problem, F=F, K=set(range(an.n)) - inputs)


def _steps_without_grad_flags(schedule) -> Counter:
    return Counter((s.op, s.node, s.impl) for st in schedule.stages for s in st.steps)


def _blocks_adjacent(schedule) -> bool:
    """Every backward step of a moved node sits right after another backward step."""
    flat = [s for st in schedule.stages for s in st.steps]
    own = {st.name: st for st in schedule.stages}
    for k, s in enumerate(flat):
        if s.op == "backward" and not any(
            x.op == "backward" and x.node == s.node for x in own[f"backward:{s.node}"].steps
        ):
            if flat[k - 1].op != "backward":
                return False
    return True


def _gradient_orders(problem, schedule) -> dict[str, list[str]]:
    """Per value, its consumers' backward steps in the order they run: the order its gradient's
    parts are added in (plain PyTorch's sum, bit for bit, only in the same order)."""
    reads = {nd.name: set(nd.inputs) for nd in problem.nodes}
    orders: dict[str, list[str]] = {}
    for stage in schedule.stages:
        for s in stage.steps:
            if s.op == "backward":
                for x in reads[s.node]:
                    orders.setdefault(x, []).append(s.node)
    return orders


@pytest.mark.parametrize("frac", [0.4, 0.6])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_gathering_keeps_the_steps_time_and_peak(name, frac):
    """On every zoo problem, the solve's schedule and the sqrt(n) baseline's, gathered: valid in the
    simulator, the same steps (only stateless nodes' grad flags may change), the same time, a peak
    no higher, moved steps right after another backward, every gradient's parts added in the same
    order; plan_of_schedule gives the same plan."""
    problem = ZOO[name]
    an = B.analysis(problem)
    budget = int(frac * no_recompute(problem).predicted_peak_bytes)
    try:
        solved = solve(problem, budget, time_limit=4, verbose=False, gather=False)
    except InfeasibleBudget:  # (below this problem's minimum, or nothing found: the baseline alone)
        solved = None
    for schedule in [s for s in (solved, B.chen_sqrt(problem)) if s is not None]:
        before = simulate(problem, schedule)
        gathered = gather_backwards(problem, schedule)
        after = simulate(problem, gathered)
        assert after.time_s == pytest.approx(before.time_s, rel=1e-12)
        assert after.peak_bytes <= before.peak_bytes
        assert gathered.predicted_peak_bytes == after.peak_bytes
        assert _steps_without_grad_flags(gathered) == _steps_without_grad_flags(schedule)
        assert _blocks_adjacent(gathered)
        assert _gradient_orders(problem, gathered) == _gradient_orders(problem, schedule)
        plan = to_schedule(an, plan_of_schedule(an, gathered), "x", SolverInfo(name="x"))
        again = simulate(problem, plan)
        assert again.time_s == pytest.approx(before.time_s, rel=1e-9)
        assert again.peak_bytes <= before.peak_bytes


def test_gathering_moves_backward_steps_of_a_recomputing_schedule_together():
    """A recomputing schedule of a residual DAG: blocks are formed (meta says how many), each
    block's backward steps follow each other, and nothing is gathered in a schedule whose backward
    steps already follow each other (no recomputation)."""
    problem = resnet(50, seed=3)
    schedule = recomputing_convolution_inputs(problem)
    gathered = gather_backwards(problem, schedule)
    info = gathered.meta["gathered_backwards"]
    assert info["blocks"] >= 1 and info["moved_steps"] >= info["blocks"]
    assert simulate(problem, gathered).peak_bytes <= simulate(problem, schedule).peak_bytes
    assert _gradient_orders(problem, gathered) == _gradient_orders(problem, schedule)

    def backs(stage):
        return {s.node for s in stage.steps if s.op == "backward"}

    moved_out = [a.name for a, b in zip(schedule.stages, gathered.stages) if backs(a) - backs(b)]
    assert len(moved_out) == info["moved_steps"]
    plain = no_recompute(problem)
    assert gather_backwards(problem, plain) is plain
    solved = solve(problem, 0.6, time_limit=4, verbose=False, gather=True)
    assert simulate(problem, solved).peak_bytes == solved.predicted_peak_bytes


def test_simulator_refuses_a_backward_before_a_consumers_backward():
    """A node's backward must come after every consumer's: a consumer's backward moved after it
    would add to a gradient already used (wrong gradients), and is refused, naming both."""
    problem = resnet(50, seed=3)
    s = no_recompute(problem)
    users: dict[str, list[str]] = {}
    for nd in problem.nodes:
        for x in nd.inputs:
            users.setdefault(x, []).append(nd.name)
    order = [st.name.split(":", 1)[1] for st in s.stages[1:]]
    x = next(n for n in reversed(order) if len([u for u in users.get(n, []) if u in order]) >= 2)
    late = max((u for u in users[x] if u in order), key=order.index)  # its consumers' last backward
    stages = []
    for st in s.stages:
        steps = [step for step in st.steps if not (step.op == "backward" and step.node == late)]
        if st.name == f"backward:{x}":
            steps.append(
                next(step for step in s.stages[1 + order.index(late)].steps if step.op == "backward")
            )
        stages.append(Stage(st.name, tuple(steps)))
    with pytest.raises(ScheduleInvalid, match=rf"{late}.*gradient for '{x}', whose backward already ran"):
        simulate(problem, dataclasses.replace(s, stages=tuple(stages)))


def test_gathering_never_raises_the_peak_where_a_whole_run_would():
    """On chains at tight budgets (recomputation everywhere), every gathered schedule's peak is at
    most the original's, whether or not the full blocks would have fit."""
    for seed in range(4):
        problem = chain(12, seed=seed)
        for frac in (0.3, 0.5):
            budget = int(frac * no_recompute(problem).predicted_peak_bytes)
            for schedule in (B.chen_sqrt(problem), B.greedy(problem, budget)):
                if schedule is None:
                    continue
                gathered = gather_backwards(problem, schedule)
                assert simulate(problem, gathered).peak_bytes <= simulate(problem, schedule).peak_bytes
