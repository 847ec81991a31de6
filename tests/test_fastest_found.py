"""The fastest schedules found per problem, kept between solves (monet_opt/fastest_found.py)."""

from __future__ import annotations

import pytest
from torch import nn

import solver
from monet_opt import fastest_found
from solver import baselines
from solver.synthetic import chain


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    return tmp_path


def _sim(problem, schedule):
    sim = solver.simulate(problem, schedule)
    return sim.peak_bytes, sim.time_s


def test_keeps_the_pareto_front_and_recalls_the_fastest_that_fits(cache):
    problem = chain(24)
    fast, low = baselines.no_recompute(problem), baselines.lowest_peak_baseline(problem)
    (fast_peak, fast_time), (low_peak, low_time) = _sim(problem, fast), _sim(problem, low)
    assert low_peak < fast_peak and fast_time < low_time
    assert fastest_found.recall(problem, fast_peak) is None
    assert fastest_found.remember(problem, low)
    assert not fastest_found.remember(problem, low)  # (the same again: as fast, no higher peak)
    assert fastest_found.remember(problem, fast)  # faster, at a higher peak: both kept
    assert len(fastest_found.kept(problem)) == 2
    assert fastest_found.recall(problem, fast_peak).time_s == fast_time
    assert fastest_found.recall(problem, fast_peak - 1).time_s == low_time
    assert fastest_found.recall(problem, low_peak - 1) is None
    plan, found = fastest_found.recall_plan(problem, fast_peak)
    assert found.peak_bytes == fast_peak and plan is not None
    # a schedule at least as fast at no higher peak than a kept one replaces it
    better = solver.solve(problem, low_peak, time_limit=5, verbose=False)
    better_peak, better_time = _sim(problem, better)
    assert better_peak <= low_peak and better_time < low_time  # (0.171 s against 0.278)
    assert fastest_found.remember(problem, better)
    assert all(k.time_s != low_time for k in fastest_found.kept(problem))
    assert fastest_found.recall(problem, low_peak).time_s == better_time


def test_ignores_what_it_cannot_use(cache):
    problem = chain(24)
    fast = baselines.no_recompute(problem)
    assert fastest_found.remember(problem, fast)
    (path,) = list((cache / "fastest").glob("*/*.json"))
    # another problem's schedules are nobody's; a corrupt file is skipped, not fatal
    assert fastest_found.kept(chain(25)) == []
    (path.parent / "junk.json").write_text("{not json")
    assert len(fastest_found.kept(problem)) == 1
    path.write_text("{not json")
    assert fastest_found.kept(problem) == []
    assert fastest_found.remember(problem, fast)


def test_solving_again_goes_on_from_the_fastest_schedule_found(cache, monkeypatch):
    """A second solve of the same problem and budget starts from the first one's schedule: made
    to find nothing itself (every MILP stopped before a plan: `_ladder` finds nothing), it still
    returns a schedule as fast as the first, and says it started from it; `reuse=False` (`monet-opt
    solve --fresh`) solves from scratch and ends on a baseline."""
    from monet_opt.pipeline import solve_model
    from solver import milp

    problem = chain(12)
    model, inputs = nn.Linear(2, 2), __import__("torch").zeros(1, 2)
    budget = 0.5
    _, first = solve_model(model, inputs, budget, time_limit=10, verbose=False, problem=problem)
    first_time = solver.simulate(problem, first).time_s
    best_baseline = baselines.best_baseline(problem, milp.resolve_budget(problem, budget))
    assert first_time < best_baseline.predicted_time_s  # (else the test shows nothing)

    monkeypatch.setattr(milp, "_ladder", lambda *a, **k: milp._LadderResult(None, (None, None), []))
    _, again = solve_model(model, inputs, budget, time_limit=5, verbose=False, problem=problem)
    assert solver.simulate(problem, again).time_s <= first_time * (1 + 1e-12)
    assert again.meta["started_from_kept"]["time_s"] == pytest.approx(first_time)
    assert solver.simulate(problem, again).peak_bytes <= again.budget_bytes

    _, fresh = solve_model(model, inputs, budget, time_limit=5, verbose=False, problem=problem, reuse=False)
    assert "started_from_kept" not in fresh.meta
    assert solver.simulate(problem, fresh).time_s > first_time
