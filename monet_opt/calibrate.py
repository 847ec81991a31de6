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
from typing import Any

import torch
from torch import nn

from monet_opt.node_timer import BACKWARD, FORWARD, NodeTimer
from monet_opt.step_in_backward import FINGERPRINT_SUFFIX
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
        self.inputs = example_inputs
        schedule = no_recompute(problem, impls=pick)
        # timed without an optimizer step in the backward (it would change the model's weights)
        plain_fingerprint = schedule.fingerprint.removesuffix(FINGERPRINT_SUFFIX)
        schedule = dataclasses.replace(schedule, fingerprint=plain_fingerprint)
        self.wrapped = MonetWrapper(model, schedule, example_inputs=example_inputs)
        ex = self.wrapped.executor
        ex.separate_graphs()  # a group's one backward call would time all its nodes as its first
        cuda = any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs)
        self.timer = NodeTimer(ex, cuda)

    def step(self, record: bool) -> None:
        from monet_opt.bench import training_step

        self.timer.recording = record
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        training_step(self.wrapped, self.inputs)

    def medians(self) -> tuple[dict, dict]:
        return self.timer.medians(FORWARD), self.timer.medians(BACKWARD)


def in_situ_times(
    model: nn.Module, example_inputs: tuple, problem: Problem, steps: int, impls: list[str | None]
) -> dict:
    """Per implementation name (None: every node's default), ({node: median forward s},
    {node: median backward s}) inside real training steps of the no-recompute schedule in which
    every node that has that implementation runs it. The names' steps are interleaved (round k
    runs one step of each), so that a machine's drift during calibration (measured: the default
    pass's forwards 28 % over their isolated times, where a quiet run matches them) scales all
    implementations alike instead of favouring some."""
    saved = _save_model_state(model)  # before tracing: it may draw random numbers too
    try:
        timers = {name: _StepTimer(model, example_inputs, problem, name) for name in impls}
        for timer in timers.values():
            timer.step(record=False)  # warm-up
        for _ in range(steps):
            for timer in timers.values():
                timer.step(record=True)
    finally:
        _restore_model_state(model, saved)
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
    times = in_situ_times(model, example_inputs, problem, steps, keys)
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
        nodes.append(dataclasses.replace(node, impls=tuple(impls)))
    meta = dict(problem.meta)
    meta["in_situ_calibration"] = {k: round(v, 6) for k, v in summary.items()} | {
        "steps": steps,
        "implementations": names,
    }
    return dataclasses.replace(problem, nodes=nodes, meta=meta)


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
        "training": model.training,
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
    model.train(saved["training"])
