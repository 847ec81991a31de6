"""Session 56 check: a schedule's wrapped model against plain PyTorch on the schedule's own model
and input, over STEPS steps (the second and later replay the first's decisions and run group
forwards as generated functions): with gradients kept, each step's parameter gradients; with the
optimizer step in the backward, the parameters after each step (plain with the same step fused
into its backward). Prints the largest relative difference, how many elements differ by more than
1 % of their tensor's largest, and any parameter left without a gradient or an update.

    python benchmarks/results/session56/check_gradients.py SCHEDULE.json STEPS
"""

import copy
import sys

import torch

from monet_opt.bench import spec_of
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory
from solver import Schedule

schedule = Schedule.from_json(sys.argv[1])
steps = int(sys.argv[2])
spec = spec_of(schedule)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs(torch.device("cpu"))
optimizer = schedule.meta.get("step_in_backward", {}).get("optimizer")
plain = copy.deepcopy(model)
if optimizer is not None:
    fuse_into_backward(plain, optimizer_factory(optimizer))
wrapped_model = copy.deepcopy(model)
wrapped = MonetWrapper(wrapped_model, schedule, example_inputs=inputs, optimizer=optimizer)


def loss_of(out):
    return out.float().square().mean()


for step in range(steps):
    got = {}
    for name, net, module in (("plain", plain, plain), ("wrapped", wrapped, wrapped_model)):
        for p in module.parameters():
            p.grad = None
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        loss_of(net(*inputs)).backward()
        if optimizer is None:
            got[name] = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
        else:
            got[name] = {
                n: p.detach() - before[n]
                for n, p in module.named_parameters()
                if not torch.equal(p, before[n])
            }
    missing = sorted(set(got["plain"]) - set(got["wrapped"]))
    worst = max(
        ((got["wrapped"][n] - g).abs().max().item() / max(g.abs().max().item(), 1e-30), n)
        for n, g in got["plain"].items()
        if n in got["wrapped"]
    )
    what = "gradients" if optimizer is None else "updates"
    # (an Adam update is about lr * sign(gradient) where the gradient is tiny: a summation order's
    # rounding can flip it; counted: elements off by more than 1 % of their tensor's largest)
    shared = [(got["wrapped"][n], g) for n, g in got["plain"].items() if n in got["wrapped"]]
    off = sum(int(((w - g).abs() > 0.01 * g.abs().max()).sum()) for w, g in shared)
    total = sum(g.numel() for _, g in shared)
    print(
        f"step {step}: {len(got['plain'])} {what}, missing {missing}, largest relative difference "
        f"{worst[0]:.2e} ({worst[1]}), {off} of {total} elements off by > 1 % of their tensor's largest",
        flush=True,
    )
