"""The optional Gurobi backend (`solver.solve(..., solver="gurobi")`): the same MILP as HiGHS gets,
judged the same way (simulator replay, within budget, within the MIP gap of HiGHS' optimum), and
clear errors where Gurobi cannot run. The licence that comes with `pip install gurobipy` is limited
to 2000 columns and rows: the tests solve problems under that size, and check that a larger one
says so."""

from __future__ import annotations

import sys

import pytest

from solver import GurobiUnavailable, min_feasible_lower_bound, minimum_peak, simulate, solve
from solver import baselines as B
from solver.formulation import Formulation
from solver.milp import check_backend
from solver.synthetic import chain, problem_zoo

try:
    check_backend("gurobi")
    GUROBI_REASON = None
except GurobiUnavailable as exc:  # reported in the skip reason, not hidden
    GUROBI_REASON = str(exc)

needs_gurobi = pytest.mark.skipif(
    GUROBI_REASON is not None, reason=f"Gurobi cannot run here: {GUROBI_REASON}"
)
ZOO = problem_zoo()


@needs_gurobi
@pytest.mark.parametrize("name", ["chain8", "chain12", "random10", "random16"])
@pytest.mark.parametrize("fraction", [0.7, 0.4])
def test_gurobi_schedules_fit_and_match_highs_within_the_gap(name, fraction):
    """Budgets `fraction` of the way from the feasible minimum to the no-recompute peak."""
    p = ZOO[name]
    low, high = min_feasible_lower_bound(p), B.no_recompute(p).predicted_peak_bytes
    budget = int(low + fraction * (high - low))
    highs = solve(p, budget, time_limit=20, verbose=False, window=None)
    gurobi = solve(p, budget, time_limit=20, verbose=False, window=None, solver="gurobi")
    assert gurobi.solver.name == "gurobi-milp"
    sim = simulate(p, gurobi)
    assert sim.peak_bytes <= budget
    assert abs(sim.time_s - gurobi.predicted_time_s) < 1e-12
    assert gurobi.solver.status == "optimal" and highs.solver.status == "optimal"
    # both proven within the 1 % MIP gap of the same MILP's optimum
    assert gurobi.predicted_time_s <= highs.predicted_time_s * 1.01 + 1e-12
    assert highs.predicted_time_s <= gurobi.predicted_time_s * 1.01 + 1e-12
    assert gurobi.solver.gap <= 0.01 + 1e-9


@needs_gurobi
def test_gurobi_runs_the_peak_milp_for_minimum_peak():
    p = ZOO["chain12"]
    low = minimum_peak(p, time_limit=20, verbose=False, solver="gurobi")
    assert low.solver.name == "gurobi-milp"
    assert simulate(p, low).peak_bytes == low.predicted_peak_bytes
    assert low.predicted_peak_bytes <= B.lowest_peak_baseline(p).predicted_peak_bytes


@needs_gurobi
def test_gurobi_warm_start_and_fixed_columns_are_honoured():
    """The polishing neighbourhoods' contract: with every integer column fixed to a plan, the
    result is that plan (objective and all)."""
    p = chain(12, seed=3)
    an = B.analysis(p)
    s = B.chen_sqrt(p)
    plan = B.plan_of(p, s)
    form = Formulation(an, s.predicted_peak_bytes, window=None, warm_plan=plan, backend="gurobi")
    x = form.plan_to_vector(plan)
    fixed = {c: float(x[c]) for c, isint in enumerate(form.md.integer) if isint}
    res = form.solve_milp(20.0, warm=x, fixed=fixed)
    assert res.plan is not None
    assert abs(res.objective - s.predicted_time_s) < 1e-9
    lp = form.solve_milp(20.0, relax=True)
    assert lp.objective <= res.objective + 1e-9


@needs_gurobi
def test_a_model_over_the_licence_size_says_so_or_solves():
    """With the size-limited licence a ResNet-50-sized MILP raises an error that names the limit;
    with a full licence it solves and fits."""
    p = ZOO["resnet50"]
    budget = int(0.5 * B.no_recompute(p).predicted_peak_bytes)
    try:
        s = solve(p, budget, time_limit=20, verbose=False, solver="gurobi")
    except GurobiUnavailable as exc:
        assert "size-limited" in str(exc) and "columns" in str(exc) and "highs" in str(exc)
    else:
        assert simulate(p, s).peak_bytes <= budget


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="one of highs, gurobi"):
        solve(ZOO["chain8"], 0.8, time_limit=5, verbose=False, solver="cplex")


def test_gurobi_without_gurobipy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gurobipy", None)  # import gurobipy -> ImportError
    with pytest.raises(GurobiUnavailable, match="pip install gurobipy"):
        solve(ZOO["chain8"], 0.8, time_limit=5, verbose=False, solver="gurobi")


def test_cli_refuses_a_missing_gurobi_before_profiling(monkeypatch, capsys):
    from monet_opt import cli

    monkeypatch.setitem(sys.modules, "gurobipy", None)
    code = cli.main(
        ["solve", "resnet18", "--batch", "2", "--image", "32", "--budget", "0.5", "--milp-solver", "gurobi"]
    )
    err = capsys.readouterr()
    assert code == 2
    assert "gurobipy" in err.err
    assert "profiling" not in err.out + err.err
