"""The fastest schedules found for each problem, kept between solves beside the profile cache.

A solve stops at its time limit, and where it ends depends on where its search started: two
60-s solves of one problem can end on different plans (ResNet-50 b8 224, gradients kept, 0.33 of
the no-recompute peak: 1.2401 s one day, 1.2646 the next). Kept here, the fastest schedule found
that fits a budget starts the next solve for that budget (`solver.solve`'s `start_plan`, never
slower than it), so solving again goes on from the best plan found so far instead of starting
over: a second solve is never slower than the first, and two minutes of solving in two runs
reach about what one 2-minute run does. A schedule found for a tighter budget fits a looser one
and starts it too.

What is kept is the Pareto front of (simulated peak, simulated step time) on the problem as it
is now (costs recalibrated since are replayed, not trusted from the file): a schedule is kept
unless a kept one is as fast at no higher peak, and it drops the kept ones it beats. One JSON
schedule per front point in `<cache dir>/fastest/<problem digest>/`, each written atomically; an
unreadable or foreign file is ignored (`MONET_OPT_CACHE` moves the cache; `monet-opt solve
--fresh` solves without reading it).

The front's smallest-peak point is the lowest-peak schedule found (`lowest`): a budget under every
peak the solver finds is refused with the smallest one it found (`solver.InfeasibleBudget`, whose
search's schedule is kept here too), and the user asks again with that figure. The search that
found it stopped at a time limit, so a second search of the same length need not find it again (a
fresh CI run once stopped 25 KB above it): the next solve of the problem starts from it when no
kept schedule fits its budget faster, so the budget an error named is met, and 'min' starts from
it, so the smallest peak only goes down. (Until session 68 that schedule had a store of its own,
`<cache dir>/lowest/`, no longer read.)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from monet_opt.profile import cache_dir
from solver.baselines import plan_of
from solver.plan import Plan, PlanError
from solver.problem import Problem
from solver.schedule import Schedule, ScheduleError
from solver.simulate import ScheduleInvalid, simulate


@dataclass(frozen=True)
class Kept:
    """A kept schedule, replayed on the problem as it is now."""

    path: Path
    schedule: Schedule
    peak_bytes: int
    time_s: float


def problem_digest(problem: Problem) -> str:
    """A short folder name for the problem's fingerprint."""
    return hashlib.sha256(problem.fingerprint.encode()).hexdigest()[:24]


def _dir(problem: Problem) -> Path:
    return cache_dir() / "fastest" / problem_digest(problem)


def kept(problem: Problem) -> list[Kept]:
    """Every kept schedule of this problem that still replays here, fastest first."""
    folder = _dir(problem)
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            schedule = Schedule.from_json(path)
            if schedule.fingerprint != problem.fingerprint:
                continue
            sim = simulate(problem, schedule)
        except (OSError, ValueError, KeyError, ScheduleError, ScheduleInvalid):
            continue
        out.append(Kept(path, schedule, sim.peak_bytes, sim.time_s))
    return sorted(out, key=lambda k: (k.time_s, k.peak_bytes))


def recall(problem: Problem, budget_bytes: int) -> Kept | None:
    """The fastest kept schedule whose peak fits `budget_bytes` on this problem (None: none)."""
    return next((k for k in kept(problem) if k.peak_bytes <= budget_bytes), None)


def recall_plan(problem: Problem, budget_bytes: int) -> tuple[Plan, Kept] | None:
    """`recall`'s schedule as the plan a solve starts from, with what was recalled."""
    found = recall(problem, budget_bytes)
    return _with_plan(problem, found)


def lowest(problem: Problem) -> Kept | None:
    """The kept schedule with the smallest peak on this problem (None: none kept)."""
    return min(kept(problem), key=lambda k: (k.peak_bytes, k.time_s), default=None)


def lowest_plan(problem: Problem) -> Plan | None:
    """`lowest`'s schedule as the plan a solve starts from (None: none kept, or none replays)."""
    found = _with_plan(problem, lowest(problem))
    return found[0] if found is not None else None


def _with_plan(problem: Problem, found: Kept | None) -> tuple[Plan, Kept] | None:
    if found is None:
        return None
    try:
        return plan_of(problem, found.schedule), found
    except (PlanError, KeyError, ValueError):
        return None


def remember(problem: Problem, schedule: Schedule) -> bool:
    """Keep `schedule` unless a kept one is as fast at no higher peak (on this problem), and drop
    the kept ones it is as fast as at no higher peak. Returns whether it was kept."""
    sim = simulate(problem, schedule)
    peak, time_s = sim.peak_bytes, sim.time_s
    others = kept(problem)
    if any(k.peak_bytes <= peak and k.time_s <= time_s for k in others):
        return False
    folder = _dir(problem)
    path = folder / f"peak{peak}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        schedule.to_json(path)  # (atomic: a temp file renamed over the old one)
        for k in others:
            if k.path != path and peak <= k.peak_bytes and time_s <= k.time_s:
                k.path.unlink(missing_ok=True)
    except OSError:  # (a read-only cache: nothing is kept, nothing else changes)
        return False
    return True
