"""Keep a model's custom `torch.autograd.Function`s whole: one node each, run as written.

torch.fx traces `MyFunction.apply(x)` inline: the ops of its forward become nodes, and the
backward the model wrote is lost; the traced graph is differentiated by autograd instead. Where
that backward is not the forward's derivative, the gradients were silently wrong: a
straight-through estimator (`round` forward, identity backward: 0.07 off a weight gradient of
norm 0.29 on a test model), a gradient-reversal layer. While tracing, `track(tracer)` makes each
`Function.apply` whose arguments a graph can hold one call_function node (`function_node`), whose
call is `cls.apply(...)`: the profiler measures, and the runtime runs and recomputes, the model's
own forward and backward. Arguments a graph cannot hold leave the call to fx, as before.
`torch.utils.checkpoint`'s reentrant form (a Function given the function it wraps) is traced as
that function's call: its forward ran the function under no_grad, which sent no gradient (and
before, with its ops traced as any others, the reentrant call failed in profiling); the schedule
decides what is recomputed. The non-reentrant form was traced through already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointFunction

_NODES: dict[type, Callable] = {}
_PLAIN = (torch.Tensor, fx.Proxy, int, float, bool, complex, str, type(None), torch.dtype, torch.device)


def function_node(cls: type) -> Callable:
    """The call_function target standing for `cls.apply` (one per Function class)."""
    fn = _NODES.get(cls)
    if fn is None:

        def fn(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)

        fn.__name__ = fn.__qualname__ = f"{cls.__name__}_apply"
        _NODES[cls] = fn
    return fn


@contextlib.contextmanager
def track(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing: `Function.apply` on traced values records one node (see the module
    docstring)."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is CheckpointFunction:
            # torch.utils.checkpoint's reentrant form: the function it wraps, traced as called
            # (inline, its forward ran under no_grad and sent no gradient); what to recompute is
            # the schedule's to decide. (args: the function, preserve_rng_state, its inputs)
            return args[0](*args[2:])
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(a, fx.Proxy) for a in flat) and all(isinstance(a, _PLAIN) for a in flat):
            return tracer.create_proxy("call_function", function_node(cls), args, kwargs)
        return original.__get__(None, cls)(*args, **kwargs)

    base.apply = classmethod(apply)
    try:
        yield
    finally:
        base.apply = original
