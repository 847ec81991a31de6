"""The implementation registry: for each fx node, the implementations it can run with.

    implementations_for(op, target, example_args=None, example_kwargs=None) -> list[Implementation]

`op` is the fx node op ('call_module' | 'call_function' | 'call_method'), `target` the resolved
target (module instance, function object, or method name). The first entry is always "default":
the op as the model wrote it, except that in-place forms run out of place (inputs are never
mutated) and batch norm does not update its running statistics when `recompute=True`.
Every other entry computes the same value with a backward that keeps something different
(see each family module). Unknown ops get only the out-of-place default.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import activation, attention, conv, elementwise, linear, norm, pool
from .base import DEFAULT, Implementation, call_target
from .common import out_of_place_default

# Order matters only where matchers overlap (they do not today).
FAMILIES = {
    "activation": activation,
    "norm": norm,
    "pool": pool,
    "conv": conv,
    "attention": attention,
    "dropout": elementwise,
    "linear": linear,
}

__all__ = [
    "DEFAULT",
    "FAMILIES",
    "Implementation",
    "call_target",
    "describe_registry",
    "family_of",
    "implementations_for",
    "makes_gradients",
]


def family_of(op: str, target: Any) -> str | None:
    """Name of the family handling this op, or None for the generic default."""
    for name, module in FAMILIES.items():
        try:
            if module.matches(op, target):
                return name
        except TypeError:  # unhashable targets in `in` checks
            continue
    return None


# Ops whose backward hands the incoming gradient itself to the first argument (add: to both,
# sub: -grad to the second): that argument's gradient needs no new buffer (`grad_in_place`).
_PASS_THROUGH_FUNCTIONS = (operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub)
_PASS_THROUGH_METHODS = ("add", "add_", "sub", "sub_")


def passes_gradient(op: str, target: Any) -> bool:
    """The op hands its output's gradient on as an input's gradient (add, sub): no new buffer."""
    if op == "call_method":
        return target in _PASS_THROUGH_METHODS
    return op == "call_function" and any(target is f for f in _PASS_THROUGH_FUNCTIONS)


# families whose backward makes a new buffer for every input's gradient (their implementations
# that write into the gradient they are fed, `grad_in_place`, hand that buffer on instead)
_NEW_GRADIENT_FAMILIES = ("activation", "norm", "pool", "conv", "linear")


_NEW_GRADIENT_MODULES = (
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)
_NEW_GRADIENT_FUNCTIONS = (F.avg_pool2d, F.adaptive_avg_pool2d, F.adaptive_max_pool2d)


def makes_gradients(op: str, target: Any) -> bool:
    """The op's default backward makes each input's gradient in a new buffer: never the
    gradient it is fed, nor a view of it (a convolution, a norm, a pooling, a ReLU)."""
    if op == "call_module" and isinstance(target, _NEW_GRADIENT_MODULES):
        return True
    if op == "call_function" and any(target is f for f in _NEW_GRADIENT_FUNCTIONS):
        return True
    return family_of(op, target) in _NEW_GRADIENT_FAMILIES


_SHARING_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_SHARING_METHODS = ("add", "add_")


def shares_gradient(op: str, target: Any, kwargs: dict) -> bool:
    """The op's backward hands its output's gradient, the same tensor, to every argument of the
    output's shape and dtype (an addition without `alpha`: autograd's AddBackward)."""
    if kwargs:
        return False
    if op == "call_method":
        return target in _SHARING_METHODS
    return op == "call_function" and any(target is f for f in _SHARING_FUNCTIONS)


def implementations_for(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    """Implementations for one fx node; the first is always named "default"."""
    family = family_of(op, target)
    if family is None:
        impls = [out_of_place_default(op, target)]
        if passes_gradient(op, target):
            impls = [dataclasses.replace(impls[0], grad_in_place=True)]
    else:
        impls = FAMILIES[family].implementations(op, target, example_args, example_kwargs)
    assert impls and impls[0].name == "default", (op, target, impls)
    names = [i.name for i in impls]
    assert len(set(names)) == len(names), names
    # (one not written for autocast runs the default under it: a schedule solved without
    # autocast may be trained with it)
    # (and its state made from inputs is the default's under autocast, none if the default has none)
    return [
        i
        if i.autocast
        else dataclasses.replace(
            i,
            run=_default_under_autocast(i.run, impls[0].run),
            state_from_inputs=None
            if i.state_from_inputs is None or impls[0].state_from_inputs is None
            else _default_under_autocast(i.state_from_inputs, impls[0].state_from_inputs),
        )
        for i in impls
    ]


def _default_under_autocast(run: Callable, default: Callable) -> Callable:
    def run_or_default(target: Any, args: tuple, kwargs: dict, recompute: bool, **extra: Any) -> Any:
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type):
            return default(target, args, kwargs, recompute, **extra)
        return run(target, args, kwargs, recompute, **extra)

    return run_or_default


def describe_registry() -> list[tuple[str, list[str]]]:
    """(family, implementation names) for docs and the CLI. Names marked * depend on the device."""
    rows: list[tuple[str, list[str]]] = []
    for module in (activation, norm, pool, conv, attention, elementwise, linear):
        rows.extend((name, list(impls)) for name, impls in module.IMPLEMENTATION_NAMES.items())
    rows.extend((name, list(impls)) for name, impls in elementwise.DEFAULT_ONLY.items())
    return rows
