"""The solver's contract: torch-free import, JSON round trips, clear errors, simulator validity checks."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from solver import (
    FingerprintMismatch,
    InfeasibleBudget,
    Problem,
    ProblemError,
    Schedule,
    ScheduleError,
    ScheduleInvalid,
    Stage,
    Step,
    min_feasible_lower_bound,
    no_recompute,
    simulate,
    solve,
)
from solver import baselines as B
from solver.formulation import Formulation
from solver.plan import emit
from solver.synthetic import chain, random_dag, resnet


def test_import_solver_pulls_no_torch():
    code = (
        "import sys, solver, solver.milp, solver.formulation, solver.local_search, solver.baselines, solver.bounds, solver.synthetic; "
        "sys.exit(1 if any(m == 'torch' or m.startswith('torch.') for m in sys.modules) else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr or "importing solver imported torch"


@pytest.mark.parametrize(
    "make", [lambda: chain(8, seed=1), lambda: resnet(50, seed=2), lambda: random_dag(12, 3)]
)
def test_problem_and_schedule_json_round_trip(tmp_path, make):
    p = make()
    p.to_json(tmp_path / "p.json")
    q = Problem.from_json(tmp_path / "p.json")
    assert q == p
    s = no_recompute(p)
    s.to_json(tmp_path / "s.json")
    s2 = Schedule.from_json(tmp_path / "s.json")
    assert s2.stages == s.stages
    assert s2.predicted_peak_bytes == s.predicted_peak_bytes
    assert simulate(q, s2).peak_bytes == s.predicted_peak_bytes


def test_corrupt_and_wrong_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        Problem.from_json(bad)
    with pytest.raises(ValueError, match="corrupt"):
        Schedule.from_json(bad)
    p = chain(6)
    d = p.to_dict()
    with pytest.raises(ProblemError, match="kind"):
        Problem.from_dict({**d, "kind": "something else"})
    with pytest.raises(ProblemError, match="format_version"):
        Problem.from_dict({**d, "format_version": 99})
    sd = no_recompute(p).to_dict()
    f = tmp_path / "s.json"
    f.write_text(json.dumps({**sd, "format_version": 99}))
    with pytest.raises(ScheduleError, match="format_version"):
        Schedule.from_json(f)
    with pytest.raises(ScheduleError, match="kind"):
        Schedule.from_dict({**sd, "kind": "nope"})
    # JSON text where a path belongs: says so (not an OSError quoting the whole text as a name)
    with pytest.raises(TypeError, match="got JSON text"):
        Schedule.from_json(json.dumps(sd))


def test_fingerprint_mismatch():
    a, b = chain(8, seed=1), chain(8, seed=2)
    s = no_recompute(a)
    with pytest.raises(FingerprintMismatch, match="solve again"):
        simulate(b, s)


def _with_stages(s: Schedule, stages) -> Schedule:
    return Schedule(**{**s.__dict__, "stages": tuple(stages)})


def test_simulator_rejects_invalid_schedules():
    p = chain(6, seed=0)
    s = no_recompute(p)
    fwd = list(s.stages[0].steps)
    names = [n.name for n in p.nodes]
    # value used before it exists: swap the first two computes
    computes = [st for st in fwd if st.op == "compute"]
    bad_fwd = [computes[1], computes[0]] + fwd[2:]
    with pytest.raises(ScheduleInvalid, match=rf"stage 'forward'.*{names[1]}.*{names[0]}"):
        simulate(p, _with_stages(s, [Stage("forward", tuple(bad_fwd))] + list(s.stages[1:])))
    # freed value used: free node 0 right after computing it
    bad_fwd = [fwd[0], Step("free_value", names[0])] + fwd[1:]
    with pytest.raises(ScheduleInvalid, match=rf"{names[1]}.*{names[0]}.*not available"):
        simulate(p, _with_stages(s, [Stage("forward", tuple(bad_fwd))] + list(s.stages[1:])))
    # backward without state: forward with grad=False everywhere
    nograd = [Step(st.op, st.node, st.impl, False) if st.op == "compute" else st for st in fwd]
    first_bw = s.stages[1].name
    with pytest.raises(ScheduleInvalid, match=rf"{first_bw}.*no backward state"):
        simulate(p, _with_stages(s, [Stage("forward", tuple(nograd))] + list(s.stages[1:])))
    # missing backward
    with pytest.raises(ScheduleInvalid, match="never run backward"):
        simulate(p, _with_stages(s, list(s.stages[:-1])))


def test_recomputing_a_held_view_keeps_its_hold():
    """Regression: recomputing a view whose handle is held must not drop the view's hold on the base."""
    from solver import Impl, Node, SolverInfo

    p = Problem(
        nodes=(
            Node("a", "conv", (), 100, (Impl("d", 1, 1),), grad_bytes=100, requires_backward=True),
            Node(
                "v", "view", ("a",), 0, (Impl("d", 1, 1),), alias_of=0, grad_bytes=100, requires_backward=True
            ),
            Node(
                "b",
                "loss",
                ("v",),
                4,
                (Impl("d", 1, 1, keeps_inputs=(0,)),),
                grad_bytes=4,
                requires_backward=True,
                is_output=True,
            ),
        ),
        fingerprint="x",
    )
    fwd = (
        Step("compute", "a", "d", True),
        Step("compute", "v", "d", True),
        Step("compute", "v", "d", True),
        Step("free_value", "a"),
        Step("compute", "b", "d", True),
        Step("free_value", "v"),
    )
    stages = [Stage("forward", fwd)] + [Stage(f"backward:{x}", (Step("backward", x),)) for x in "bva"]
    s = Schedule("x", None, 0, 0.0, SolverInfo("t"), "t", tuple(stages))
    sim = simulate(p, s)
    # a's storage (100) is held by v, then by b's state, until b's backward
    assert [live for st, _k, live in sim.timeline if st == "forward"] == [100, 100, 100, 100, 104, 104]


# -- recompute times --------------------------------------------------------------------


def _with_recompute_time(p, factor):
    nodes = [
        dataclasses.replace(
            n, impls=tuple(dataclasses.replace(i, recompute_time=factor * i.fwd_time) for i in n.impls)
        )
        for n in p.nodes
    ]
    return dataclasses.replace(p, nodes=tuple(nodes))


def test_simulator_charges_recompute_time_for_recomputations_only():
    """A node's first compute step costs fwd_time, each later one recompute_time (counted here
    step by step, independently of the simulator)."""
    p = _with_recompute_time(resnet(), 0.25)
    s = B.chen_sqrt(p)
    assert s.recomputed()
    impls = {n.name: {i.name: i for i in n.impls} for n in p.nodes}
    seen: set[str] = set()
    state: dict = {}  # node -> the implementation whose backward state is held
    expected = 0.0
    for stage in s.stages:
        for step in stage.steps:
            if step.op == "compute":
                im = impls[step.node][step.impl]
                expected += im.recompute_time if step.node in seen else im.fwd_time
                seen.add(step.node)
                if step.grad:
                    state[step.node] = im
            elif step.op == "backward":
                expected += state[step.node].bwd_time
    sim = simulate(p, s)
    assert sim.time_s == pytest.approx(expected, rel=1e-12)
    assert sim.time_s < simulate(dataclasses.replace(p, nodes=resnet().nodes), s).time_s


def test_milp_objective_is_the_simulated_time_with_recompute_times():
    p = _with_recompute_time(chain(8, seed=3), 0.3)
    budget = int(0.6 * B.no_recompute(p).predicted_peak_bytes)
    s = solve(p, budget, time_limit=20, verbose=False)
    sim = simulate(p, s)
    assert sim.peak_bytes <= budget
    assert s.recomputed()
    assert s.meta["milp_objective"] == pytest.approx(sim.time_s, rel=1e-6)
    # cheaper recomputation: never slower than the schedule solved with full forward times
    plain = solve(chain(8, seed=3), budget, time_limit=20, verbose=False)
    assert sim.time_s <= simulate(p, plain).time_s + 1e-9


def test_recompute_overhead_is_charged_per_backward_compute_step_and_the_milp_counts_it():
    """`Problem.recompute_overhead_s` costs each compute step in a backward stage once (counted
    here from the schedule), and the MILP's objective counts it as the simulator does."""
    base = chain(8, seed=3)
    overhead = 0.2 * min(i.fwd_time for n in base.nodes for i in n.impls if i.fwd_time > 0)
    p = dataclasses.replace(base, recompute_overhead_s=overhead)
    s = B.chen_sqrt(p)
    again = sum(1 for stage in s.stages[1:] for step in stage.steps if step.op == "compute")
    assert again > 0
    assert simulate(p, s).time_s == pytest.approx(simulate(base, s).time_s + again * overhead, rel=1e-12)
    assert simulate(p, s).recompute_time_s == pytest.approx(
        simulate(base, s).recompute_time_s + again * overhead, rel=1e-12
    )
    budget = int(0.6 * B.no_recompute(p).predicted_peak_bytes)
    solved = solve(p, budget, time_limit=20, verbose=False)
    sim = simulate(p, solved)
    assert sim.peak_bytes <= budget
    assert solved.meta["milp_objective"] == pytest.approx(sim.time_s, rel=1e-6)
    cheap = solve(base, budget, time_limit=20, verbose=False)
    assert sim.time_s <= simulate(p, cheap).time_s + 1e-9  # optimal under its own costs


def test_problem_json_keeps_the_recompute_overhead_and_refuses_a_bad_one(tmp_path):
    p = dataclasses.replace(chain(5), recompute_overhead_s=1.5e-4)
    p.to_json(tmp_path / "p.json")
    assert Problem.from_json(tmp_path / "p.json") == p
    data = json.loads((tmp_path / "p.json").read_text())
    data["format_version"] = 6
    del data["recompute_overhead_s"]
    assert Problem.from_dict(data).recompute_overhead_s == 0.0
    data["recompute_overhead_s"] = -1.0
    with pytest.raises(ProblemError, match="recompute_overhead_s"):
        Problem.from_dict(data)


def test_problem_json_keeps_recompute_time_and_reads_version_2(tmp_path):
    p = _with_recompute_time(chain(5), 0.5)
    p.to_json(tmp_path / "p.json")
    q = Problem.from_json(tmp_path / "p.json")
    assert q == p
    assert all(i.recompute_time == 0.5 * i.fwd_time for n in q.nodes for i in n.impls)
    data = json.loads((tmp_path / "p.json").read_text())
    data["format_version"] = 2
    for n in data["nodes"]:
        for i in n["impls"]:
            del i["recompute_time"]
    old = Problem.from_dict(data)
    assert all(i.recompute_time is None for n in old.nodes for i in n.impls)


def test_solve_is_silent_with_verbose_false():
    """Nothing on stdout or stderr, HiGHS' start-up banner included (printed by its C++ side on
    a process's first Highs instance)."""
    code = (
        "from solver import solve, baselines as B\n"
        "from solver.synthetic import chain\n"
        "p = chain(6)\n"
        "solve(p, int(0.7 * B.no_recompute(p).predicted_peak_bytes), time_limit=5, verbose=False)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == "", (out.stdout, out.stderr)


def test_an_older_highspy_than_the_solver_needs_is_named_before_a_solve(monkeypatch):
    """highspy 1.11-1.15 drop the plans handed to HiGHS' user-solution callback, 1.8-1.10 lack it
    and 1.7 every callback: a solve with one of them says which version it needs (an
    ImportError, which the CLI prints as an error) instead of failing or silently doing less."""
    import importlib.metadata

    from solver import solve

    p = chain(6)
    budget = int(0.7 * B.no_recompute(p).predicted_peak_bytes)
    real = importlib.metadata.version
    for old in ("1.15.1", "1.8.1", "1.7.2"):
        monkeypatch.setattr(
            importlib.metadata, "version", lambda name, v=old: v if name == "highspy" else real(name)
        )
        with pytest.raises(ImportError, match=rf"highspy >= 1\.16, found {old}"):
            solve(p, budget, time_limit=5, verbose=False)
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "1.16.0" if name == "highspy" else real(name)
    )
    assert solve(p, budget, time_limit=5, verbose=False).predicted_peak_bytes <= budget


# -- in-place forwards and shared gradient buffers -------------------------------------------


def _schedule(forward, backward_order):
    from solver import SolverInfo

    stages = [Stage("forward", tuple(forward))]
    stages += [Stage(f"backward:{x}", (Step("backward", x),)) for x in backward_order]
    return Schedule("x", None, 0, 0.0, SolverInfo("t"), "t", tuple(stages))


def _stage_ends(sim):
    """Live bytes at the end of each stage."""
    ends = {}
    for stage, _k, live in sim.timeline:
        ends[stage] = live
    return list(ends.values())


def test_simulator_counts_a_gradient_buffer_an_addition_hands_to_both_inputs_once():
    """s = c + a hands s's gradient buffer to c and to a (autograd's AddBackward): 100 bytes, not
    200, until c's backward, whose new gradient for a is then summed into a new buffer (a's is
    still c's too). Hand-counted; `grad_shared=()` gives the old count for comparison."""
    from solver import Impl, Node

    def problem(shared):
        add = Impl("d", 1, 1, grad_in_place=0, grad_shared=shared)
        return Problem(
            nodes=(
                Node("a", "conv", (), 100, (Impl("d", 1, 1),), grad_bytes=100, requires_backward=True),
                Node("c", "conv", ("a",), 100, (Impl("d", 1, 1, keeps_inputs=(0,)),), 100, None, True),
                Node("s", "add", ("c", "a"), 100, (add,), grad_bytes=100, requires_backward=True),
                Node(
                    "b",
                    "loss",
                    ("s",),
                    4,
                    (Impl("d", 1, 1, keeps_inputs=(0,)),),
                    grad_bytes=4,
                    requires_backward=True,
                    is_output=True,
                ),
            ),
            fingerprint="x",
        )

    sched = _schedule([Step("compute", x, "d", True) for x in "acsb"], "bsca")
    shared = simulate(problem((1,)), sched)
    separate = simulate(problem(()), sched)
    # forward 304 (a, c, s, b); backward b: + s's gradient 100 (the loss's gradient for b, 4,
    # fed to b's backward and let go after it)
    assert _stage_ends(shared) == [304, 404, 404, 404, 304]
    assert _stage_ends(separate) == [304, 404, 504, 404, 304]
    # c's backward: 404 + a's new gradient 100 + their sum 100 (a's gradient is shared with c)
    assert shared.peak_bytes == 604 and separate.peak_bytes == 604
    # the MILP's constants follow the same count (an upper bound of it, exact here)
    for p, sim in ((problem((1,)), shared), (problem(()), separate)):
        out = solve(p, sim.peak_bytes, time_limit=10, verbose=False, window=None)
        assert simulate(p, out).peak_bytes <= sim.peak_bytes


def test_simulator_hands_a_views_gradient_on_without_copying_it():
    """v = r.view(...) is the model output: its backward hands the loss's gradient buffer to r
    (`grad_shared` without `grad_in_place`: nothing is written into it, so nothing is copied).
    r's in-place backward then copies it (an in-place backward copies a buffer the loss made). Hand-counted;
    `grad_shared=()` (a new buffer for r) for comparison."""
    from solver import Impl, Node

    def problem(shared):
        return Problem(
            nodes=(
                Node("a", "conv", (), 100, (Impl("d", 1, 1),), grad_bytes=100, requires_backward=True),
                Node(
                    "r",
                    "relu",
                    ("a",),
                    100,
                    (Impl("d", 1, 1, keeps_output=True, grad_in_place=0),),
                    100,
                    None,
                    True,
                ),
                Node(
                    "v",
                    "view",
                    ("r",),
                    0,
                    (Impl("d", 0, 0, grad_shared=shared),),
                    grad_bytes=100,
                    alias_of=0,
                    requires_backward=True,
                    is_output=True,
                ),
            ),
            fingerprint="x",
        )

    sched = _schedule([Step("compute", x, "d", True) for x in "arv"], "vra")
    shared = simulate(problem((0,)), sched)
    separate = simulate(problem(()), sched)
    # forward 200 (a, r; v is a view); backward v: + the loss's gradient 100, which r receives
    # (shared) or beside which r gets a new 100 (separate; the loss's is let go after v's
    # backward); r: a copy of the loss's buffer (an in-place backward never writes into it)
    assert _stage_ends(shared) == [200, 300, 300, 200]
    assert shared.peak_bytes == 400  # (r's copy beside the loss's buffer)
    assert _stage_ends(separate) == [200, 300, 300, 200]
    assert Problem.from_dict(problem((0,)).to_dict()) == problem((0,))
    for p, sim in ((problem((0,)), shared), (problem(()), separate)):
        out = solve(p, sim.peak_bytes, time_limit=10, verbose=False, window=None)
        assert simulate(p, out).peak_bytes <= sim.peak_bytes


def test_simulator_writes_an_in_place_forward_into_its_freed_input():
    """r = relu(a) with fwd_in_place: when the schedule frees a right after r and nothing else
    holds a's storage, r's output is a's storage (no new bytes); not when a's state keeps it."""
    from solver import Impl, Node

    def problem(a_keeps_output):
        return Problem(
            nodes=(
                Node("a", "conv", (), 100, (Impl("d", 1, 1, keeps_output=a_keeps_output),), 100, None, True),
                Node(
                    "r",
                    "relu",
                    ("a",),
                    100,
                    (Impl("d", 1, 1, keeps_output=True, fwd_in_place=0),),
                    100,
                    None,
                    True,
                ),
                Node(
                    "b",
                    "loss",
                    ("r",),
                    4,
                    (Impl("d", 1, 1, keeps_inputs=(0,)),),
                    grad_bytes=4,
                    requires_backward=True,
                    is_output=True,
                ),
            ),
            fingerprint="x",
        )

    fwd = [
        Step("compute", "a", "d", True),
        Step("compute", "r", "d", True),
        Step("free_value", "a"),
        Step("compute", "b", "d", True),
        Step("free_value", "r"),
    ]
    sched = _schedule(fwd, "bra")
    reused = simulate(problem(False), sched)
    kept = simulate(problem(True), sched)
    assert [live for st, _k, live in reused.timeline if st == "forward"] == [100, 100, 100, 104, 104]
    assert [live for st, _k, live in kept.timeline if st == "forward"] == [100, 200, 200, 204, 204]
    # not freed right after: a new storage
    late = fwd[:1] + [fwd[1], fwd[3], fwd[2], fwd[4]]
    assert [live for st, _k, live in simulate(problem(False), _schedule(late, "bra")).timeline][:3] == [
        100,
        200,
        204,
    ]


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    """Atomic writes go through a private temporary file; the result is readable like any file
    the user writes (0666 less the umask), and a replaced file keeps its mode."""
    import os
    import stat

    s = no_recompute(chain(4, seed=0))
    old = os.umask(0o022)
    try:
        s.to_json(tmp_path / "s.json")
        assert stat.S_IMODE((tmp_path / "s.json").stat().st_mode) == 0o644
        (tmp_path / "s.json").chmod(0o640)
        s.to_json(tmp_path / "s.json")
        assert stat.S_IMODE((tmp_path / "s.json").stat().st_mode) == 0o640
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary file left


def _with_node(problem: Problem, k: int, **changes) -> Problem:
    """`problem` with node k's fields changed (validated as any problem is)."""
    nodes = list(problem.nodes)
    nodes[k] = dataclasses.replace(nodes[k], **changes)
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _read_as_older_format(problem: Problem, tmp_path, version: int, field: str) -> Problem:
    """`problem` written to JSON (it reads back unchanged), then read as a file of format
    `version`, whose nodes had no `field`."""
    path = tmp_path / "p.json"
    problem.to_json(path)
    assert Problem.from_json(path) == problem
    data = json.loads(path.read_text())
    data["format_version"] = version
    for n in data["nodes"]:
        del n[field]
    return Problem.from_dict(data)


def test_an_output_the_loss_does_not_read_gets_no_gradient(tmp_path):
    """`Node.output_grad` False (a language model's logits beside the loss it returns): the user
    holds the output, but gives it no gradient; simulator and MILP count the same."""
    base = chain(8, seed=1)
    last = base.nodes[-2]  # the value the loss reads, now also returned

    def returned(output_grad: bool) -> Problem:
        return _with_node(base, -2, is_output=True, output_grad=output_grad)

    read, unread = returned(True), returned(False)
    # the read one's gradient is made by the user and held to the step's end (the engine holds
    # it), so the gradient the loss's backward hands it is summed with it into a new buffer: two
    # buffers of the value's gradient more at the loss's backward stage
    assert simulate(read, no_recompute(read)).stage_peaks[1] == (
        simulate(unread, no_recompute(unread)).stage_peaks[1] + 2 * last.grad_bytes
    )
    budget = int(0.7 * simulate(unread, no_recompute(unread)).peak_bytes)
    s = solve(unread, budget, time_limit=20, verbose=False)
    sim = simulate(unread, s)
    assert sim.peak_bytes <= budget
    assert s.meta.get("milp_objective") is None or s.meta["milp_objective"] == pytest.approx(
        sim.time_s, rel=1e-6
    )
    # before the field (format 8): every output got a gradient
    assert _read_as_older_format(unread, tmp_path, 8, "output_grad") == read
    with pytest.raises(ProblemError, match="output_grad False on a node that is not an output"):
        _with_node(base, 2, output_grad=False)


def _language_model(user_holds: bool) -> Problem:
    """The synthetic transformer as a language model returning its loss and its logits
    (`head`, no gradient from the user); the loss's state keeps the logits."""
    from solver.problem import Impl, Node
    from solver.synthetic import transformer

    base = transformer(2, seed=8)
    nodes = list(base.nodes)
    head = nodes[-1]
    nodes[-1] = dataclasses.replace(head, is_output=True, output_grad=False, user_holds=user_holds)
    loss = Impl("default", 1e-4, 1e-4, keeps_inputs=(0,), state_bytes=8)
    nodes.append(
        Node("loss", "loss", (head.name,), 4, (loss,), grad_bytes=4, is_output=True, requires_backward=True)
    )
    return dataclasses.replace(base, nodes=tuple(nodes))


def test_an_output_the_user_drops_before_the_backward_is_freed_by_the_schedule(tmp_path):
    """`Node.user_holds` False (a loop that keeps only the loss, as Hugging Face's Trainer): the
    logits are held to the forward's end, then freed once nothing needs them; the simulator,
    the MILP's rows and the baselines count the same, and solves fit."""
    from tests.test_solver_strategies import _policy_schedules

    held, dropped = _language_model(True), _language_model(False)
    logits = held.nodes[-2].output_bytes
    a, b = simulate(held, B.no_recompute(held)), simulate(dropped, B.no_recompute(dropped))
    assert a.stage_peaks[0] == b.stage_peaks[0]  # the forward holds them either way
    assert all(y <= x for x, y in zip(a.stage_peaks, b.stage_peaks))
    # held by the loss's state through its backward, then freed: every later stage has them less
    assert [x - y for x, y in zip(a.stage_peaks[2:], b.stage_peaks[2:])] == [logits] * (
        len(a.stage_peaks) - 2
    )
    # the MILP's rows count exactly what the simulator counts, for baseline and random plans
    an = B.analysis(dropped)
    for s in _policy_schedules(dropped, 4, 4, seed=3):
        plan = B.plan_of(dropped, s)
        peak = simulate(dropped, s).peak_bytes
        form = Formulation(an, peak, warm_plan=plan)
        x = form.plan_to_vector(plan)
        assert not form.violations(x), (s.strategy, [form.md.r_tag[r] for r in form.violations(x)][:3])
        below = Formulation(an, peak - 1, warm_plan=plan)
        assert below.violations(below.plan_to_vector(plan)), "MILP accepts a plan over budget"
    # a budget under what any schedule needs while the user holds the logits solves when dropped
    budget = min_feasible_lower_bound(held) - 1
    with pytest.raises(InfeasibleBudget):
        solve(held, budget, time_limit=3, verbose=False)
    s = solve(dropped, budget, time_limit=3, verbose=False)
    assert simulate(dropped, s).peak_bytes <= budget
    # before the field (format 9): the user held every output
    assert _read_as_older_format(dropped, tmp_path, 9, "user_holds") == held
    with pytest.raises(ProblemError, match="user_holds False on a node that is not an output"):
        _with_node(held, 2, user_holds=False)


def test_a_dropped_output_is_counted_to_the_end_of_the_forward():
    """An output the user drops before the backward is still held to the forward's end: a
    returned value in the middle of the network (an auxiliary head's output) stays live through
    the rest of the forward. The peak MILP's own peak bounds its plan's simulated peak."""
    from solver.plan import to_schedule
    from solver.schedule import SolverInfo

    base = chain(8, seed=1)
    big = 8 * base.nodes[2].output_bytes  # (so that holding it to the forward's end matters)
    p = _with_node(base, 2, output_bytes=big, is_output=True, output_grad=False, user_holds=False)
    an = B.analysis(p)
    form = Formulation(an, None)
    res = form.solve_milp(10, mip_gap=0.0)
    assert res.plan is not None
    sim = simulate(p, to_schedule(an, res.plan, "milp", SolverInfo(name="highs-milp")))
    assert sim.peak_bytes <= res.x[form.peak_col] + 2  # (the column is in MiB for HiGHS)


def _conv_chain(from_inputs: bool) -> Problem:
    """a (reads the model input) -> c (a convolution keeping a; its state from its input when
    `from_inputs`) -> loss."""
    from solver import Impl, Node

    return Problem(
        nodes=(
            Node("a", "relu", (), 100, (Impl("d", 1.0, 1.0, keeps_output=True),), 100, None, True),
            Node(
                "c",
                "conv2d",
                ("a",),
                300,
                (Impl("d", 5.0, 7.0, fwd_workspace=50, keeps_inputs=(0,), bwd_from_inputs=from_inputs),),
                300,
                None,
                True,
            ),
            Node(
                "loss",
                "loss",
                ("c",),
                4,
                (Impl("d", 1.0, 1.0, keeps_inputs=(0,)),),
                grad_bytes=4,
                requires_backward=True,
                is_output=True,
            ),
        ),
        fingerprint="x",
        recompute_overhead_s=0.25,
    )


def _make_state_schedule(op: str) -> Schedule:
    """Forward keeps a and no state of c; c's own stage makes c's state (`op`) from a."""
    fwd = [
        Step("compute", "a", "d", True),
        Step("compute", "c", "d", False),
        Step("compute", "loss", "d", True),
        Step("free_value", "c"),
    ]
    make = Step("compute", "c", "d", True) if op == "compute" else Step("make_state", "c", "d")
    stages = [
        Stage("forward", tuple(fwd)),
        Stage("backward:loss", (Step("backward", "loss"),)),
        Stage(
            "backward:c",
            (make, *([Step("free_value", "c")] if op == "compute" else []), Step("backward", "c")),
        ),
        Stage("backward:a", (Step("backward", "a"),)),
    ]
    from solver import SolverInfo

    return Schedule("x", None, 0, 0.0, SolverInfo("t"), "t", tuple(stages))


def test_make_state_makes_a_state_from_held_inputs_without_the_forward(tmp_path):
    """A make_state step (Impl.bwd_from_inputs) costs the recompute overhead alone, makes no
    output and holds the kept input's storage; a recomputation with grad in its place costs the
    forward, its output and workspace. The step survives JSON; plan_of_schedule reads it back."""
    problem = _conv_chain(True)
    made = simulate(problem, _make_state_schedule("make_state"))
    recomputed = simulate(problem, _make_state_schedule("compute"))
    assert made.time_s == pytest.approx(recomputed.time_s - 5.0)
    assert made.recompute_time_s == pytest.approx(0.25)
    assert recomputed.recompute_time_s == pytest.approx(5.25)
    stage_c = [live for st, _k, live in made.timeline if st == "backward:c"]
    before = [live for st, _k, live in made.timeline if st == "backward:loss"][-1]
    assert stage_c[0] == before  # make_state adds nothing
    # c's stage: with make_state the peak is c's backward making a's gradient (100 bytes); the
    # recomputation's is c's output and forward workspace
    assert made.stage_peaks[2] == before + 100
    assert recomputed.stage_peaks[2] == before + 300 + 50
    path = tmp_path / "s.json"
    _make_state_schedule("make_state").to_json(path)
    again = Schedule.from_json(path)
    assert again.stages[2].steps[0] == Step("make_state", "c", "d")
    an = B.analysis(problem)
    plan = B.plan_of_schedule(an, again)
    assert plan.stages[1].recompute == [(1, 0, True)]
    assert B.plan_time(an, plan) == pytest.approx(made.time_s)


def test_make_state_is_refused_where_it_cannot_run():
    """Without bwd_from_inputs, in the forward, or with the input not held: the simulator names
    the step; a problem cannot mark an implementation that keeps its output or private bytes."""
    with pytest.raises(ScheduleInvalid, match="cannot make its state from its inputs"):
        simulate(_conv_chain(False), _make_state_schedule("make_state"))
    s = _make_state_schedule("make_state")
    forward = Stage("forward", (*s.stages[0].steps, Step("make_state", "c", "d")))
    with pytest.raises(ScheduleInvalid, match="only in a backward stage"):
        simulate(_conv_chain(True), _with_stages(s, (forward, *s.stages[1:])))
    dropped = Stage("backward:loss", (Step("backward", "loss"), Step("free_value", "a")))
    with pytest.raises(ScheduleInvalid, match="input 'a' is not available"):
        simulate(_conv_chain(True), _with_stages(s, (s.stages[0], dropped, *s.stages[2:])))
    from solver import Impl

    for bad in (dict(keeps_output=True), dict(state_bytes=8), dict(fwd_in_place=0)):
        impl = Impl("d", 1.0, 1.0, keeps_inputs=(0,), bwd_from_inputs=True, **bad)
        with pytest.raises(ProblemError, match="bwd_from_inputs"):
            _with_node(_conv_chain(True), 1, impls=(impl,))


def test_the_milp_makes_states_from_inputs_where_that_is_faster():
    """On a chain whose convolutions can make their state from their input, the solve's schedule
    has make_state steps, replays within budget, and is faster than the same chain's without."""
    from solver.synthetic import with_state_from_inputs

    plain = chain(12, seed=2)
    marked = with_state_from_inputs(plain)
    budget = int(0.6 * no_recompute(plain).predicted_peak_bytes)
    without = solve(plain, budget, time_limit=20, verbose=False)
    with_ = solve(marked, budget, time_limit=20, verbose=False)
    assert with_.solver.status == without.solver.status == "optimal"
    steps = [x for st in with_.stages for x in st.steps if x.op == "make_state"]
    assert steps and all(
        st.name == f"backward:{x.node}" for st in with_.stages for x in st.steps if x.op == "make_state"
    )
    sim = simulate(marked, with_)
    assert sim.peak_bytes <= budget and sim.time_s == pytest.approx(with_.predicted_time_s)
    assert with_.predicted_time_s < 0.95 * without.predicted_time_s


def test_a_state_made_from_inputs_follows_a_forward_of_its_own_implementation():
    """Two convolution implementations, one with the faster forward, the other with the faster
    backward: making the second's state beside the first's forward would price the better of
    each (measured on ResNet-50: slower, the forwards differ only by how they were timed). The
    MILP keeps a state instead; a plan that recomputes with another implementation than the
    forward's gets a compute step, at its forward time, not a make_state."""
    from solver import Impl

    both = (
        Impl("d", 5.0, 7.0, keeps_inputs=(0,), bwd_from_inputs=True),
        Impl("quick", 3.0, 9.0, keeps_inputs=(0,), bwd_from_inputs=True),
    )
    problem = _with_node(_conv_chain(True), 1, impls=both)
    s = solve(problem, no_recompute(problem).predicted_peak_bytes * 4, time_limit=20, verbose=False)
    assert not [x for st in s.stages for x in st.steps if x.op == "make_state"]
    assert s.predicted_time_s == pytest.approx(1 + 1 + 12 + 1 + 1)  # a, c kept (either), loss
    an = B.analysis(problem)
    plan = B.plan_of_schedule(an, _make_state_schedule("make_state"))  # c's state: "d", forward "d"
    plan.impl[1] = 1  # forward "quick"
    stages = emit(an, plan)
    assert Step("compute", "c", "d", True) in stages[2].steps
    assert B.plan_time(an, plan) == pytest.approx(1 + 3 + 1 + 1 + (5 + 0.25) + 7 + 1)


def test_a_computation_without_grad_has_its_own_workspace():
    """`Impl.nograd_fwd_workspace`: a step computing without grad peaks at its output plus that
    workspace (no state); with grad at its output, its state and `fwd_workspace` (autocast's
    copies of a convolution's input and weight are made, and freed, without grad too). The field
    survives JSON; None means `fwd_workspace`."""
    plain = _conv_chain(from_inputs=False)

    def with_c(impl):
        return dataclasses.replace(
            plain,
            nodes=tuple(dataclasses.replace(n, impls=(impl,)) if n.name == "c" else n for n in plain.nodes),
        )

    im = dataclasses.replace(plain.node("c").impls[0], state_bytes=30, nograd_fwd_workspace=120)
    both = with_c(im)
    schedule = _make_state_schedule("compute")  # forward: c without grad; c's stage: with grad
    without = simulate(with_c(dataclasses.replace(im, nograd_fwd_workspace=None)), schedule)
    got = simulate(both, schedule)
    assert got.stage_peaks[0] == 100 + 300 + 120  # a held, c's output and its no-grad workspace
    assert without.stage_peaks[0] == 100 + 300 + 50
    assert got.stage_peaks[2] == without.stage_peaks[2]  # the recomputation with grad: unchanged
    assert Problem.from_dict(json.loads(json.dumps(both.to_dict()))) == both
    assert im.forward_workspace(True) == 50 and im.forward_workspace(False) == 120
    bad = both.to_dict()
    bad["nodes"][1]["impls"][0]["nograd_fwd_workspace"] = -1
    with pytest.raises(ProblemError, match="node 'c' impl 'd': negative nograd_fwd_workspace"):
        Problem.from_dict(bad)
