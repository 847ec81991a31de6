"""Keep what a model computes under `torch.no_grad()` out of its gradients.

torch.fx records operations, not the grad mode they ran in: in

    with torch.no_grad():
        scale = y.norm(dim=1, keepdim=True) + 1
    return self.b(y / scale)

the traced graph computes `scale` like any other node, and run with gradients it sends one
through `scale` to `y` that plain PyTorch does not (measured: gradients 16 % off). The tracer marks
every node it creates while gradients are off (`NO_GRAD`; the teacher of a distillation loss, a
norm used as a constant, a mask), and `detach_no_grad_values` hands each marked value that leaves
its region to the rest of the graph through `no_grad_value`, which detaches it: the same values,
and no gradient into the region, as in plain PyTorch. Nodes inside the region then need no
backward (`build_problem` finds none reaches them) and run without one.

What it cannot express it refuses, naming the node: an in-place change, made under no_grad, of a
value computed with gradients (plain PyTorch keeps that value's gradient path through the change).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from monet_opt.functionalize import mutated_argument, setitem_out_of_place

NO_GRAD = "monet_opt_no_grad"  # fx node meta key: created while gradients were off
_CALLS = ("call_function", "call_method", "call_module")


@contextlib.contextmanager
def track(tracer: Any) -> Iterator[None]:
    """While tracing: keep `tracer.python_grad`, the grad mode Python code last set
    (`torch.no_grad()`, `torch.set_grad_enabled`, `torch.enable_grad()` all go through
    `torch._C._set_grad_enabled`). A custom autograd.Function's forward also runs with gradients
    off, set in C++: fx traces it inline (Bloom's GELU), and its nodes are not the model's
    no_grad code (marked as such, Bloom's gradients stopped at its GELUs)."""
    real = torch._C._set_grad_enabled
    tracer.python_grad = torch.is_grad_enabled()

    def setting(mode: bool) -> None:
        if not getattr(tracer, "_computing", False):  # (not the concrete trace's own no_grad)
            tracer.python_grad = bool(mode)
        return real(mode)

    torch._C._set_grad_enabled = setting
    try:
        yield
    finally:
        torch._C._set_grad_enabled = real


def made_without_grad(tracer: Any) -> bool:
    """Whether a node created now is the model's no_grad code (see `track`)."""
    return not torch.is_grad_enabled() and not getattr(tracer, "python_grad", True)


def no_grad_value(value: Any) -> Any:
    """A value the model computed under torch.no_grad(): its tensors detached."""
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, value)


def detach_no_grad_values(gm: fx.GraphModule) -> list[str]:
    """Route every value a no-grad node hands to a node outside its region (or to the output)
    through `no_grad_value`. Returns the names of the nodes so routed. Raises ValueError naming a
    no-grad node that changes a value computed with gradients in place."""
    marked = {n for n in gm.graph.nodes if n.op in _CALLS and n.meta.get(NO_GRAD)}
    for n in marked:
        # (functionalize has made every `x[i] = v` a setitem_out_of_place of x)
        arg = n.args[0] if n.target is setitem_out_of_place else mutated_argument(n, gm)
        if isinstance(arg, fx.Node) and arg.op in _CALLS and arg not in marked:
            raise ValueError(
                f"node {n.name!r} changes {arg.name!r} in place under torch.no_grad(), and "
                f"{arg.name!r} was computed with gradients: plain PyTorch keeps its gradient "
                "through the change, which a traced graph cannot express. Make the module doing "
                "it a leaf (monet_opt.trace: leaf_modules=[...]), or change a copy"
            )
    routed = []
    for n in [n for n in gm.graph.nodes if n in marked]:
        outside = [u for u in n.users if u not in marked]
        if not outside:
            continue
        with gm.graph.inserting_after(n):
            detached = gm.graph.call_function(no_grad_value, (n,))
        for u in outside:
            u.replace_input_with(n, detached)
        routed.append(n.name)
    if routed:
        gm.graph.lint()
        gm.recompile()
    return routed
