"""Whether a model still holds the submodules, parameters, buffers and hooks a wrapper traced.

A wrapper runs the graph traced from the model as it was when wrapped: the graph holds the
submodules and tensors it found then. A submodule, parameter or buffer put on the model since
(`model.fc = nn.Linear(...)`, `model.fc.weight = nn.Parameter(...)`, `model.to(device)` moving
buffers) or a module hook registered since would not be run by that graph, silently: the
wrapper asks `ModelSlots.changed()` before each step (20-50 us on ResNet-18/50) and traces the
model again when it names something.
"""

from __future__ import annotations

from torch import nn

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


class ModelSlots:
    """The objects in every slot of `model`'s modules, as they are now."""

    def __init__(self, model: nn.Module) -> None:
        self._slots = []  # (where, the slot's dict, its key, the object in it)
        self._hooks = []  # (where, a hook dict, how many hooks it held)
        for name, module in model.named_modules():
            prefix = f"{name}." if name else ""
            for slots in (module._modules, module._parameters, module._buffers):
                self._slots.extend((prefix + key, slots, key, value) for key, value in slots.items())
            for kind in _HOOKS:
                hooks = getattr(module, kind, None)
                if hooks is not None:
                    self._hooks.append((f"{name or 'the model'} ({kind.strip('_')})", hooks, len(hooks)))

    def changed(self) -> list[str]:
        """The slots holding another object than when recorded, and the modules whose hooks
        changed in number, named (empty if none)."""
        if all(slots.get(key) is value for _, slots, key, value in self._slots) and all(
            len(hooks) == n for _, hooks, n in self._hooks
        ):
            return []
        return [where for where, slots, key, value in self._slots if slots.get(key) is not value] + [
            where for where, hooks, n in self._hooks if len(hooks) != n
        ]
