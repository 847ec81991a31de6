"""Session 53 probe: cProfile of three wrapped ResNet-50 b8 224 training steps under a schedule
(after three warm-up steps and three timed ones), freed memory kept.

    python benchmarks/results/session53/profile_steps.py SCHEDULE.json
"""

import cProfile
import pstats
import sys
import time

import torch

from monet_opt import MonetWrapper
from monet_opt.malloc import keep_freed_memory
from monet_opt.zoo import ModelSpec

keep_freed_memory()
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
(x,) = spec.example_inputs()
wrapped = MonetWrapper(model, sys.argv[1], input_shape=x.shape)


def step() -> None:
    wrapped(x).sum().backward()
    for p in model.parameters():
        p.grad = None


for _ in range(3):
    step()
times = []
for _ in range(3):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
print("steps (ms):", [round(t * 1e3) for t in times])
profile = cProfile.Profile()
profile.enable()
for _ in range(3):
    step()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(45)
