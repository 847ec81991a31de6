"""Attributes a module's forward assigns from its inputs, found and undone after tracing.

torch.fx records operations, not attribute assignments. A forward that assigns a buffer or an
attribute from what it computes (`self.running = 0.9 * self.running + 0.1 * x.mean(0)`, a
feature kept for an auxiliary loss: `self.features = h`) leaves an fx Proxy on the module when
traced: the model then fails far from the cause, and the traced graph never makes the assignment
(the buffer never moves in training). `trace` takes a `snapshot` before tracing, and
`undo_proxies` puts back what tracing set to a Proxy and names the modules that set it: they are
kept as one node each, which runs eagerly, assignment included (`monet_opt.module_state` replays
their buffers where a schedule recomputes them).
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

_MISSING = object()
_SLOT_DICTS = ("_buffers", "_parameters", "_modules")  # (looked into as themselves)


def snapshot(model: nn.Module) -> list[tuple[str, nn.Module, dict[str, dict[str, Any]]]]:
    """Every module's attributes, buffers and parameters, as shallow copies."""
    return [
        (
            name,
            m,
            {"__dict__": dict(vars(m)), "_buffers": dict(m._buffers), "_parameters": dict(m._parameters)},
        )
        for name, m in model.named_modules(remove_duplicate=False)
    ]


def undo_proxies(before: list[tuple[str, nn.Module, dict[str, dict[str, Any]]]]) -> dict[str, list[str]]:
    """Put back every attribute, buffer or parameter that now holds an fx Proxy (or a container
    of them) as it was in `before`; returns, by module path, the names each module had set so."""
    assigned: dict[str, list[str]] = {}
    for path, m, kinds in before:
        for kind, old in kinds.items():
            slots = vars(m) if kind == "__dict__" else getattr(m, kind)
            for key, value in list(slots.items()):
                if key in _SLOT_DICTS or not _holds_proxy(value):
                    continue
                assigned.setdefault(path, []).append(key)
                was = old.get(key, _MISSING)
                if was is _MISSING:
                    del slots[key]
                else:
                    slots[key] = was
    return assigned


def _holds_proxy(value: Any) -> bool:
    if isinstance(value, fx.Proxy):
        return True
    if isinstance(value, (list, tuple)):
        return any(isinstance(v, fx.Proxy) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, fx.Proxy) for v in value.values())
    return False
