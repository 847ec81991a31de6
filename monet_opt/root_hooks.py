"""The model's own hooks (registered on the model itself, not a submodule), run around its step.

`model(x)` runs the model's forward pre-hooks, forward hooks and backward hooks around
`model.forward`; torch.fx traces `forward` alone. A schedule is for `forward`: tracing and its
checks run with these hooks `off`, and the wrapper runs its training step `through` them, as
`nn.Module.__call__` runs `forward` (a pre-hook that changes the inputs, a forward hook that
changes or records the output, a full backward hook: as in plain PyTorch). Before, the trace's
check compared the graph with the hooked eager model and refused the model ("the traced ...
differs from the eager model"). A submodule's hooks are another matter: such a submodule is
kept as one node (`monet_opt.graph`). torch's global module hooks (every module's call runs them)
are not followed: `global_hooks` says which are registered, and the wrapper warns once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)
_MISSING = object()


_GLOBAL_HOOKS = {
    "_global_forward_pre_hooks": "forward pre-hooks",
    "_global_forward_hooks": "forward hooks",
    "_global_backward_pre_hooks": "backward pre-hooks",
    "_global_backward_hooks": "backward hooks",
}


def global_hooks() -> list[str]:
    """Which kinds of torch's global module hooks (`nn.modules.module.register_module_forward_hook`
    and its kin: every module's call runs them) are registered now. A wrapped step runs them
    where its graph calls a module whole (again when recomputing it), not for modules the trace
    went through."""
    return [label for attr, label in _GLOBAL_HOOKS.items() if getattr(nn.modules.module, attr, None)]


def any_on(model: nn.Module) -> bool:
    """Whether `model` has forward or backward hooks of its own."""
    return bool(
        model._forward_pre_hooks or model._forward_hooks or model._backward_pre_hooks or model._backward_hooks
    )


@contextmanager
def off(model: nn.Module) -> Iterator[None]:
    """`model`'s own hooks taken off while the block runs, then put back (the same dicts)."""
    saved = {name: getattr(model, name) for name in _HOOK_DICTS if hasattr(model, name)}
    try:
        for name in saved:
            object.__setattr__(model, name, OrderedDict())
        yield
    finally:
        for name, hooks in saved.items():
            object.__setattr__(model, name, hooks)


def through(model: nn.Module, step: Callable[..., Any], inputs: tuple, named: dict[str, Any]) -> Any:
    """`step(*inputs, **named)` called as `model(*inputs, **named)` calls `model.forward`: inside
    the model's own hooks."""
    own = vars(model).get("forward", _MISSING)  # (a forward set on the instance is put back)
    object.__setattr__(model, "forward", step)
    try:
        return model(*inputs, **named)
    finally:
        if own is _MISSING:
            del model.__dict__["forward"]
        else:
            object.__setattr__(model, "forward", own)
