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

`backward_call_overhead(device)` measures the engine's fixed cost of one backward call (~24 us
here). A node's isolated backward time (`profile.measure_node`) is one such call, while a
training step backs all the nodes of a shared graph in one: `build_problem` takes it off every
node's backward time. Every schedule runs each node's backward once, so that lowers every
schedule's predicted time alike; the no-recompute step, one call in the runtime, is no longer
predicted ~24 us per node too slow (MobileNetV2 b8 64: ~150 nodes, 4 ms of a 62-ms step).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

CACHE_KEY = "runtime:recompute_overhead:v1"
ENGINE_CALL_KEY = "runtime:backward_call:v1"
ROUNDS = 21
_measured: dict[tuple[str, str], float] = {}  # (device key, cache key) -> seconds, for this process


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


def backward_call(device: torch.device, calls: int = 400) -> float:
    """Seconds of the autograd engine's fixed cost per backward call, measured now: the median
    of `calls` backward calls through the runtime's root (`profile._root`) of a one-element
    clone. Every node's isolated backward time (`profile.measure_node`) includes one such call;
    a training step's shared graph pays one for all its nodes (`build_problem` subtracts it)."""
    from monet_opt.profile import _root, _sync

    x = torch.zeros(1, device=device, requires_grad=True)
    g = torch.ones(1, device=device)
    empty = torch.empty(0, device=device)
    times = []
    for k in range(calls + calls // 4):  # (the first quarter: warm-up)
        root = _root([g], [x.clone()])
        _sync(device)
        t0 = time.perf_counter()
        torch.autograd.backward(root, empty)
        _sync(device)
        if k >= calls // 4:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cached(device: torch.device | str, key: str, measure_now, use_cache: bool) -> float:
    """`measure_now()`, cached by device in the profile cache (`monet_opt.profile.ProfileCache`:
    measured again when it was measured on a busy CPU that is quiet now). Once measured or read
    in this process it is kept for the process, `use_cache=False` included: it is the runtime's
    cost on this device, not the model's (measuring it again took ~5 s per `build_problem`)."""
    from monet_opt.profile import ProfileCache, cpu_load, device_fingerprint

    device = torch.device(device)
    memo = (device_fingerprint(device), key)
    if memo in _measured:
        return _measured[memo]  # (without reading the profile cache's file again)
    cache = ProfileCache(device, enabled=use_cache)
    load = cpu_load() if device.type == "cpu" else None
    entry = cache.get(key, load)
    if entry is None:
        entry = {"seconds": measure_now()}
        cache = ProfileCache(device, enabled=use_cache)  # (a probe's own profile may have written to it)
        cache.put(key, entry, load)
        cache.save()
    seconds = float(entry["seconds"])
    _measured[memo] = seconds
    return seconds


def recompute_overhead(device: torch.device | str, use_cache: bool = True) -> float:
    """`measure(device)`, cached by device with the operator profile."""
    device = torch.device(device)
    return _cached(device, CACHE_KEY, lambda: measure(device, use_cache=use_cache), use_cache)


def backward_call_overhead(device: torch.device | str, use_cache: bool = True) -> float:
    """`backward_call(device)`, cached by device with the operator profile."""
    device = torch.device(device)
    return _cached(device, ENGINE_CALL_KEY, lambda: backward_call(device), use_cache)
