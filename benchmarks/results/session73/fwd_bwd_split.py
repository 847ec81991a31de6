"""Forward and backward wall time of a training step, plain PyTorch against the no-recompute
schedule run with its one attached group and with one graph per node, ResNet-50 b8 224,
rounds interleaved (each timed step after an untimed one of the same model), medians in ms.

    python benchmarks/results/session73/fwd_bwd_split.py [--rounds 9]
"""

import argparse
import copy
import statistics
import time

import torch
import torchvision

from monet_opt.bench import loss_of, zero_grad
from monet_opt.malloc import keep_freed_memory
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines


def resnet50_runs() -> tuple[dict, torch.Tensor]:
    """({label: model}, inputs): plain ResNet-50 b8 224 (seed 0, training), its no-recompute
    schedule attached (one group) and with one graph per node; glibc keeping freed memory."""
    keep_freed_memory()
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).train()
    x = torch.randn(8, 3, 224, 224)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    attached = MonetWrapper(copy.deepcopy(model), baselines.no_recompute(problem), example_inputs=(x,))
    separate = MonetWrapper(copy.deepcopy(model), baselines.no_recompute(problem), example_inputs=(x,))
    separate.executor.separate_graphs()
    return {"plain": model, "attached group": attached, "one graph per node": separate}, x


def split(m, x) -> tuple[float, float]:
    zero_grad(m)
    t0 = time.perf_counter()
    loss = loss_of(m(x))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    runs, x = resnet50_runs()
    times = {k: [] for k in runs}
    for r in range(args.rounds):
        for label in list(runs) if r % 2 == 0 else list(reversed(runs)):
            split(runs[label], x)
            times[label].append(split(runs[label], x))
    print("| run | forward ms | backward ms | step ms |")
    print("|---|---:|---:|---:|")
    for label, ts in times.items():
        f = statistics.median(t[0] for t in ts)
        b = statistics.median(t[1] for t in ts)
        s = statistics.median(t[0] + t[1] for t in ts)
        print(f"| {label} | {f * 1e3:.0f} | {b * 1e3:.0f} | {s * 1e3:.0f} |")
