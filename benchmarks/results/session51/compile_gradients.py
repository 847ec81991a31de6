"""Session 51 probe: how far torch.compile's (inductor, CPU) parameter gradients are from eager
PyTorch's, beside how far eager's own are at another thread count. ResNet-50, random init,
one training step, loss sum(out * fixed random).

    python benchmarks/results/session51/compile_gradients.py BATCH IMAGE
"""

import copy
import sys
import time

import torch
import torchvision

torch.manual_seed(0)
batch, image = int(sys.argv[1]), int(sys.argv[2])
model = torchvision.models.resnet50(weights=None).train()
x = torch.randn(batch, 3, image, image)
weights = torch.randn(batch, 1000)
state = copy.deepcopy(model.state_dict())


def gradients(net, threads=2):
    """One step of `net` (the model or its compiled form) from the saved state."""
    model.load_state_dict(state)
    torch.set_num_threads(threads)
    model.zero_grad(set_to_none=True)
    (net(x) * weights).sum().backward()
    torch.set_num_threads(2)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def compare(a, b, label):
    ratios = sorted(((a[n] - b[n]).abs().max().item() / a[n].abs().max().item(), n) for n in a)
    fails = sum(
        not torch.allclose(b[n], a[n], rtol=1e-5, atol=max(1e-6, 1e-5 * a[n].abs().max().item())) for n in a
    )
    print(
        f"{label}: max|diff|/max|g| median {ratios[len(ratios) // 2][0]:.2e}, worst {ratios[-1][0]:.2e} "
        f"({ratios[-1][1]}), fc.weight {dict((n, r) for r, n in ratios)['fc.weight']:.2e}; "
        f"parameters outside rtol 1e-5 / atol 1e-5 of the largest: {fails}/{len(a)}"
    )


eager = gradients(model)
compare(eager, gradients(model), "eager vs eager again")
compare(eager, gradients(model, threads=1), "eager 2 threads vs 1 thread")
compiled = torch.compile(model)
t0 = time.perf_counter()
gradients(compiled)
print(f"compile + first step {time.perf_counter() - t0:.1f} s")
compare(eager, gradients(compiled), "eager vs inductor")
