"""The optimizer step inside the backward: each parameter is updated, and its gradient freed,
as soon as its gradient is complete (PyTorch's "fuse the optimizer step into the backward pass").

A training step then never holds all parameter gradients at once: under a tight budget the
backward's late stages (where plain PyTorch holds nearly every gradient) get that memory back
for activations. The update equals a normal `optimizer.step()` for optimizers that treat each
parameter on its own (SGD, Adam, AdamW, ...); not for those that look across parameters
(LAMB's trust ratio over layers is per parameter and fine, gradient clipping by the global
norm is not). Users call only `loss.backward()`: no `optimizer.step()`, no `zero_grad()`.

* `OPTIMIZERS`: the optimizer names the command line knows, as factories.
* `step_bytes_per_param_byte(factory)`: the step's temporaries, measured (Adam: 2, SGD: 0).
* `PerParameterSteps`: one optimizer per parameter; `step(param, grad)`. The executor calls it.
* `fuse_into_backward(model, factory)`: the same for a plain model (post-accumulate-grad
  hooks), the baseline monet-opt's step-in-backward schedules are compared with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
FINGERPRINT_SUFFIX = ":step-in-backward"

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}


def optimizer_factory(optimizer: str | OptimizerFactory) -> OptimizerFactory:
    """The factory of a name in `OPTIMIZERS`, or `optimizer` itself if it is a factory."""
    if not isinstance(optimizer, str):
        return optimizer
    try:
        return OPTIMIZERS[optimizer]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})") from None


def step_bytes_per_param_byte(factory: OptimizerFactory, device: torch.device | str = "cpu") -> float:
    """Peak bytes the optimizer's step allocates per byte of the parameter it updates, measured
    on a 1 Mi-element parameter after a first step (which makes the optimizer's state)."""
    from monet_opt.memory import measure_peak

    p = nn.Parameter(torch.zeros(1 << 20, device=device))
    opt = factory([p])
    p.grad = torch.ones_like(p)
    opt.step()
    p.grad = torch.ones_like(p)
    peak = measure_peak(opt.step).peak_bytes
    return peak / (p.numel() * p.element_size())


class PerParameterSteps:
    """One optimizer per parameter, made on first use by `factory([param])`."""

    def __init__(self, factory: OptimizerFactory) -> None:
        self.factory = factory
        self.optimizers: dict[int, torch.optim.Optimizer] = {}

    def step(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        opt = self.optimizers.get(id(param))
        if opt is None:
            opt = self.optimizers[id(param)] = self.factory([param])
        param.grad = grad
        opt.step()
        param.grad = None


def fuse_into_backward(model: nn.Module, factory: OptimizerFactory) -> list:
    """Plain PyTorch with the step in the backward: each parameter steps when its gradient has
    been accumulated (`register_post_accumulate_grad_hook`). Returns the hook handles."""
    steps = PerParameterSteps(factory)

    def hook(param: torch.Tensor) -> None:
        steps.step(param, param.grad)

    return [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]
