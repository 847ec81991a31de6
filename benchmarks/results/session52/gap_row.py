"""Session 52: one 60-s gap row (as session 35's snippet), a saved problem or `syn350`
(`solver.synthetic.resnet(350, seed=0)`, 356 nodes) at a fraction of its no-recompute peak.

    python benchmarks/results/session52/gap_row.py PROBLEM.json|syn350 FRACTION

Prints the log, then `RESULT <problem> <fraction> <time / no-recompute> <status> <gap>`.
"""

import sys

import solver.baselines as B
from solver import Problem, solve

path = sys.argv[1]
if path.startswith("syn"):
    from solver.synthetic import resnet

    p = resnet(int(path[3:]), seed=0)
else:
    p = Problem.from_json(path)
nr = B.no_recompute(p)
frac = float(sys.argv[2])
out = solve(p, int(frac * nr.predicted_peak_bytes), time_limit=60, verbose=True)
print(
    "RESULT",
    path.split("/")[-1],
    frac,
    round(out.predicted_time_s / nr.predicted_time_s, 4),
    out.solver.status,
    round(out.solver.gap, 4),
)
