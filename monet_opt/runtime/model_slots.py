"""Whether a model still holds the submodules, parameters, buffers, hooks and Python values a
wrapper traced.

A wrapper runs the graph traced from the model as it was when wrapped: the graph holds the
submodules and tensors it found then, and the Python values its code read then are constants in
it. A submodule, parameter or buffer put on the model since (`model.fc = nn.Linear(...)`,
`model.fc.weight = nn.Parameter(...)`, `model.to(device)` moving buffers), a module hook
registered since, or a number, string, flag or forward changed on a module the trace went
through (a temperature annealed, `block.drop_prob = 0.2`, `block.eval()`, `block.forward = f`)
would not be seen by that graph, silently; nor would convolution weights laid out otherwise
(`model.to(memory_format=torch.channels_last)` keeps the Parameter objects): the wrapper asks
`ModelSlots.changed()` before each step (14 us ResNet-18, 30 us ResNet-50; the weights' strides,
session 45, add 5 and 14 us) and traces the model again when it names something (refuses the
step when weights changed layout). (Modules the graph calls whole read their own values when
called.)
"""

from __future__ import annotations

from torch import nn

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_VALUES = (bool, int, float, str, type(None))  # Python values code reads (fx makes them constants)
_MISSING = object()


class ModelSlots:
    """The objects in every slot of `model`'s modules, as they are now. The graph calls its
    `leaves` (module paths) as modules, which read their own buffers and hooks when called:
    inside a leaf only submodules and parameters are followed (the executor lists a leaf's
    parameters once; a leaf that assigns its buffers in its forward changes them every step)."""

    def __init__(self, model: nn.Module, leaves: set[str]) -> None:
        self._slots = []  # (where, the slot's dict, its key, the object in it)
        self._hooks = []  # (where, a hook dict, how many hooks it held)
        self._values = []  # (where, a module's __dict__, the key, the value it held)
        # (where, a convolution weight, its strides: `model.to(memory_format=...)` keeps the
        # Parameter objects and changes their layout, for which the schedule's memory model is not)
        self._strides = []
        for name, module in model.named_modules():
            parts = name.split(".")
            inside = any(".".join(parts[: k + 1]) in leaves for k in range(len(parts)))  # (in a leaf, or one)
            prefix = f"{name}." if name else ""
            kinds = (
                (module._modules, module._parameters)
                if inside
                else (module._modules, module._parameters, module._buffers)
            )
            for slots in kinds:
                if not isinstance(slots, dict):
                    continue  # (a TorchScript module's slots, fixed when it was scripted)
                self._slots.extend((prefix + key, slots, key, value) for key, value in slots.items())
            if isinstance(module._parameters, dict):
                self._strides.extend(
                    (f"{prefix}{key} (layout)", p, p.stride())
                    for key, p in module._parameters.items()
                    if p is not None and p.dim() in (4, 5)
                )
            if not inside:
                own = vars(module)
                self._values.extend((prefix + k, own, k, v) for k, v in own.items() if type(v) in _VALUES)
                if name:  # (a forward set on a submodule; the model's own is the wrapper's to set)
                    self._values.append((prefix + "forward", own, "forward", own.get("forward", _MISSING)))
            for kind in () if inside or not name else _HOOKS:  # (the model's own: run by the wrapper)
                hooks = getattr(module, kind, None)
                if hooks is not None:
                    self._hooks.append((f"{name} ({kind.strip('_')})", hooks, len(hooks)))

    def changed(self) -> list[str]:
        """The slots holding another object than when recorded, the modules whose hooks changed
        in number, and the Python values that changed, named (empty if none)."""
        if (
            all(slots.get(key) is value for _, slots, key, value in self._slots)
            and all(len(hooks) == n for _, hooks, n in self._hooks)
            and all(_same(own.get(key, _MISSING), value) for _, own, key, value in self._values)
            and all(p.stride() == stride for _, p, stride in self._strides)
        ):
            return []
        return (
            [where for where, slots, key, value in self._slots if slots.get(key) is not value]
            + [where for where, hooks, n in self._hooks if len(hooks) != n]
            + [where for where, own, key, value in self._values if not _same(own.get(key, _MISSING), value)]
            + [where for where, p, stride in self._strides if p.stride() != stride]
        )


def _same(now: object, then: object) -> bool:
    return now is then or (type(now) is type(then) and now == then)
