"""Paired timings (quiet CPU) of the session-13 ResNet-50 b8 224 schedules."""

# python benchmarks/results/session13/paired_timings_quiet.py 7 resnet50_0.33.json resnet50_adam_0.33.json \
#     resnet50_adam_0.25.json resnet50_adam_0.5.json resnet50_0.5.json   (from the repository root)
import copy
import sys

import torch
import torchvision

import solver
from monet_opt.bench import interleaved_times, measure_step_peak
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory

d = "benchmarks/results/session13/schedules/"
torch.manual_seed(0)
model = torchvision.models.resnet50(weights=None).train()
x = (torch.randn(8, 3, 224, 224),)
steps = int(sys.argv[1])
fused = copy.deepcopy(model)
fuse_into_backward(fused, optimizer_factory("adam"))
plain_peak = measure_step_peak(model, x)
print("plain peak MiB", plain_peak / 2**20, flush=True)
pt, ft = interleaved_times(model, fused, x, steps)
print(f"fused plain vs plain: {ft / pt - 1:+.1%} ({ft * 1e3:.0f} vs {pt * 1e3:.0f} ms)", flush=True)
for name in sys.argv[2:]:
    s = solver.Schedule.from_json(d + name)
    sib = "adam" in name
    w = MonetWrapper(copy.deepcopy(model), s, example_inputs=x, optimizer="adam" if sib else None)
    peak = measure_step_peak(w, x)
    ref = fused if sib else model
    rt, wt = interleaved_times(ref, w, x, steps)
    print(
        f"{name}: peak {peak / 2**20:.1f} MiB ({peak / plain_peak:.3f} of plain), step {wt * 1e3:.0f} ms vs {'fused ' if sib else ''}plain {rt * 1e3:.0f} ms: {wt / rt - 1:+.1%}",
        flush=True,
    )
