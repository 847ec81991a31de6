"""Session 56 probe: what a node costs the runtime when it runs in an autograd graph of its own
rather than in a shared one. A chain of N conv-BN-ReLU blocks (batch 8, C channels, HxH), its
no-recompute schedule run with its one shared graph and with a graph per node
(`executor.separate_graphs()`), each against plain PyTorch: medians of 7 timings of 10 steps.

    python benchmarks/results/session56/per_node_cost.py N C H
"""

import copy
import statistics
import sys
import time

import torch
from torch import nn

from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines

torch.manual_seed(0)
n, c, h = (int(a) for a in sys.argv[1:4])
model = nn.Sequential(
    *[m for _ in range(n) for m in (nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())]
)
model.train()
x = torch.randn(8, c, h, h)
schedule = baselines.no_recompute(build_problem(model, (x,), progress=False, repeats=1))


def step_time(net) -> float:
    for _ in range(5):
        net(x).sum().backward()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(10):
            net(x).sum().backward()
        times.append((time.perf_counter() - start) / 10)
    return statistics.median(times)


for how in ("shared", "separate", "shared", "separate"):
    wrapped = MonetWrapper(copy.deepcopy(model), schedule, example_inputs=(x,))
    if how == "separate":
        wrapped.executor.separate_graphs()
    t_wrapped = step_time(wrapped)
    t_plain = step_time(copy.deepcopy(model))
    print(
        f"{how:8s} graphs: wrapped {t_wrapped * 1e3:7.2f} ms, plain {t_plain * 1e3:7.2f} ms, "
        f"{(t_wrapped - t_plain) / (3 * n) * 1e6:+6.1f} us per node",
        flush=True,
    )
