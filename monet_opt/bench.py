"""Measured peak memory and step time: wrapped model vs plain PyTorch, in one run."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from monet_opt import autocast_regions
from monet_opt.memory import measure_peak
from monet_opt.node_timer import on_cuda
from solver.schedule import Schedule

MiB = 2**20


_LOSS_WEIGHTS: dict[tuple, torch.Tensor] = {}


def loss_of(output: Any, positions: list[int] | None = None) -> torch.Tensor:
    """A loss for any model output: a fixed random weighting of every floating tensor, summed
    (of those at `positions` among the output's tensors, flattened, if given: a model that
    returns its loss is trained on it).

    The weights are made once per shape and kept, so they are not allocated inside
    a measured step; the loss's only step-time allocation is the output's gradient.
    """
    from torch.utils._pytree import tree_flatten

    total = None
    for k, t in enumerate(tree_flatten(output)[0]):
        if positions is not None and k not in positions:
            continue
        if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
            continue
        key = (tuple(t.shape), t.dtype, t.device)
        if key not in _LOSS_WEIGHTS:
            gen = torch.Generator().manual_seed(1234)
            _LOSS_WEIGHTS[key] = torch.randn(t.shape, generator=gen).to(t.device, t.dtype) / t.numel()
        term = (t * _LOSS_WEIGHTS[key]).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the model returned no floating-point tensor to build a loss from")
    return total


def zero_grad(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def training_step(model: nn.Module, inputs: tuple) -> None:
    """Forward, loss, backward; parameter gradients are expected to be None before it.

    The output is held through the backward, as in `out = model(x); loss_fn(out, y).backward()`
    (the memory model counts outputs as held by the user until the step ends), except for a
    model with `dropped_outputs` (a wrapper solved with outputs_held="loss"): the loss alone is."""
    out = model(*inputs)
    # (a wrapper or keyword root whose model returns its loss: that output alone)
    loss = loss_of(out, getattr(model, "grad_outputs", None))
    if getattr(model, "dropped_outputs", None):  # (solved for a loop that keeps only the loss)
        del out
    loss.backward()


def measure_step(model: nn.Module, inputs: tuple, steps: int = 3) -> tuple[int, float]:
    """(peak bytes above what was live before the step, median step seconds)."""
    peak = measure_step_peak(model, inputs)
    times = [timed_step(model, inputs) for _ in range(steps)]
    zero_grad(model)
    return peak, statistics.median(times)


def measure_step_peak(model: nn.Module, inputs: tuple) -> int:
    """Peak bytes of one training step, after a warm-up step."""
    zero_grad(model)
    training_step(model, inputs)  # warm-up
    zero_grad(model)
    peak = measure_peak(training_step, model, inputs).peak_bytes
    zero_grad(model)
    return peak


def measure_stage_peaks(
    wrapped: nn.Module, inputs: tuple, separate_graphs: bool = True
) -> list[tuple[str, int]]:
    """Peak bytes of each schedule stage in one training step of a `MonetWrapper` (CPU), after a
    warm-up step: (stage name, peak above what was live before the step), in schedule order.

    Set beside `solver.simulate(problem, schedule).stage_peaks` it shows where a measured peak
    and the memory model part. The first backward stage's figure includes the loss. Shared
    autograd graphs run a group's whole backward at its first member's stage, so by default the
    step runs with one graph per node (`separate_graphs=False`: as the wrapper runs by default).
    """
    from monet_opt.memory import mark, segment_peaks, track_peak

    executor = wrapped.executor
    stages = executor.schedule.stages
    groups = executor.groups
    if separate_graphs:
        executor.separate_graphs()
    executor.after_stage = lambda si: mark()
    executor.observers.add(measure_stage_peaks)
    try:
        zero_grad(wrapped)
        training_step(wrapped, inputs)  # warm-up
        zero_grad(wrapped)
        with track_peak("cpu") as session:
            training_step(wrapped, inputs)
    finally:
        executor.after_stage = None
        executor.observers.discard(measure_stage_peaks)
        executor.set_groups(groups)
    zero_grad(wrapped)
    segments = segment_peaks(session)  # one per stage, and what runs after the last one
    return [(stage.name, peak) for stage, (_, peak) in zip(stages, segments)]


def timed_step(model: nn.Module, inputs: tuple) -> float:
    """Seconds of one training step (gradients zeroed first, CUDA synchronised)."""
    zero_grad(model)
    cuda = on_cuda(inputs)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    training_step(model, inputs)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved_samples(a: nn.Module, b: nn.Module, inputs: tuple, steps: int) -> tuple[list, list]:
    """Step seconds of `a` and `b`, `steps` each, timed in alternating rounds so that load
    changes on a shared machine hit both alike: round i's two times are a pair.

    Each round runs one untimed step of a model before its timed step: a step is timed after a
    step of the same model, as in real training. Timing a step right after the other model's
    (a, b, a, b, ...) measured the allocator state the other model left: the wrapped
    mobilenet_v2 (b8 224, CPU) took +6 % that way and +0 % after its own step.

    Rounds alternate which model goes first (a, b, then b, a), so that what the first of a
    round pays for (a neighbour's burst, the state the previous round left) falls on both.
    """
    ta, tb = [], []
    for r in range(steps):
        pairs = ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta))
        for model, times in pairs:
            timed_step(model, inputs)  # warm-up: leave the allocator as this model leaves it
            times.append(timed_step(model, inputs))
    zero_grad(a)
    zero_grad(b)
    return ta, tb


def interleaved_times(a: nn.Module, b: nn.Module, inputs: tuple, steps: int) -> tuple[float, float]:
    """Median step seconds of `a` and `b` (`interleaved_samples`)."""
    return paired_times(a, b, inputs, steps)[:2]


def paired_times(a: nn.Module, b: nn.Module, inputs: tuple, steps: int) -> tuple[float, float, tuple]:
    """Median step seconds of `a` and `b` (`interleaved_samples`) and (q1, median, q3) of the
    rounds' paired ratios b / a (`paired_ratio`)."""
    ta, tb = interleaved_samples(a, b, inputs, steps)
    med, q1, q3 = paired_ratio(ta, tb)
    return statistics.median(ta), statistics.median(tb), (q1, med, q3)


def step_page_faults(model: nn.Module, inputs: tuple) -> int:
    """Minor page faults of one training step, after an untimed step of the same model."""
    from monet_opt.malloc import page_faults

    timed_step(model, inputs)
    before = page_faults()
    timed_step(model, inputs)
    faults = page_faults() - before
    zero_grad(model)
    return faults


def paired_ratio(ta: list, tb: list) -> tuple[float, float, float]:
    """Median and quartiles of tb[i] / ta[i] over the rounds of `interleaved_samples`. On a
    shared CPU the step time drifts by more than a runtime's overhead within a minute (GPT b8
    s256 on this VM: plain medians 71-92 ms across runs); the pairs cancel the drift that
    two separate medians keep."""
    ratios = sorted(y / x for x, y in zip(ta, tb))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return q[1], q[0], q[2]


@dataclass
class StepParts:
    """Seconds of one training step by part: the computes of the forward stage, the
    recomputations (computes in backward stages), the backward steps (with an optimizer step in
    the backward, its steps too; deferred weight gradients, made after the last stage, too), and
    the rest of the step (`other_s`: the loss, the autograd engine, the runtime's own work between
    nodes; zero in a prediction)."""

    forward_s: float
    recompute_s: float
    backward_s: float
    step_s: float

    @property
    def other_s(self) -> float:
        return self.step_s - self.forward_s - self.recompute_s - self.backward_s


def measure_parts(wrapped: nn.Module, inputs: tuple, steps: int = 3) -> StepParts:
    """Where a `MonetWrapper`'s step time goes: every node timed where it runs
    (`monet_opt.node_timer`), means per step over `steps` timed steps after an untimed one."""
    from monet_opt.node_timer import BACKWARD, DEFERRED, FORWARD, RECOMPUTE, RESTORE, NodeTimer

    timer = NodeTimer(wrapped.executor, inputs)
    try:
        timed_step(wrapped, inputs)
        timer.recording = True
        total = sum(timed_step(wrapped, inputs) for _ in range(steps))
    finally:
        timer.close()
        zero_grad(wrapped)
    return StepParts(
        timer.total(FORWARD) / steps,
        (timer.total(RECOMPUTE) + timer.total(RESTORE)) / steps,  # (restores: the simulator's too)
        (timer.total(BACKWARD) + timer.total(DEFERRED)) / steps,  # (the simulator's backward too)
        total / steps,
    )


def predicted_parts(problem, schedule: Schedule) -> StepParts:
    """The simulator's prediction of the same parts (`solver.simulate`)."""
    from solver.simulate import simulate

    r = simulate(problem, schedule)
    return StepParts(
        r.forward_time_s, r.recompute_time_s, r.time_s - r.forward_time_s - r.recompute_time_s, r.time_s
    )


@dataclass
class BenchResult:
    model: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    predicted_time_s: float
    plain_peak_bytes: int
    plain_step_s: float
    wrapped_peak_bytes: int
    wrapped_step_s: float
    ratio_quartiles: tuple[float, float, float]  # paired wrapped/plain: q1, median, q3
    plain_page_faults: int  # minor page faults of one step (after a step of the same model)
    wrapped_page_faults: int
    plain_name: str = "plain PyTorch"  # the baseline: with the optimizer step in its backward, if so solved

    def table(self) -> str:
        rows = [
            (self.plain_name, self.plain_peak_bytes, self.plain_step_s, "-"),
            (
                "monet-opt (measured)",
                self.wrapped_peak_bytes,
                self.wrapped_step_s,
                f"{self.wrapped_peak_bytes / self.plain_peak_bytes:.2f}x mem, "
                f"{self.ratio_quartiles[1] - 1:+.1%} time (paired; quartiles "
                f"{self.ratio_quartiles[0] - 1:+.1%} .. {self.ratio_quartiles[2] - 1:+.1%})",
            ),
            ("monet-opt (predicted)", self.predicted_peak_bytes, self.predicted_time_s, ""),
        ]
        out = [
            f"{self.model}; budget {self.budget_bytes / MiB:.1f} MiB" if self.budget_bytes else self.model,
            f"| {'run':<22} | {'peak MiB':>9} | {'step ms':>9} | vs {self.plain_name} |",
            "|---|---:|---:|---|",
        ]
        for name, peak, t, note in rows:
            out.append(f"| {name:<22} | {peak / MiB:9.1f} | {t * 1e3:9.1f} | {note} |")
        within = (
            "within" if self.budget_bytes is None or self.wrapped_peak_bytes <= self.budget_bytes else "OVER"
        )
        out.append(
            f"measured peak is {within} the budget; measured/predicted = "
            f"{self.wrapped_peak_bytes / max(1, self.predicted_peak_bytes):.3f}"
        )
        out.append(
            f"page faults per step: plain {self.plain_page_faults}, monet-opt {self.wrapped_page_faults} "
            "(CPU: fresh pages the kernel zeroes; see monet_opt.malloc)"
        )
        return "\n".join(out)


class AutocastForward(nn.Module):
    """`net` with its forward under an autocast spec (`monet_opt.autocast_regions`); the
    backward outside it, as a training loop runs it."""

    def __init__(self, net: nn.Module, spec: Any) -> None:
        super().__init__()
        self.net, self.spec = net, spec

    def forward(self, *inputs: Any) -> Any:
        with autocast_regions.under(self.spec):
            return self.net(*inputs)


def bench_schedule(schedule: Schedule, steps: int = 3, device: str | None = None) -> BenchResult:
    """Rebuild the schedule's model from its metadata and measure it against plain PyTorch."""
    spec = spec_of(schedule)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = spec.build().to(dev).train()
    inputs = spec.example_inputs(dev)
    return bench_model(model, inputs, schedule, steps, name=spec.describe())


def spec_of(schedule: Schedule):
    """The zoo model (and input size) a schedule's metadata records."""
    from monet_opt.zoo import ModelSpec

    meta = schedule.meta
    if "model" not in meta:
        raise ValueError("this schedule does not record its model (meta.model); bench it from Python instead")
    return ModelSpec(
        meta["model"],
        batch=int(meta["batch"]),
        image=int(meta.get("image", 224)),
        seq=int(meta.get("seq", 128)),
        channels_last=bool(meta.get("channels_last", False)),
    )


def bench_model(
    model: nn.Module, inputs: tuple, schedule: Schedule, steps: int = 3, name: str = ""
) -> BenchResult:
    """Measured peak and step time of `schedule` beside plain PyTorch's. A schedule solved with the
    optimizer step in the backward runs on a copy of the model with that optimizer, timed against
    a plain copy with the same step fused into its backward (both do the optimizer's work)."""
    from monet_opt.runtime import MonetWrapper
    from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory

    optimizer = schedule.meta.get("step_in_backward", {}).get("optimizer")
    plain = model
    if optimizer is not None:
        # the baseline for both peak and time: plain PyTorch with the same step in its backward
        # (the schedule's fractions are of that model's peak too)
        plain = copy.deepcopy(model)
        fuse_into_backward(plain, optimizer_factory(optimizer))
        model = copy.deepcopy(model)
    wrapped = MonetWrapper(model, schedule, example_inputs=inputs, optimizer=optimizer)
    if "autocast" in schedule.meta:  # (profiled under autocast: both forwards run under it)
        spec = autocast_regions.from_json(schedule.meta["autocast"])
        plain, wrapped = AutocastForward(plain, spec), AutocastForward(wrapped, spec)
    plain_peak = measure_step_peak(plain, inputs)
    peak = measure_step_peak(wrapped, inputs)
    plain_t, t, quartiles = paired_times(plain, wrapped, inputs, steps)
    return BenchResult(
        name,
        schedule.budget_bytes,
        schedule.predicted_peak_bytes,
        schedule.predicted_time_s,
        plain_peak,
        plain_t,
        peak,
        t,
        ratio_quartiles=quartiles,
        plain_page_faults=step_page_faults(plain, inputs),
        wrapped_page_faults=step_page_faults(wrapped, inputs),
        plain_name="plain PyTorch" if optimizer is None else f"plain PyTorch + {optimizer} step in backward",
    )
