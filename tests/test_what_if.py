"""benchmarks/what_if.py: hypothetical cost changes, solved beside the problem as it is."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from solver import synthetic

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "what_if.py"


@pytest.fixture(scope="module")
def what_if():
    return runpy.run_path(str(SCRIPT))


def test_each_scenario_changes_only_what_it_names(what_if):
    problem = synthetic.resnet(50)
    ops = {n.op for n in problem.nodes}
    assert {"conv2d", "batch_norm"} <= ops
    free_fwd = what_if["fwd_workspace_free"](problem)
    assert all(
        im.fwd_workspace == 0 and not im.nograd_fwd_workspace for n in free_fwd.nodes for im in n.impls
    )
    assert any(im.fwd_workspace > 0 for n in problem.nodes for im in n.impls)  # (there was some)
    free_bwd = what_if["bwd_workspace_free"](problem)
    assert all(im.bwd_workspace == 0 for n in free_bwd.nodes for im in n.impls)
    conv = what_if["SCENARIOS"]["conv_bwd_workspace_free"](problem)
    for before, after in zip(problem.nodes, conv.nodes):
        for a, b in zip(before.impls, after.impls):
            assert b.bwd_workspace == (0 if before.op == "conv2d" else a.bwd_workspace)
            assert (b.fwd_time, b.bwd_time, b.fwd_workspace) == (a.fwd_time, a.bwd_time, a.fwd_workspace)
    fast = what_if["inplace_batchnorm_as_fast"](problem)
    changed = 0
    for before, after in zip(problem.nodes, fast.nodes):
        default = next(im for im in before.impls if im.name == "default")
        for a, b in zip(before.impls, after.impls):
            if before.op == "batch_norm" and a.grad_in_place is not None:
                assert b.bwd_time == min(a.bwd_time, default.bwd_time)
                changed += b.bwd_time != a.bwd_time
            else:
                assert b == a
    assert changed > 0  # (synthetic in-place batch norms are slower than the default: 15 here)
    assert problem.fingerprint == fast.fingerprint  # (the same model: schedules stay comparable)
    both = what_if["apply"]("fwd_workspace_free+bwd_workspace_free", problem)
    assert all(im.fwd_workspace == 0 and im.bwd_workspace == 0 for n in both.nodes for im in n.impls)


def test_cheaper_costs_never_solve_slower(what_if, tmp_path):
    """On a small chain solved to proven optimality a scenario (costs only lowered) is never
    predicted slower than the problem as it is; the script writes one row per scenario."""
    problem = synthetic.chain(10)
    path = tmp_path / "chain.json"
    problem.to_json(path)
    budget = what_if["budget_bytes"](problem, 0.4)  # (free forward workspaces buy time there)
    rows = [what_if["solve_row"]("as measured", problem, budget, 20.0, mip_gap=1e-9)]
    # (the op-restricted workspace scenarios are cases of bwd_workspace_free: 3.5 s a solve)
    for name in ("fwd_workspace_free", "bwd_workspace_free", "inplace_batchnorm_as_fast"):
        rows.append(
            what_if["solve_row"](name, what_if["SCENARIOS"][name](problem), budget, 20.0, mip_gap=1e-9)
        )
    # (every row proven optimal: before HiGHS got polishing's starts after its presolve, session
    # 65's fwd_workspace_free row was "optimal" at 0.027678 s where its MILP's optimum is 0.027044)
    assert all(r["status"] == "optimal" for r in rows), rows
    assert all(r["peak"] <= budget for r in rows)
    assert all(r["time_s"] <= rows[0]["time_s"] * (1 + 1e-9) for r in rows[1:])
    assert any(r["time_s"] < rows[0]["time_s"] * (1 - 1e-6) for r in rows[1:])  # (one of them buys something)

    both = "fwd_workspace_free+bwd_workspace_free"
    argv = [str(path), "--budget", "0.4", "--time-limit", "5", "--scenarios", both, "--out", str(tmp_path)]
    assert what_if["main"](argv) == 0
    text = (tmp_path / "what_if_chain.md").read_text()
    assert text.count("\n| ") == 3  # the header, "as measured", the scenario
    assert "| as measured | " in text and "| fwd_workspace_free+bwd_workspace_free | " in text


def test_unknown_scenario_and_bad_budget_are_refused(what_if, tmp_path):
    path = tmp_path / "chain.json"
    synthetic.chain(6).to_json(path)
    with pytest.raises(SystemExit):
        what_if["main"]([str(path), "--budget", "0.6", "--scenarios", "fwd_workspace_free+faster_everything"])
    with pytest.raises(ValueError, match="budget"):
        what_if["budget_bytes"](synthetic.chain(6), 0.0)
