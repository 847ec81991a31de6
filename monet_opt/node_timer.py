"""Time every node's forward, recomputation and backward where it runs: inside real training
steps of a `MonetWrapper`.

Used by the calibration (`monet_opt.calibrate`: in-step times replace isolated ones) and by the
step breakdown (`monet_opt.bench.measure_parts`: where a step's time goes, beside the
simulator's prediction of the same parts).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

import torch

FORWARD, RECOMPUTE, BACKWARD, RESTORE = "forward", "recompute", "backward", "restore"
DEFERRED = "deferred weight gradient"  # made after the last stage (`runtime/deferred.py`)


def on_cuda(inputs) -> bool:
    """Whether a step on these inputs runs on a CUDA device (timers then synchronise)."""
    return any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)


class NodeTimer:
    """Wraps an executor's `compute` and `backward` with wall-clock timers (synchronised around
    each call when `inputs`, the step's inputs, are on CUDA). While `recording`, `times[(kind, node)]` collects seconds per call; kind
    is FORWARD (a compute in the forward stage), RECOMPUTE (a compute in a backward stage),
    RESTORE (a restore, `monet_opt.restore`: under its node, at most one restore per node),
    BACKWARD, or DEFERRED (a node's weight gradient made after the last stage: the rest of its
    backward, `runtime/deferred.py`). A group of nodes sharing one autograd graph (`runtime/groups.py`) computes in one
    generated function and runs its backward at its first member: both times are that member's
    (`executor.separate_graphs()` gives each node its own). A schedule that would run in the
    caller's graph (`executor.attachable`, whose backward is the engine's alone) runs through the
    wrapper's own backward while timed (the timer is one of `executor.observers`). `close()`
    puts the executor's own methods back."""

    def __init__(self, executor, inputs: tuple) -> None:
        self.executor = executor
        executor.observers.add(self)
        self.times: dict[tuple[str, str], list[float]] = defaultdict(list)
        self.recording = False
        compute, backward = executor.compute, executor.backward
        weight_gradients = executor.weight_gradients
        run_stage, run_segment = executor._run_stage, executor._run_segment
        in_backward_stage = [False]
        restores = executor.restore_impls

        cuda = on_cuda(inputs)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def timed_compute(run, name, impl, grad, recompute, *rest):
            sync()
            t0 = time.perf_counter()
            compute(run, name, impl, grad, recompute, *rest)
            sync()
            if self.recording:
                kind = RESTORE if impl in restores else RECOMPUTE if recompute else FORWARD
                self.times[(kind, name)].append(time.perf_counter() - t0)

        def timed_backward(run, name):
            sync()
            t0 = time.perf_counter()
            backward(run, name)
            sync()
            if self.recording:
                self.times[(BACKWARD, name)].append(time.perf_counter() - t0)

        def timed_weight_gradients(run):
            name = run.deferred[0].node
            sync()
            t0 = time.perf_counter()
            made = weight_gradients(run)
            sync()
            if self.recording:
                self.times[(DEFERRED, name)].append(time.perf_counter() - t0)
            return made

        def tracked_stage(run, si, recompute):
            in_backward_stage[0] = recompute
            run_stage(run, si, recompute)

        def timed_segment(run, segment, group):
            sync()
            t0 = time.perf_counter()
            run_segment(run, segment, group)
            sync()
            if self.recording:
                kind = RECOMPUTE if in_backward_stage[0] else FORWARD
                self.times[(kind, group.members[0])].append(time.perf_counter() - t0)

        executor.compute, executor.backward = timed_compute, timed_backward
        executor.weight_gradients = timed_weight_gradients
        executor._run_stage, executor._run_segment = tracked_stage, timed_segment

    def medians(self, kind: str) -> dict[str, float]:
        """{node: median seconds of one call} over the recorded calls of that kind."""
        return {name: statistics.median(v) for (k, name), v in self.times.items() if k == kind}

    def backward_medians(self) -> dict[str, float]:
        """{node: median seconds of its backward}, a deferred weight gradient's (made after the
        last stage) added to its node's, as the simulator counts it (its `bwd_time`: calibrated
        without it, a deferred problem's prediction left those seconds out)."""
        out = self.medians(BACKWARD)
        for name, t in self.medians(DEFERRED).items():
            out[name] = out.get(name, 0.0) + t
        return out

    def total(self, kind: str) -> float:
        """Seconds of every recorded call of that kind, summed."""
        return sum(sum(v) for (k, _), v in self.times.items() if k == kind)

    def close(self) -> None:
        for attr in ("compute", "backward", "weight_gradients", "_run_stage", "_run_segment"):
            self.executor.__dict__.pop(attr, None)
        self.executor.observers.discard(self)
