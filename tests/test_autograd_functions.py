"""A model's custom torch.autograd.Functions run as written: one node each, with the backward the
model wrote (`monet_opt.autograd_functions`); torch.utils.checkpoint's reentrant form is traced as
the function it wraps. Before, fx traced a Function's forward inline and autograd differentiated
it: a straight-through estimator's gradients were wrong, silently."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

import solver
from monet_opt.autograd_functions import function_node
from monet_opt.graph import trace
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from tests.test_runtime import assert_same_gradients, budget_at


class RoundStraightThrough(torch.autograd.Function):
    """Quantisation-aware training's rounding: its backward passes the gradient as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


class Quantised(nn.Module):
    def __init__(self, concrete: bool) -> None:
        super().__init__()
        self.concrete = concrete
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = layer(x)
            if self.concrete and y.shape[0] > 2:  # (shape-dependent Python: the concrete trace)
                y = y * 1.0
            x = torch.tanh(RoundStraightThrough.apply(y)) + x
        return x


class ReentrantCheckpoints(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(64, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = cp.checkpoint(block, x, use_reentrant=True) + x
        return x


@pytest.mark.parametrize("concrete", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.2])
def test_a_straight_through_estimator_keeps_its_backward(concrete, fraction, monkeypatch, tmp_path):
    """Traced inline, the rounding's derivative (zero) replaced the identity backward: the
    first layer's weight gradient was 0.07 off plain's (norm 0.29) on a one-layer model."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = Quantised(concrete), torch.randn(256, 64)
    nodes = [n for n in trace(model, (x,)).gm.graph.nodes if n.target is function_node(RoundStraightThrough)]
    assert len(nodes) == 4
    problem = build_problem(model, (x,), progress=False, repeats=1)
    schedule = solver.solve(problem, budget_at(problem, fraction), time_limit=4, verbose=False)
    assert_same_gradients(model, MonetWrapper(model, schedule, example_inputs=(x,)), x, "straight-through")


def test_a_reentrant_checkpoint_is_traced_as_the_function_it_wraps(monkeypatch, tmp_path):
    """Its forward runs the function under no_grad: traced inline, those nodes were the model's
    no_grad code and sent no gradient to the blocks."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = ReentrantCheckpoints(), torch.randn(256, 64)
    with pytest.warns(UserWarning):  # (torch's: its inputs need no gradient in the eager check)
        problem = build_problem(model, (x,), progress=False, repeats=1)
    assert sum(n.requires_backward for n in problem.nodes) == len(problem.nodes)
    schedule = solver.solve(problem, budget_at(problem, 0.3), time_limit=4, verbose=False)
    assert_same_gradients(
        model, MonetWrapper(model, schedule, example_inputs=(x,)), x, "reentrant checkpoint"
    )
