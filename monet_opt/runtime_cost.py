"""The runtime's own cost of a recomputation, measured on the device (`Problem.recompute_overhead_s`).

A node's measured times are its kernels'. Run again in a backward stage, a node also costs the
executor's dispatch (the forward runs as generated code, `runtime/segments.py`; a recomputation
goes through the executor step by step) and, recomputed with grad, a small autograd graph of its
own: one more backward call, where a plain step backs the whole forward in one. On this 2-core
CPU that is ~0.14 ms per recomputed node beside kernels of a few microseconds to milliseconds:
timm's ConvNeXt-Tiny at batch 2, 64x64, recomputing 37 small nodes, measured +12 % where the
kernels alone predicted -2 %.

`recompute_overhead(device)` measures it once per device and caches it with the operator
profile: a chain of small linear layers and GELUs (80 nodes), run through `MonetWrapper` with no
recomputation and with every node recomputed in its own backward stage
(`solver.baselines.checkpoint_all`), timed in paired rounds; the overhead is the measured
difference beyond the simulator's predicted one, per recomputation. Recomputations that share
one autograd graph (a checkpointed segment, `runtime/groups.py`) cost less (measured ~0.03 ms):
predictions err high for them.
"""

from __future__ import annotations

import statistics

import torch
from torch import nn

CACHE_KEY = "runtime:recompute_overhead:v1"
ROUNDS = 21
_measured: dict[str, float] = {}  # device key -> seconds, for this process


def _chain(device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    """The probe: 40 x (Linear(64, 64), GELU), batch 8; built without touching the caller's RNG."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        layers = [m for _ in range(40) for m in (nn.Linear(64, 64), nn.GELU())]
        model = nn.Sequential(*layers).to(device)
        x = torch.randn(8, 64, device=device)
    return model, x


def measure(device: torch.device, rounds: int = ROUNDS, use_cache: bool = True) -> float:
    """Seconds per recomputation beyond its kernels' predicted time (>= 0), measured now."""
    from monet_opt.bench import interleaved_samples
    from monet_opt.profile import build_problem
    from monet_opt.runtime import MonetWrapper
    from solver import simulate
    from solver.baselines import checkpoint_all, no_recompute

    model, x = _chain(device)
    problem = build_problem(
        model, (x,), device=device, progress=False, use_cache=use_cache, recompute_overhead=0.0
    )
    plain, every = no_recompute(problem), checkpoint_all(problem)
    count = sum(1 for stage in every.stages[1:] for step in stage.steps if step.op == "compute")
    a = MonetWrapper(model, plain, example_inputs=(x,))
    b = MonetWrapper(model, every, example_inputs=(x,))
    ta, tb = interleaved_samples(a, b, (x,), rounds)
    measured = statistics.median(y - z for z, y in zip(ta, tb))
    predicted = simulate(problem, every).time_s - simulate(problem, plain).time_s
    return max(0.0, (measured - predicted) / max(count, 1))


def recompute_overhead(device: torch.device | str, use_cache: bool = True) -> float:
    """`measure(device)`, cached by device in the profile cache (`monet_opt.profile.ProfileCache`:
    measured again when it was measured on a busy CPU that is quiet now)."""
    from monet_opt.profile import ProfileCache, cpu_load

    device = torch.device(device)
    cache = ProfileCache(device, enabled=use_cache)
    if use_cache and cache.device_key in _measured:
        return _measured[cache.device_key]
    load = cpu_load() if device.type == "cpu" else None
    entry = cache.get(CACHE_KEY, load)
    if entry is None:
        entry = {"seconds": measure(device, use_cache=use_cache)}
        cache = ProfileCache(device, enabled=use_cache)  # (the probe's own profile wrote to it)
        cache.put(CACHE_KEY, entry, load)
        cache.save()
    seconds = float(entry["seconds"])
    if use_cache:
        _measured[cache.device_key] = seconds
    return seconds
