"""Session 64 probe: schedules run with the in-place batch-norm backward's C kernel on and off
(`MONET_OPT_BN_KERNEL`), beside plain PyTorch, in alternating rounds of one process (kept
gradients: schedules without a step in the backward).

python benchmarks/results/session64/ab.py ROUNDS SCHEDULE.json [SCHEDULE.json ...]
"""

import copy
import os
import statistics
import sys

import torch

from monet_opt.bench import paired_ratio, spec_of, timed_step
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from solver.schedule import Schedule


def main() -> None:
    keep_freed_memory()
    rounds = int(sys.argv[1])
    scheds = [Schedule.from_json(p) for p in sys.argv[2:]]
    spec = spec_of(scheds[0])
    base = spec.build().train()
    inputs = spec.example_inputs(torch.device("cpu"))
    runs = [("plain", copy.deepcopy(base), True)]
    for k, s in enumerate(scheds):
        w = MonetWrapper(copy.deepcopy(base), s, example_inputs=inputs)
        runs += [(f"s{k} kernel", w, True), (f"s{k} no kernel", w, False)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for r in range(rounds):
        for name, model, kernel in runs if r % 2 == 0 else runs[::-1]:
            os.environ["MONET_OPT_BN_KERNEL"] = "1" if kernel else "0"
            timed_step(model, inputs)
            times[name].append(timed_step(model, inputs))
    os.environ.pop("MONET_OPT_BN_KERNEL")
    for name, ts in times.items():
        med, q1, q3 = paired_ratio(times["plain"], ts)
        print(
            f"{name:14s} median {statistics.median(ts) * 1e3:7.1f} ms  vs plain {100 * (med - 1):+5.1f}% "
            f"({100 * (q1 - 1):+.1f} .. {100 * (q3 - 1):+.1f})"
        )


if __name__ == "__main__":
    main()
