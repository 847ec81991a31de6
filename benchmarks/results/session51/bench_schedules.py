"""Session 51: ResNet-50 b8 224 schedules measured against plain PyTorch in one process
(`bench_model`: paired rounds, freed memory kept), alternating, twice.

    python benchmarks/results/session51/bench_schedules.py A.json,B.json[,...] [ROUNDS]
"""

import sys

import torch

from monet_opt.bench import bench_model
from monet_opt.malloc import keep_freed_memory
from monet_opt.zoo import ModelSpec
from solver import Schedule

keep_freed_memory()
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
paths = sys.argv[1].split(",")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 11
for _ in range(2):
    for path in paths:
        s = Schedule.from_json(path)
        r = bench_model(model, inputs, s, steps=rounds, name=path)
        q1, q2, q3 = r.ratio_quartiles
        print(
            f"{path.split('/')[-1]:28s} measured {q2 - 1:+.1%} ({q1 - 1:+.1%} .. {q3 - 1:+.1%})"
            f" peak {r.wrapped_peak_bytes / 2**20:.1f} MiB (predicted {s.predicted_peak_bytes / 2**20:.1f},"
            f" plain {r.plain_peak_bytes / 2**20:.1f}) step {r.wrapped_step_s * 1e3:.0f} ms"
            f" (predicted {s.predicted_time_s * 1e3:.0f}, plain {r.plain_step_s * 1e3:.0f})",
            flush=True,
        )
