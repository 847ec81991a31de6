"""The lowest-peak schedule found per problem, kept between solves: the smallest-peak point of
`monet_opt.fastest_found`'s front."""

from __future__ import annotations

import pytest

import solver
from monet_opt import fastest_found
from solver import baselines
from solver.synthetic import chain


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    return tmp_path


def test_keeps_the_lowest_peak_and_ignores_what_it_cannot_use(cache):
    problem = chain(24)
    low, high = baselines.lowest_peak_baseline(problem), baselines.no_recompute(problem)
    low_peak = solver.simulate(problem, low).peak_bytes
    assert low_peak < solver.simulate(problem, high).peak_bytes
    assert fastest_found.lowest(problem) is None and fastest_found.lowest_plan(problem) is None
    assert fastest_found.remember(problem, high)
    assert fastest_found.lowest(problem).schedule.strategy == high.strategy
    assert fastest_found.remember(problem, low)  # (lower peak: a point of the front)
    assert not fastest_found.remember(problem, high)  # (the same point again: kept once)
    found = fastest_found.lowest(problem)
    assert found.peak_bytes == low_peak and found.schedule.strategy == low.strategy
    assert fastest_found.lowest_plan(problem) is not None
    # another problem's file, or a corrupt one, is nobody's
    other = chain(25)
    assert fastest_found.lowest(other) is None
    found.path.write_text("{not json")
    assert fastest_found.lowest(problem).schedule.strategy == high.strategy  # (the next lowest)
    assert fastest_found.remember(problem, low)  # (and is replaced by the next one found)
    assert fastest_found.lowest(problem).peak_bytes == low_peak


def test_a_budget_an_error_named_is_solved_from_the_kept_schedule(cache, monkeypatch):
    """A search that finds nothing this time (every MILP stopped by its limit before a plan:
    `_ladder` made to find nothing) still meets the minimum an earlier error named, from the kept
    schedule; without it there is no schedule."""
    from solver import milp

    problem = chain(8)
    low = solver.minimum_peak(problem, time_limit=10, verbose=False)
    peak = low.predicted_peak_bytes
    assert peak < baselines.min_known_peak(problem)[0]  # no baseline meets it
    fastest_found.remember(problem, low)
    plan = fastest_found.lowest_plan(problem)
    assert plan is not None and fastest_found.lowest(problem).peak_bytes == peak

    def unlucky(*args, **kwargs):
        return milp._LadderResult(None, (None, None), [])

    monkeypatch.setattr(milp, "_ladder", unlucky)
    with pytest.raises(solver.NoScheduleFound):
        solver.solve(problem, peak, time_limit=5, verbose=False)
    out = solver.solve(problem, peak, time_limit=5, verbose=False, start_plan=plan)
    assert solver.simulate(problem, out).peak_bytes <= peak
    assert out.solver.status.startswith("fallback:")


def test_sweeps_keep_and_start_from_it_too(cache, monkeypatch):
    """`sweep_model` (`monet-opt sweep`) keeps the lowest peak it finds ('min', or what an
    infeasible budget's search found) and its tightest solve starts from the kept schedule."""
    from monet_opt.pipeline import sweep_model
    from solver import milp

    problem = chain(8)
    below, low = sweep_model(problem, [1000, "min"], time_limit=5, verbose=False)
    assert isinstance(below, solver.InfeasibleBudget)
    kept_peak = fastest_found.lowest(problem).peak_bytes
    assert kept_peak <= low.predicted_peak_bytes < baselines.min_known_peak(problem)[0]
    monkeypatch.setattr(milp, "_ladder", lambda *a, **k: milp._LadderResult(None, (None, None), []))
    (again,) = sweep_model(problem, [kept_peak], time_limit=5, verbose=False)
    assert not isinstance(again, Exception), again
    assert solver.simulate(problem, again).peak_bytes <= kept_peak
