"""Re-solve a saved frontier problem at a saved schedule's budget (60 s) and print the plan, gap and runs.

python benchmarks/results/session65/resolve.py resnet50_problem.json resnet50_0.3333.json
"""

import json
import sys

from solver import Problem, solve

D = "benchmarks/results/session65/frontier_full/schedules/"
p = Problem.from_json(D + sys.argv[1])
s0 = json.load(open(D + sys.argv[2]))
s = solve(p, s0["budget_bytes"], time_limit=60, verbose=False)
print(
    sys.argv[2],
    "frontier:",
    round(s0["predicted_time_s"], 4),
    "gap",
    round(s0["solver"]["gap"], 4),
    "| now:",
    round(s.predicted_time_s, 4),
    s.solver.status,
    "gap",
    round(float(s.solver.gap), 4),
    "plan's own MILP",
    s.meta.get("milp_gap_plan_milp"),
    round(s.solver.solve_time_s, 1),
)
for a in s.meta["milp_attempts"]:
    print(
        "   ",
        {k: a[k] for k in ("status", "objective", "bound", "seconds", "cols") if k in a},
        a.get("early", ""),
    )
