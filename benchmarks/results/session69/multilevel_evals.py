"""multilevel_starts with 200 and 400 replays (REFINE_EVALS) on the session-65 ResNet-50 b8 224
problems at 0.8-0.25 of the no-recompute peak: (replays, seconds, the refined plan's time).

python benchmarks/results/session69/multilevel_evals.py   (from the repository root)
"""

import time

from solver import Problem
from solver import baselines as B

ROOT = "benchmarks/results/session65/frontier_full/schedules/"
for name in ("resnet50_problem", "resnet50_adam_problem"):
    p = Problem.from_json(ROOT + name + ".json")
    peak0 = B.no_recompute(p).predicted_peak_bytes
    for fraction in (0.8, 0.6, 0.5, 0.4, 0.33, 0.25):
        budget = int(fraction * peak0)
        row = []
        for evals in (200, 400):
            t = time.perf_counter()
            found = B.multilevel_starts(p, budget, time_limit=60, max_evals=evals)
            seconds = time.perf_counter() - t
            row.append((evals, round(seconds, 1), found and round(found[0].predicted_time_s, 4)))
        print(name, fraction, row, flush=True)
