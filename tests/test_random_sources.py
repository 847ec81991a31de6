"""Random draws from shapes alone (`torch.randn(x.shape)`, a distribution's rsample) are nodes
of the traced graph (`monet_opt.random_sources`): before, fx ran them once while tracing and kept
the noise as a constant, and trace's check refused the model (a VAE did not trace)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import solver
from monet_opt.graph import trace
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from tests.test_runtime import assert_same_gradients, budget_at


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
        self.mu, self.log_var = nn.Linear(64, 16), nn.Linear(64, 16)
        self.dec = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, log_var = self.mu(h), self.log_var(h)
        q = torch.distributions.Normal(mu, torch.exp(0.5 * log_var))  # (validate_args: default on)
        prior = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(mu))
        kl = torch.distributions.kl_divergence(q, prior).sum(-1)
        return self.dec(q.rsample()), kl


class NoisyMLP(nn.Module):
    """Gaussian noise injection with a shape the concrete trace answers with numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x))
        if y.shape[0] > 1:  # (shape-dependent Python: the concrete trace)
            y = y + 0.1 * torch.randn(y.shape[0], y.shape[1])
        return self.c(torch.tanh(self.b(y)))


@pytest.mark.parametrize("make, draw", [(VAE, "_standard_normal"), (NoisyMLP, "randn")])
def test_random_draws_are_nodes_replayed_on_recompute(make, draw, monkeypatch, tmp_path):
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = make(), torch.randn(256, 64)
    validate = torch.distributions.Distribution._validate_args
    graph = trace(model, (x,))
    assert torch.distributions.Distribution._validate_args == validate  # (put back)
    assert any(getattr(n.target, "__name__", "") == draw for n in graph.gm.graph.nodes)
    with torch.no_grad():  # fresh noise at every run, not a constant
        first, second = graph.gm(x), graph.gm(x)
    first, second = (first[0], second[0]) if isinstance(first, tuple) else (first, second)
    assert not torch.equal(first, second)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    schedule = solver.solve(problem, budget_at(problem, 0.0), time_limit=4, verbose=False)
    recomputed = {s.node for st in schedule.stages[1:] for s in st.steps if s.op == "compute"}
    assert recomputed
    assert_same_gradients(model, MonetWrapper(model, schedule, example_inputs=(x,)), x, make.__name__)
