"""The wrapper's own per-node cost, where compute is small: ResNet-50 at batch 2, 32x32 on CPU,
plain PyTorch against the no-recompute schedule run with the runtime's groups and with one
graph per node (`executor.separate_graphs()`, what the calibration times), interleaved rounds.

    python benchmarks/results/session73/runtime_overhead_small.py [--rounds 15]
"""

import argparse
import copy
import statistics

import torch
import torchvision

from monet_opt.bench import interleaved_samples
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=15)
ap.add_argument("--batch", type=int, default=2)
ap.add_argument("--image", type=int, default=32)
args = ap.parse_args()
torch.manual_seed(0)
model = torchvision.models.resnet50(weights=None).train()
x = torch.randn(args.batch, 3, args.image, args.image)
problem = build_problem(model, (x,), progress=False, repeats=1)
sched = baselines.no_recompute(problem)
grouped = MonetWrapper(copy.deepcopy(model), sched, example_inputs=(x,))
separate = MonetWrapper(copy.deepcopy(model), sched, example_inputs=(x,))
separate.executor.separate_graphs()
print("groups:", len(grouped.executor.group_of), "grouped nodes of", len(problem.nodes))
n = len(problem.nodes)
for label, w in (("grouped", grouped), ("separate", separate)):
    ta, tb = interleaved_samples(model, w, (x,), args.rounds)
    pa, pb = statistics.median(ta), statistics.median(tb)
    print(
        f"{label}: plain {pa * 1e3:.1f} ms, wrapped {pb * 1e3:.1f} ms, +{(pb - pa) * 1e3:.1f} ms = {(pb - pa) / n * 1e6:.0f} us per node"
    )
