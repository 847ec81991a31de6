"""Torch profiler, per aten op and autograd node: plain PyTorch against the no-recompute schedule
run with one graph per node (`executor.separate_graphs()`), ResNet-50 b8 224, 3 steps each
(self CPU us per step; glibc keeping freed memory).

    python benchmarks/results/session73/op_profile.py
"""

from fwd_bwd_split import resnet50_runs  # (this directory)
from torch.profiler import ProfilerActivity, profile

from monet_opt.bench import timed_step

runs, x = resnet50_runs()
model, w = runs["plain"], runs["one graph per node"]


def prof(m, steps=3):
    for _ in range(steps):
        timed_step(m, (x,))
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            timed_step(m, (x,))
    return {e.key: (e.count / steps, e.self_cpu_time_total / steps) for e in p.key_averages()}


a, b = prof(model), prof(w)
keys = sorted(set(a) | set(b), key=lambda k: -(b.get(k, (0, 0))[1] - a.get(k, (0, 0))[1]))
print(f"{'op':50s} {'plain n':>8s} {'wrap n':>8s} {'plain us':>9s} {'wrap us':>9s}")
for k in keys[:30]:
    pa, pb = a.get(k, (0, 0)), b.get(k, (0, 0))
    print(f"{k[:50]:50s} {pa[0]:8.0f} {pb[0]:8.0f} {pa[1]:9.0f} {pb[1]:9.0f}")
print("total self us", sum(v[1] for v in a.values()), sum(v[1] for v in b.values()))
