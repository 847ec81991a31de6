"""Weight gradients made after the last backward stage: the nodes a schedule's
`meta["deferred_param_grads"]` names (the problem's `Node.deferred_param_grad_bytes`).

With gradients kept, a node's backward makes its parameters' gradients, and they stay to the end
of the step: ResNet-50's layer4 convolutions and fc make theirs first in the backward and hold
them through every later stage, where the budget binds. For the nodes the schedule names, the
node's backward makes only its input's gradient and leaves held what the weight gradient is
computed from -- the node's input and its output's gradient -- and the weight (and bias)
gradients are made after the last stage, when the activations are gone: aten's convolution
backward asked for them alone (bit for bit the engine's: aten runs the two parts as separate
kernels either way, `benchmarks/results/session61/split_weight_gradient_micro.txt`), or a linear
layer's matrix product and sum.

How: every implementation of such a node is wrapped (`deferring`). Computed with autograd, it
runs with `monet_opt.ops.conv.WEIGHT_DEFERRED` set (the custom autograd Functions there then make
no weight gradient), and a hook on its output receives the output's gradient when the backward
reaches it (before any in-place change of the output: torch's hooks see the value they were
registered on) and records it with the node's input (`Captured`; the closure holds the input
only while the node's autograd graph lives, which keeps that input anyway). The executor leaves
those parameters out of the engine's call (aten's own backwards then skip them) and calls
`make_weight_gradients` after the last stage. The input and the gradient must not have been
written in place meanwhile (their version counters are checked: an error names the node).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from monet_opt.ops.base import Implementation
from monet_opt.ops.conv import WEIGHT_DEFERRED


@dataclass
class Captured:
    """What a deferred node's weight gradient is computed from, as its backward left it."""

    node: str
    x: torch.Tensor
    g: torch.Tensor
    versions: tuple[int, int]  # (x's, g's) when recorded


def deferrable(target) -> str | None:
    """Why `target` (a node's module) cannot have its weight gradient deferred; None if it can:
    an nn.Conv2d with numeric padding and zero padding mode, or an nn.Linear."""
    if isinstance(target, nn.Conv2d):
        if isinstance(target.padding, str) or target.padding_mode != "zeros":
            return "a convolution with string padding or a padding mode other than zeros"
        return None
    if isinstance(target, nn.Linear):
        return None
    return f"not an nn.Conv2d or nn.Linear ({type(target).__name__})"


def deferring(impl: Implementation, name: str, records: Callable[[], list]) -> Implementation:
    """`impl` for a node whose weight gradient is deferred; `records()`: the running step's list."""

    def wrap(fn):
        if fn is None:
            return None

        def run(target, args, kwargs, recompute, **extra):
            token = WEIGHT_DEFERRED.set(True)
            try:
                out = fn(target, args, kwargs, recompute, **extra)
            finally:
                WEIGHT_DEFERRED.reset(token)
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                x = args[0] if args else kwargs["input"]
                out.register_hook(functools.partial(_record, records(), name, x.detach()))
            return out

        return run

    return dataclasses.replace(impl, run=wrap(impl.run), state_from_inputs=wrap(impl.state_from_inputs))


def _record(records: list, name: str, x: torch.Tensor, g: torch.Tensor) -> None:
    records.append(Captured(name, x, g, (x._version, g._version)))


def weight_gradients(module: nn.Module, x: torch.Tensor, g: torch.Tensor):
    """(weight gradient, bias gradient) of `module` (an nn.Conv2d or nn.Linear) from its input and
    its output's gradient; None for a parameter that needs none."""
    weight, bias = module.weight, module.bias
    want_bias = bias is not None and bias.requires_grad
    if isinstance(module, nn.Conv2d):
        _, gw, gb = torch.ops.aten.convolution_backward(
            g,
            x,
            weight,
            None if bias is None else list(bias.shape),
            list(module.stride),
            list(module.padding),
            list(module.dilation),
            False,
            [0, 0],
            module.groups,
            [False, weight.requires_grad, want_bias],
        )
        return gw, gb
    g2 = g.reshape(-1, g.shape[-1])
    gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if weight.requires_grad else None
    return gw, (g2.sum(0) if want_bias else None)


def workspace_bytes(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> int:
    """Bytes `weight_gradients` allocates beyond the gradients it returns, measured here (the
    problem's `Node.deferred_workspace_bytes`): on CPU a convolution's weight gradient passes
    through a temporary of its own size (measured on ResNet's layer2-4 shapes)."""
    from monet_opt.memory import measure_peak

    weight_gradients(module, x, g)  # (warm: the first call may allocate once-only scratch)
    made = sum(p.numel() * p.element_size() for p in (module.weight, module.bias) if p is not None)
    return max(0, measure_peak(lambda: weight_gradients(module, x, g)).peak_bytes - made)


def make_weight_gradients(
    records: list[Captured], targets: dict[str, nn.Module]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, gradient) of the first recorded node, its record taken off `records` and let
    go of once its gradients are made (the memory model's end of the step: node by node)."""
    r = records.pop(0)
    if (r.x._version, r.g._version) != r.versions:
        raise RuntimeError(
            f"deferred weight gradient of {r.node!r}: its input or output gradient was written in "
            "place after its backward; solve without deferred weight gradients"
        )
    module = targets[r.node]
    gw, gb = weight_gradients(module, r.x, r.g)
    del r
    return [(p, g) for p, g in ((module.weight, gw), (module.bias, gb)) if g is not None]
