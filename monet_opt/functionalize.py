"""Make a traced graph's in-place mutations explicit, so that running every op out of place
computes what the model computes.

The runtime runs every node out of place (`monet_opt.ops.common`: it may need a node's inputs
again, for another consumer or a recomputation). That gives the model's values only if every
later reader of a mutated tensor reads it through the mutating node. Python code does not
always: timm's `drop_path` is

    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    random_tensor.div_(keep_prob)        # result unused: the mutation is the point
    return x * random_tensor

and fx records the product as reading `bernoulli_`, not `div_`: run out of place, the mask
would never be scaled (measured: timm's Swin-T with its default stochastic depth, gradients
8 % off plain PyTorch's). `functionalize(gm)` rewires such reads:

* a node that mutates its first argument and returns it (tensor methods ending in "_",
  `torch.relu_` and the like, `operator.iadd` and the other in-place operators, functions called
  with `inplace=True`, modules whose `inplace` is True): every node after it that reads the
  argument reads the node instead;
* `x[idx] = v` (`operator.setitem`, which returns None): replaced by `setitem_out_of_place`,
  which returns an updated copy, and later readers of `x` read that.

What it cannot rewire (a mutation seen through another view of the same storage) the tracer
refuses, naming the nodes (`monet_opt.graph._Measure`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from monet_opt.ops.common import INPLACE_OPERATORS, inplace_position, is_mutating_method_name

__all__ = ["functionalize", "mutated_argument", "setitem_out_of_place"]


def setitem_out_of_place(x: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    """`x[index] = value` without touching `x`: the updated copy."""
    out = x.clone()
    out[index] = value
    return out


def _inplace_flag(fn: Any, args: tuple, kwargs: dict) -> bool:
    """`fn(..., inplace=True)`, by keyword or position."""
    if kwargs.get("inplace") is True:
        return True
    pos = inplace_position(fn)
    return pos is not None and len(args) > pos and args[pos] is True


def mutated_argument(n: fx.Node, gm: fx.GraphModule) -> fx.Node | None:
    """The node whose value `n` mutates in place and returns (its first argument), if any."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.op == "call_method":
        mutates = is_mutating_method_name(str(n.target))
    elif n.op == "call_function":
        if n.target in INPLACE_OPERATORS:
            mutates = True
        elif getattr(n.target, "__module__", None) in ("operator", "_operator"):
            mutates = False  # operator.and_, or_, not_: no mutation despite the name
        else:
            name = getattr(n.target, "__name__", "")
            mutates = is_mutating_method_name(name) or _inplace_flag(n.target, n.args, n.kwargs)
    elif n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        mutates = isinstance(mod, nn.Module) and getattr(mod, "inplace", False) is True
    else:
        mutates = False
    return n.args[0] if mutates else None


def functionalize(gm: fx.GraphModule) -> list[str]:
    """Rewire later readers of each mutated value to the mutating node (see the module
    docstring); returns the names of the nodes whose mutation some later node now reads."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    rewired: list[str] = []
    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is operator.setitem and isinstance(n.args[0], fx.Node):
            n.target = setitem_out_of_place
            changed = True
            arg = n.args[0]
        else:
            arg = mutated_argument(n, gm)
        if arg is None:
            continue
        later = [u for u in arg.users if u is not n and order[u] > order[n]]
        for u in later:
            u.replace_input_with(arg, n)
        if later:
            rewired.append(n.name)
    if rewired or changed:
        gm.graph.lint()
        gm.recompile()
    return rewired
