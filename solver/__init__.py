"""The torch-free optimization core: problem, schedule, simulator, strategies.

import solver
problem = solver.Problem.from_json("resnet50.problem.json")
schedule = solver.solve(problem, budget=0.5, time_limit=60)
print(solver.simulate(problem, schedule).peak_bytes)
"""

from solver import baselines  # noqa: E402  (after the contract types it uses)
from solver.baselines import best_baseline, checkpoint_all, chen_sqrt, greedy, no_recompute
from solver.bounds import min_feasible_lower_bound
from solver.gather import gather_backwards
from solver.gurobi_milp import GurobiUnavailable
from solver.milp import InfeasibleBudget, NoScheduleFound, minimum_peak, resolve_budget, solve, sweep
from solver.problem import Impl, Node, Problem, ProblemError, Restore
from solver.schedule import FingerprintMismatch, Schedule, ScheduleError, SolverInfo, Stage, Step
from solver.simulate import ScheduleInvalid, SimResult, simulate

__all__ = [
    "GurobiUnavailable",
    "InfeasibleBudget",
    "NoScheduleFound",
    "baselines",
    "best_baseline",
    "checkpoint_all",
    "chen_sqrt",
    "gather_backwards",
    "greedy",
    "min_feasible_lower_bound",
    "minimum_peak",
    "no_recompute",
    "resolve_budget",
    "solve",
    "sweep",
    "FingerprintMismatch",
    "Impl",
    "Node",
    "Problem",
    "ProblemError",
    "Restore",
    "Schedule",
    "ScheduleError",
    "ScheduleInvalid",
    "SimResult",
    "SolverInfo",
    "Stage",
    "Step",
    "simulate",
]
