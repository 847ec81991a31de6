"""The lowest-peak schedule found for each problem, kept beside the profile cache.

A budget under every peak the solver finds is refused with the smallest one it found
(`solver.InfeasibleBudget`), and the user asks again with that figure. The search that found it
stopped at a time limit, so a second search of the same length need not find it again (a fresh
CI run once stopped 25 KB above it). Kept here, the schedule starts the next solve of the same
problem (`solver.solve`'s `start_plan`, used only if it fits the new budget on the new costs), so
the budget an error named is met; 'min' starts from it too, so the smallest peak only goes down.

One JSON schedule per problem fingerprint in `<cache dir>/lowest/`, written atomically; an
unreadable or foreign file is ignored (and replaced by the next one found).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from monet_opt.profile import cache_dir
from solver.baselines import plan_of
from solver.plan import Plan, PlanError
from solver.problem import Problem
from solver.schedule import Schedule, ScheduleError
from solver.simulate import ScheduleInvalid, simulate


def problem_digest(problem: Problem) -> str:
    """A short file name for the problem's fingerprint (this module's and `fastest_found`'s)."""
    return hashlib.sha256(problem.fingerprint.encode()).hexdigest()[:24]


def _path(problem: Problem) -> Path:
    return cache_dir() / "lowest" / f"{problem_digest(problem)}.json"


def recall(problem: Problem) -> tuple[Schedule, int] | None:
    """The kept schedule for this problem and its peak on this problem's costs, if one is kept
    and still runs here."""
    path = _path(problem)
    if not path.exists():
        return None
    try:
        schedule = Schedule.from_json(path)
        if schedule.fingerprint != problem.fingerprint:
            return None
        return schedule, simulate(problem, schedule).peak_bytes
    except (OSError, ValueError, KeyError, ScheduleError, ScheduleInvalid):
        return None


def recall_plan(problem: Problem) -> Plan | None:
    """`recall`'s schedule, as the plan a solve starts from (None if none is kept)."""
    kept = recall(problem)
    if kept is None:
        return None
    try:
        return plan_of(problem, kept[0])
    except (PlanError, KeyError, ValueError):
        return None


def remember(problem: Problem, schedule: Schedule) -> bool:
    """Keep `schedule` if its peak is below the kept one's (on this problem's costs). Returns
    whether it was kept."""
    peak = simulate(problem, schedule).peak_bytes
    kept = recall(problem)
    if kept is not None and kept[1] <= peak:
        return False
    path = _path(problem)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        schedule.to_json(path)
    except OSError:  # (a read-only cache: nothing is kept, nothing else changes)
        return False
    return True
