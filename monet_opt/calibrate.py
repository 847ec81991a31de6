"""Calibrate profiled times against a real training step.

Each node is profiled alone (`monet_opt.profile`): the same input again and again, its
memory warm in cache and its output landing in memory the allocator just freed. Inside a
real step the input is cold and the output is fresh memory, so memory-bound operators
(ReLU, BatchNorm, add) take several times longer there, and a solver that trusts the
isolated times recomputes them too eagerly.

`calibrate_in_situ` runs a few training steps of the model through the runtime with the
no-recompute schedule, once per implementation name (every node that has that
implementation runs it; the names' steps interleaved, so drift hits them alike), times
every node's forward and backward where it really runs, and replaces each implementation's isolated times by its in-step times. Per
implementation, because the isolated error is not uniform: on ResNet-50 b8 224 (CPU) the
53 BatchNorm backwards take 0.220 s isolated but 0.057 s in a step with torch's kernel,
while the in-place-gradient kernel takes 0.108 s isolated and 0.115 s in a step; scaled
alike, the solver believed in-place BatchNorm saved 0.11 s per step where it costs 0.06 s.
Nodes an implementation's steps did not time keep their isolated times scaled by the
node's default ratio. Model parameters, buffers (BatchNorm running statistics),
gradients and the RNG state are restored afterwards.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from monet_opt.malloc import freed_memory_kept
from monet_opt.node_timer import FORWARD, RECOMPUTE, RESTORE, NodeTimer
from monet_opt.restore import consumer_of
from monet_opt.step_in_backward import FINGERPRINT_SUFFIX
from monet_opt.train_modes import restore_training_modes, training_for_profile, training_modes
from solver.problem import Problem

MIN_SCALE, MAX_SCALE = 0.25, 50.0


class _StepTimer:
    """Times every node's forward and backward inside training steps of the no-recompute
    schedule; `impl`: every node that has an implementation of that name runs it."""

    def __init__(self, model: nn.Module, example_inputs: tuple, problem: Problem, impl: str | None) -> None:
        from monet_opt.runtime import MonetWrapper
        from solver.baselines import no_recompute

        pick = None
        if impl is not None:
            pick = {n.name: impl for n in problem.nodes if any(im.name == impl for im in n.impls)}
        self.model = model
        training_for_profile(model)
        self.modes = training_modes(model)  # what each step runs in (the caller restores the user's)
        self.inputs = example_inputs
        schedule = no_recompute(problem, impls=pick)
        # timed without an optimizer step in the backward (it would change the model's weights)
        plain_fingerprint = schedule.fingerprint.removesuffix(FINGERPRINT_SUFFIX)
        schedule = dataclasses.replace(schedule, fingerprint=plain_fingerprint)
        self.wrapped = MonetWrapper(model, schedule, example_inputs=example_inputs)
        ex = self.wrapped.executor
        ex.separate_graphs()  # a group's one backward call would time all its nodes as its first
        self.timer = NodeTimer(ex, example_inputs)
        self.step_s: list[float] = []  # whole recorded steps (node timers on)

    def step(self, record: bool) -> None:
        from monet_opt.bench import timed_step

        self.timer.recording = record
        restore_training_modes(self.model, self.modes)
        seconds = timed_step(self.wrapped, self.inputs)  # (gradients zeroed first, CUDA synchronised)
        if record:
            self.step_s.append(seconds)

    def medians(self) -> tuple[dict, dict]:
        return self.timer.medians(FORWARD), self.timer.backward_medians()


def in_situ_times(
    model: nn.Module,
    example_inputs: tuple,
    problem: Problem,
    steps: int,
    impls: list[str | None],
    step_times: dict | None = None,
) -> dict:
    """Per implementation name (None: every node's default), ({node: median forward s},
    {node: median backward s}) inside real training steps of the no-recompute schedule in which
    every node that has that implementation runs it. The names' steps are interleaved (round k
    runs one step of each), so that a machine's drift during calibration (measured: the default
    pass's forwards 28 % over their isolated times, where a quiet run matches them) scales all
    implementations alike instead of favouring some.

    step_times: if given, gets the median whole-step seconds of each name's steps under "by
    implementation", and under "plain" the median of plain PyTorch's steps (the model itself,
    unwrapped), one in each round beside them."""
    from monet_opt.bench import timed_step

    saved = _save_model_state(model)  # before tracing: it may draw random numbers too
    plain: list[float] = []
    try:
        timers = {name: _StepTimer(model, example_inputs, problem, name) for name in impls}
        modes = next(iter(timers.values())).modes if timers else None

        def plain_step() -> None:
            # timed after an untimed step of its own: a step right after another model's pays
            # for the allocator state that one left (`monet_opt.bench.interleaved_samples`)
            for record in (False, True):
                restore_training_modes(model, modes)
                seconds = timed_step(model, example_inputs)
                if record:
                    plain.append(seconds)

        for timer in timers.values():
            timer.step(record=False)  # warm-up
        for _ in range(steps):
            for timer in timers.values():
                timer.step(record=True)
            if step_times is not None:
                plain_step()
    finally:
        _restore_model_state(model, saved)
    if step_times is not None:
        step_times["by implementation"] = {name: statistics.median(t.step_s) for name, t in timers.items()}
        step_times["plain"] = statistics.median(plain)
    return {name: timer.medians() for name, timer in timers.items()}


def calibrate_in_situ(model: nn.Module, example_inputs: tuple, problem: Problem, steps: int = 2) -> Problem:
    """`problem` with every implementation's times replaced by what it takes in a real step."""
    default = "default"  # every node's first implementation (monet_opt.ops)
    names = [default]
    for node in problem.nodes:
        for im in node.impls:
            if im.name not in names:
                names.append(im.name)
    keys = [None if name == default else name for name in names]
    step_times: dict = {}
    times = in_situ_times(model, example_inputs, problem, steps, keys, step_times)
    measured = {name: times[key] for name, key in zip(names, keys)}
    fwd0, bwd0 = measured[default]
    nodes = []
    summary = {"fwd_isolated_s": 0.0, "fwd_in_step_s": 0.0, "bwd_isolated_s": 0.0, "bwd_in_step_s": 0.0}
    for node in problem.nodes:
        base = node.impls[0]
        sf = _scale(fwd0.get(node.name), base.fwd_time)
        sb = _scale(bwd0.get(node.name), base.bwd_time)
        if node.name in fwd0:
            summary["fwd_isolated_s"] += base.fwd_time
            summary["fwd_in_step_s"] += fwd0[node.name]
        if node.name in bwd0 and node.requires_backward:
            summary["bwd_isolated_s"] += base.bwd_time
            summary["bwd_in_step_s"] += bwd0[node.name]
        impls = []
        for k, im in enumerate(node.impls):
            fwd, bwd = measured.get(im.name, ({}, {})) if k else (fwd0, bwd0)
            ft = fwd[node.name] if node.name in fwd and im.fwd_time > 0 else im.fwd_time * sf
            bt = im.bwd_time * sb
            if node.requires_backward and node.name in bwd and im.bwd_time > 0:
                bt = bwd[node.name]
            rt = im.recompute_time
            if rt is not None:  # scaled as this implementation's forward was
                rt *= ft / im.fwd_time if im.fwd_time > 0 else sf
            impls.append(dataclasses.replace(im, fwd_time=ft, bwd_time=bt, recompute_time=rt))
        nodes.append(dataclasses.replace(node, impls=tuple(impls)))  # (restores: timed in isolation)
    meta = dict(problem.meta)
    meta["in_situ_calibration"] = {k: round(v, 6) for k, v in summary.items()} | {
        "steps": steps,
        "implementations": names,
        "freed_memory_kept": freed_memory_kept(),
        # whole steps, medians: plain PyTorch's, and the no-recompute schedule's with default
        # implementations as timed here (one graph per node, node timers on); `step_estimate`
        "plain_step_s": round(step_times["plain"], 6),
        "no_recompute_step_s": round(step_times["by implementation"][None], 6),
    }
    return dataclasses.replace(problem, nodes=nodes, meta=meta)


def calibrate_on_schedule(
    model: nn.Module, example_inputs: tuple, problem: Problem, schedule, steps: int = 3, optimizer: Any = None
) -> Problem:
    """`problem` with its times corrected by what `schedule` takes where it runs.

    `calibrate_in_situ` times every node in no-recompute steps: the whole forward's values
    live, the allocator handing out fresh memory, recomputation never timed (it is assumed to
    cost what the forward did). A low-budget schedule runs its nodes in another context: on
    ResNet-50 b8 224 (CPU, session 19) its recomputations took 12-15 % more than predicted and
    its backward 15-27 % more, while the no-recompute schedule's parts were off by other amounts.
    This runs `steps` training steps of `schedule` itself (on a copy of the model: with an
    optimizer step in the backward the weights change), times every node where it runs
    (`monet_opt.node_timer`, one autograd graph per node) and corrects, per node:

    * forward: the implementation the schedule ran takes its measured time; the node's other
      implementations are scaled by the same ratio (clamped to [0.25, 50]);
    * backward: likewise, by the same difference rather than ratio (an optimizer step in the
      backward, timed here, costs the same after every implementation);
    * recomputation: a recomputed node's implementation takes its measured recompute time, its
      others are scaled by that ratio; a node the schedule does not recompute is scaled by the
      median ratio of the recomputed nodes of its operator (of all recomputed nodes if none).

    Re-solving the corrected problem, started from `schedule` (`monet_opt.pipeline.solve_model(...,
    refine=)`), lets the solver weigh its choices at the costs they had in a schedule like the ones it
    makes. The RNG state is restored afterwards; the model itself is not run.
    """
    import copy

    from monet_opt.bench import training_step, zero_grad
    from monet_opt.runtime import MonetWrapper

    if optimizer is None:
        optimizer = problem.meta.get("step_in_backward", {}).get("optimizer")
    saved = _save_model_state(model)
    try:
        runner = copy.deepcopy(model)
        training_for_profile(runner)
        wrapped = MonetWrapper(runner, schedule, example_inputs=example_inputs, optimizer=optimizer)
        wrapped.executor.separate_graphs()  # each backward step times its own node
        timer = NodeTimer(wrapped.executor, example_inputs)
        for k in range(steps + 1):  # the first step warms up
            timer.recording = k > 0
            zero_grad(runner)
            training_step(wrapped, example_inputs)
        timer.close()
        del wrapped, runner
    finally:
        _restore_model_state(model, saved)
    fwd, rec, bwd = timer.medians(FORWARD), timer.medians(RECOMPUTE), timer.backward_medians()
    restored = timer.medians(RESTORE)
    first = {s.node: s.impl for s in schedule.stages[0].steps if s.op == "compute"}
    again_steps = [s for st in schedule.stages[1:] for s in st.steps if s.op == "compute"]
    again = {s.node: s.impl for s in again_steps if not consumer_of(s.impl)}
    restore_used = {s.node: s.impl for s in again_steps if consumer_of(s.impl)}
    ran = {**first, **again}  # the implementation of each node's last compute
    by_name = {n.name: n for n in problem.nodes}

    def impl_of(node, name):
        return next(im for im in node.impls if im.name == name)

    def recompute_cost(im) -> float:
        return im.fwd_time if im.recompute_time is None else im.recompute_time

    rec_ratio: dict[str, float] = {}
    for name, t in rec.items():
        base = recompute_cost(impl_of(by_name[name], again[name]))
        if base > 0:
            rec_ratio[name] = _scale(t, base)
    by_op: dict[str, list[float]] = defaultdict(list)
    for name, r in rec_ratio.items():
        by_op[by_name[name].op].append(r)
    everywhere = statistics.median(rec_ratio.values()) if rec_ratio else 1.0
    nodes = []
    for node in problem.nodes:
        name = node.name
        used = ran.get(name)
        sf = _scale(fwd.get(name), impl_of(node, first[name]).fwd_time) if name in first else 1.0
        db = 0.0
        if used is not None and name in bwd and node.requires_backward:
            db = bwd[name] - impl_of(node, used).bwd_time
        sr = rec_ratio.get(name) or (statistics.median(by_op[node.op]) if by_op.get(node.op) else everywhere)
        impls = []
        for im in node.impls:
            ft = im.fwd_time * sf
            bt = max(0.0, im.bwd_time + db) if node.requires_backward else im.bwd_time
            rt = recompute_cost(im) * sr
            if name in rec and im.name == again.get(name):
                rt = rec[name]
            if name in fwd and im.name == first.get(name):
                ft = fwd[name]
            impls.append(dataclasses.replace(im, fwd_time=ft, bwd_time=bt, recompute_time=rt))
        restores = tuple(
            dataclasses.replace(r, time=restored[name])
            if name in restored and r.name == restore_used.get(name)
            else r
            for r in node.restores
        )
        nodes.append(dataclasses.replace(node, impls=tuple(impls), restores=restores))
    meta = dict(problem.meta)
    rounds = list(meta.get("schedule_calibration", []))
    rounds.append(
        {
            "steps": steps,
            "budget_bytes": schedule.budget_bytes,
            "predicted_s": round(schedule.predicted_time_s, 6),
            "forward_s": round(sum(fwd.values()), 6),
            "recompute_s": round(timer.total(RECOMPUTE) / steps, 6),
            "backward_s": round(sum(bwd.values()), 6),
            "recompute_ratio_median": round(everywhere, 4),
            "freed_memory_kept": freed_memory_kept(),
        }
    )
    meta["schedule_calibration"] = rounds
    return dataclasses.replace(problem, nodes=nodes, meta=meta)


def step_estimate(problem: Problem, schedule) -> tuple[float, float] | None:
    """(a schedule's step seconds estimated for a real step, plain PyTorch's measured step
    seconds), from a problem calibrated in steps (`calibrate_in_situ`), else None.

    The simulator's time is the sum of the nodes' in-step times; a real step also runs the loss,
    the autograd engine and the runtime between nodes. The estimate adds what the calibration's
    no-recompute steps took beyond their nodes. Plain PyTorch's step is measured, not predicted:
    it runs its whole backward in one engine call where the runtime makes one per node (or group)
    of a recomputing schedule, so on ResNet-50 b8 224 (CPU, AMD EPYC) it was 1.5-2.5 % faster than
    the no-recompute prediction, and overheads against the prediction came out that much too low."""
    from solver.baselines import no_recompute
    from solver.simulate import simulate

    info = problem.meta.get("in_situ_calibration") or {}
    plain, base = info.get("plain_step_s"), info.get("no_recompute_step_s")
    if not plain or not base:
        return None
    rest = base - simulate(problem, no_recompute(problem)).time_s
    return simulate(problem, schedule).time_s + rest, plain


def _scale(in_step: float | None, isolated: float) -> float:
    if in_step is None or isolated <= 0.0:
        return 1.0
    return min(MAX_SCALE, max(MIN_SCALE, in_step / isolated))


def _save_model_state(model: nn.Module) -> dict[str, Any]:
    return {
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "grads": {
            k: (None if p.grad is None else p.grad.detach().clone()) for k, p in model.named_parameters()
        },
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all()
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else None,
        "training": training_modes(model),
    }


def _restore_model_state(model: nn.Module, saved: dict[str, Any]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(saved["buffers"][k])
    for k, p in model.named_parameters():
        p.grad = saved["grads"][k]
    torch.set_rng_state(saved["rng"])
    if saved["cuda_rng"] is not None:
        torch.cuda.set_rng_state_all(saved["cuda_rng"])
    restore_training_modes(model, saved["training"])
