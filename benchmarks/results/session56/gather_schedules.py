"""Session 56: gather the backward steps (`solver.gather_backwards`) of schedules solved before
it existed, writing each beside the others in OUT_DIR under the same name; prints what moved and
the simulated peaks and times before and after (equal times, peaks no higher).

    python benchmarks/results/session56/gather_schedules.py PROBLEM.json OUT_DIR SCHEDULE.json...
"""

import sys
from pathlib import Path

from solver import Problem, Schedule, gather_backwards, simulate

problem = Problem.from_json(sys.argv[1])
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for path in sys.argv[3:]:
    schedule = Schedule.from_json(path)
    gathered = gather_backwards(problem, schedule)
    before, after = simulate(problem, schedule), simulate(problem, gathered)
    backs = sum(1 for st in schedule.stages for s in st.steps if s.op == "backward")
    print(
        f"{Path(path).name}: {gathered.meta.get('gathered_backwards')} of {backs} backward steps; "
        f"peak {before.peak_bytes / 2**20:.1f} -> {after.peak_bytes / 2**20:.1f} MiB, "
        f"time {before.time_s * 1e3:.1f} -> {after.time_s * 1e3:.1f} ms"
    )
    gathered.to_json(out / Path(path).name)
