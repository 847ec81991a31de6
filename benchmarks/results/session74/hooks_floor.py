"""What one engine call with Python hooks costs: plain ResNet-50 b8 224 against the same step
with saved-tensor hooks (every saved tensor packed to a key and unpacked from a dict) and a
Python pre-hook on each module output's grad_fn (the floor of a runtime that runs the schedule
inside plain autograd's one engine call). Rounds interleaved, medians in ms.

    python benchmarks/results/session74/hooks_floor.py [--rounds 9]
"""

import argparse
import statistics
import time

import torch
import torchvision

from monet_opt.bench import loss_of
from monet_opt.malloc import keep_freed_memory


class Hooked:
    def __init__(self, model):
        self.model = model
        self.store = {}
        self.calls = 0
        for m in model.modules():
            if not list(m.children()):
                m.register_forward_hook(self.hook_output)

    def hook_output(self, mod, inp, out):
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.register_prehook(self.pre)

    def pre(self, grads):
        self.calls += 1
        return None

    def pack(self, t):
        k = len(self.store)
        self.store[k] = t
        return k

    def unpack(self, k):
        return self.store[k]

    def __call__(self, x):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return self.model(x)


def split(m, params, x):
    for p in params:
        p.grad = None
    t0 = time.perf_counter()
    loss = loss_of(m(x))
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    if isinstance(m, Hooked):
        m.store.clear()
    return t1 - t0, t2 - t1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    keep_freed_memory()
    torch.manual_seed(0)
    plain = torchvision.models.resnet50(weights=None).train()
    hooked_model = torchvision.models.resnet50(weights=None).train()
    hooked_model.load_state_dict(plain.state_dict())
    runs = {"plain": plain, "hooks": Hooked(hooked_model)}
    params = {"plain": list(plain.parameters()), "hooks": list(hooked_model.parameters())}
    x = torch.randn(8, 3, 224, 224)
    times = {k: [] for k in runs}
    for r in range(args.rounds):
        for label in list(runs) if r % 2 == 0 else list(reversed(runs)):
            split(runs[label], params[label], x)
            times[label].append(split(runs[label], params[label], x))
    print("prehook calls per step:", runs["hooks"].calls // (2 * args.rounds))
    print("| run | forward ms | backward ms | step ms |")
    print("|---|---:|---:|---:|")
    for label, ts in times.items():
        f = statistics.median(t[0] for t in ts)
        b = statistics.median(t[1] for t in ts)
        s = statistics.median(t[0] + t[1] for t in ts)
        print(f"| {label} | {f * 1e3:.1f} | {b * 1e3:.1f} | {s * 1e3:.1f} |")
