"""Random tensors a model draws from shapes alone are nodes of its graph, not constants.

torch.fx records a call only when one of its arguments is traced: `torch.randn(4, 16)`, or a
noise drawn for a shape the concrete trace answered with numbers (`torch.randn(x.shape)`,
`Normal(mu, std).rsample()`, which draws `torch.empty(shape).normal_()`), ran once while
tracing and became a constant of the graph: the same noise every step. (Trace's check caught it,
as the eager run drew other numbers: a VAE failed to trace.) While tracing, `track(tracer)`
records these draws as call_function nodes; the runtime's RNG replay then gives a recomputation
the forward's numbers, as for dropout.

Distribution argument checks (`validate_args`, on by default) branch on tensor values, which
no static graph holds: they are switched off while tracing, so the traced graph does not check
a distribution's arguments in training (eager and eval runs still do).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

# draws whose arguments may be all numbers (the *_like ones take a tensor: fx records them)
_FACTORIES = ("rand", "randn", "randint", "randperm", "normal")


def _standard_normal(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.distributions' draw of standard normal noise, as one call (a node)."""
    return torch.randn(shape, dtype=dtype, device=device)


@contextlib.contextmanager
def track(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing: random draws from numbers alone are recorded (see the module docstring)."""
    import torch.distributions as distributions

    def recorded(original: Callable) -> Callable:
        def draw(*args: Any, **kwargs: Any) -> Any:
            if getattr(tracer, "_computing", False) or any(
                isinstance(a, fx.Proxy) for a in tree_flatten((args, kwargs))[0]
            ):
                return original(*args, **kwargs)  # (computing a value, or fx records it anyway)
            return tracer.create_proxy("call_function", original, args, kwargs)

        return draw

    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for name in _FACTORIES:
        patch(torch, name, recorded(getattr(torch, name)))
    standard_normal = recorded(_standard_normal)
    for module in [m for k, m in list(sys.modules.items()) if k.startswith("torch.distributions.")]:
        if getattr(module, "_standard_normal", None) is not None:
            patch(module, "_standard_normal", standard_normal)
    validate = distributions.Distribution._validate_args
    distributions.Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        distributions.Distribution.set_default_validate_args(validate)
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)
