"""Run what a model computes inside its own `torch.autocast` blocks under the same autocast.

torch.fx records operations, not the autocast state they ran in: in

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = self.mlp(x)

the traced graph would compute `y` in float32 (trace's check then failed: 'the traced model
differs from the eager model'), and a block that turns autocast off (`enabled=False`, for a
softmax or a rotary embedding kept in float32) would run in bfloat16 when the user trains under
autocast. While tracing, `track(tracer)` follows the autocast blocks the model's code enters; each
node created inside one gets `node.meta[AUTOCAST]`: the autocast state, per device type the
blocks name, at that point. Every run of the node (the trace's own measurement run, profiling,
the runtime's forward and recomputations) goes through `under(spec)`: the model's own state,
whatever autocast the caller has around it, as in plain PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from monet_opt.ops.base import Implementation

AUTOCAST = "monet_opt_autocast"  # fx node meta: ((device type, enabled, dtype), ...)
Spec = tuple[tuple[str, bool, torch.dtype], ...]

_autocast = torch.amp.autocast_mode.autocast


@contextlib.contextmanager
def track(tracer: Any) -> Iterator[None]:
    """While tracing: keep `tracer.autocast_devices`, the device types of the autocast blocks
    the model's code is inside (a stack)."""
    tracer.autocast_devices = []
    enter, exit_ = _autocast.__enter__, _autocast.__exit__

    def entering(self):
        tracer.autocast_devices.append(self.device)
        return enter(self)

    def exiting(self, *exc):
        if tracer.autocast_devices:
            tracer.autocast_devices.pop()
        return exit_(self, *exc)

    _autocast.__enter__, _autocast.__exit__ = entering, exiting
    try:
        yield
    finally:
        _autocast.__enter__, _autocast.__exit__ = enter, exit_


def spec_now(devices: list[str]) -> Spec | None:
    """The autocast state now, for each device type in `devices` (None if there are none)."""
    if not devices:
        return None
    return tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in sorted(set(devices)))


@contextlib.contextmanager
def under(spec: Spec | None) -> Iterator[None]:
    """Autocast as `spec` says (nothing changed for None)."""
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in spec or ():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield


@contextlib.contextmanager
def without_cast_cache() -> Iterator[None]:
    """Autocast's cache of weight casts off (what autocast regions entered inside inherit), as
    the runtime runs (`runtime.wrapper._autocast`): profiling under the caller's autocast with
    the cache on measured a node's forward after its weight's lower-precision copy was cached by
    an earlier run, so the copy the runtime makes was missing from its workspace (resnet18 b4 64
    under bfloat16: the stem convolution's 18816 B, a schedule measured over its budget)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Backward kernels run as in a plain `loss.backward()` outside autocast: the wrapper's
    backward runs under the forward's autocast (for recomputation), and a backward formula made
    of autocast-listed ops (attention's math path, with dropout) would otherwise run in other
    dtypes (GPT-2 under bf16: gradients 0.5 % off plain's); profiling under the caller's autocast
    measures backwards so too (a chunked convolution backward failed on mixed dtypes)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def with_spec(impls: list[Implementation], spec: Spec | None) -> list[Implementation]:
    """The implementations, each running under `spec` (unchanged for None)."""
    if not spec:
        return impls
    return [
        dataclasses.replace(
            impl,
            run=_running_under(impl.run, spec),
            state_from_inputs=None
            if impl.state_from_inputs is None
            else _running_under(impl.state_from_inputs, spec),
        )
        for impl in impls
    ]


def _running_under(run, spec: Spec):
    def run_under(*args, **kwargs):
        with under(spec):
            return run(*args, **kwargs)

    return run_under


def to_json(spec: Spec) -> list:
    """[[device, enabled, dtype name], ...] (schedule metadata)."""
    return [[d, e, str(t).removeprefix("torch.")] for d, e, t in spec]


def from_json(rows: list) -> Spec:
    return tuple((str(d), bool(e), getattr(torch, str(t))) for d, e, t in rows)


def describe(spec: Spec | None) -> str:
    """For cache keys: '' for None."""
    return "" if not spec else repr([(d, e, str(t)) for d, e, t in spec])
