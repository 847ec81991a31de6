"""The torch-free optimization core: problem, schedule, simulator, strategies.

    import solver
    problem = solver.Problem.from_json("resnet50.problem.json")
    schedule = solver.solve(problem, budget=0.5, time_limit=60)
    print(solver.simulate(problem, schedule).peak_bytes)
"""

from solver.problem import Impl, Node, Problem, ProblemError
from solver.schedule import FingerprintMismatch, Schedule, ScheduleError, SolverInfo, Stage, Step
from solver.simulate import ScheduleInvalid, SimResult, simulate

__all__ = [
    "FingerprintMismatch",
    "Impl",
    "Node",
    "Problem",
    "ProblemError",
    "Schedule",
    "ScheduleError",
    "ScheduleInvalid",
    "SimResult",
    "SolverInfo",
    "Stage",
    "Step",
    "simulate",
]
