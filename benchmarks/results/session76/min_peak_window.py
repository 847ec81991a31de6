"""Smallest peak minimum_peak finds with a given recompute window (session 76: is 190.7 MiB a
window-6 artefact on the kept problem?).

python benchmarks/results/session76/min_peak_window.py PROBLEM.json SECONDS WINDOW|none
"""

import sys

from solver import Problem, simulate
from solver import baselines as B
from solver.milp import minimum_peak

p = Problem.from_json(sys.argv[1])
window = None if sys.argv[3] == "none" else int(sys.argv[3])
base = B.no_recompute(p)
s = minimum_peak(p, time_limit=float(sys.argv[2]), verbose=True, window=window)
sim = simulate(p, s)
print(
    f"RESULT window {sys.argv[3]}, {sys.argv[2]} s: peak {sim.peak_bytes / 2**20:.1f} MiB "
    f"({sim.peak_bytes / base.predicted_peak_bytes:.4f} of no recompute's), time {sim.time_s / base.predicted_time_s:.4f}"
)
