"""A recomputing schedule run by the executor (nested engine calls per node or group) against
the same schedule run inside the caller's one backward call (`monet_opt/runtime/one_call.py`),
beside plain PyTorch, ResNet-50 b8 224 on CPU, rounds interleaved (each timed step after an
untimed one of the same model), medians in ms and overheads against plain per round.

    python benchmarks/results/session74/one_call_vs_executor.py SCHEDULE PROBLEM [--rounds 11]
"""

import argparse
import copy
import statistics
import time

import torch
import torchvision

from monet_opt.bench import loss_of, zero_grad
from monet_opt.malloc import keep_freed_memory
from monet_opt.memory import measure_peak
from monet_opt.runtime import MonetWrapper
from solver import Problem, Schedule


def step(m, x):
    zero_grad(m)
    t0 = time.perf_counter()
    loss_of(m(x)).backward()
    return time.perf_counter() - t0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("schedule")
    ap.add_argument("problem")
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    keep_freed_memory()
    schedule = Schedule.from_json(args.schedule)
    problem = Problem.from_json(args.problem)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).train()
    x = torch.randn(8, 3, 224, 224)
    one = MonetWrapper(copy.deepcopy(model), schedule, example_inputs=(x,))
    old = MonetWrapper(copy.deepcopy(model), schedule, example_inputs=(x,))
    old.executor.one_call = None  # (the executor's own backward)
    runs = {"plain": model, "executor": old, "one call": one}
    for label, m in runs.items():
        zero_grad(m)
        peak = measure_peak(lambda m=m: loss_of(m(x)).backward()).peak_bytes
        print(f"{label}: measured peak {peak / 2**20:.1f} MiB", flush=True)
    print("one call used:", one.executor.one_call not in (None, False))
    print(
        f"schedule: budget {schedule.budget_bytes / 2**20:.1f} MiB, predicted peak "
        f"{schedule.predicted_peak_bytes / 2**20:.1f} MiB, predicted step {schedule.predicted_time_s * 1e3:.0f} ms"
    )
    times = {k: [] for k in runs}
    for r in range(args.rounds):
        for label in list(runs) if r % 2 == 0 else list(reversed(runs)):
            step(runs[label], x)
            times[label].append(step(runs[label], x))
    plain = times["plain"]
    print("| run | step ms (median) | overhead vs plain (median of rounds, quartiles) |")
    print("|---|---:|---|")
    for label, ts in times.items():
        over = sorted(t / p - 1 for t, p in zip(ts, plain))
        q = statistics.quantiles(over, n=4)
        print(
            f"| {label} | {statistics.median(ts) * 1e3:.0f} | {statistics.median(over) * 100:+.1f} % "
            f"({q[0] * 100:+.1f} .. {q[2] * 100:+.1f}) |"
        )
