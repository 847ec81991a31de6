"""Leaf modules that change their own buffers as they train (spectral norm's power iteration, a
batch norm inside a submodule kept whole for its hooks) are recomputed from the buffers they
started from (`monet_opt.module_state`): the same gradients and the same buffers after a step as
plain training, and profiling leaves the buffers as they were."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import solver
from monet_opt import module_state
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from tests.test_runtime import assert_grads_match, grads_after_step


class SpectralNormed(nn.Module):
    """A GAN discriminator's layers."""

    def __init__(self, old_style: bool) -> None:
        super().__init__()
        norm = nn.utils.spectral_norm if old_style else nn.utils.parametrizations.spectral_norm
        self.layers = nn.ModuleList(norm(nn.Linear(64, 64)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.leaky_relu(layer(x), 0.2) + x
        return x


class HookedBlocks(nn.Module):
    """A feature-collecting hook keeps its block (Linear, BatchNorm, ReLU) whole: one leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU()) for _ in range(3)
        )
        self.shapes: list[torch.Size] = []
        self.blocks[1].register_forward_hook(lambda m, i, o: self.shapes.append(o.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + x
        return x


class _Centered(nn.Module):
    """Subtracts a running mean it assigns (not updates in place), and keeps what it computed
    for the training loop (an auxiliary loss's features)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.register_buffer("running", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.training:
            self.running = 0.9 * self.running + 0.1 * y.detach().mean(0)
        self.features = y
        return y - self.running


class AssignsInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.centered, self.out = nn.Linear(64, 64), _Centered(), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.centered(F.relu(self.inp(x))))) + x


def _recomputed(schedule) -> set[str]:
    return {s.node for st in schedule.stages[1:] for s in st.steps if s.op == "compute"}


def _states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "make, stateful",
    [
        (lambda: SpectralNormed(old_style=False), "layers_0"),
        (lambda: SpectralNormed(old_style=True), "layers_0"),
        (HookedBlocks, "blocks_1"),
        (AssignsInForward, "centered"),
    ],
    ids=["spectral_norm", "spectral_norm_old_style", "hooked_block_with_batchnorm", "assigns_in_forward"],
)
def test_a_leaf_changing_its_buffers_is_recomputed_from_its_starting_state(
    make, stateful, monkeypatch, tmp_path
):
    """Recomputed from the state its first run left, a spectral-normed Linear ran another power
    iteration: its bias gradient 1.3e-4 off plain's (largest 2.3e-3), silently, and its vectors
    moved on twice per step; a batch norm inside a hooked block updated its statistics twice. A
    module assigning its buffer in its forward (`self.running = ...`) left an fx Proxy in it when
    traced (the model then failed inside monet-opt with fx's "symbolically traced variables
    cannot be used as inputs to control flow"): it is now one node, which runs eagerly."""
    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, x = make(), torch.randn(256, 64)
    before = _states(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        problem = build_problem(model, (x,), progress=False, repeats=1)
    if isinstance(model, AssignsInForward):
        assert any(
            "'centered' (_Centered) assigns features, running in its forward" in str(w.message)
            for w in caught
        )
        assert not isinstance(getattr(model.centered, "features", None), torch.fx.Proxy)
        assert type(model.centered.running) is torch.Tensor
    for k, v in model.state_dict().items():  # profiling ran the model many times
        assert torch.equal(v, before[k]), f"profiling changed {k}"
    assert problem.meta["fixed_bytes_detail"]["buffer_states"] > 0
    # every node recomputed but the segments' inputs (the lowest-budget plan need not recompute
    # the stateful leaf: session 59's smaller batch-norm workspaces made HookedBlocks' not)
    schedule = solver.baselines.checkpoint_all(problem)
    assert stateful in _recomputed(schedule)
    wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
    traced = wrapped.executor
    assert wrapped.executor.plans[stateful].state  # (the trace found the buffers it changes)
    # (copied before any step: old-style spectral norm's weight is then a computed tensor, which
    # deepcopy refuses)
    plain = copy.deepcopy(model)
    for step in range(2):
        expected = grads_after_step(plain, plain, x)
        assert_grads_match(grads_after_step(wrapped, model, x), expected, f"step {step}")
        after, plain_after = model.state_dict(), plain.state_dict()
        for k in plain_after:
            assert torch.equal(after[k], plain_after[k]), (
                f"step {step}: buffer {k} differs from plain training"
            )
    assert wrapped.executor is traced  # (a leaf's buffers assigned every step: not traced again)
    if isinstance(model, AssignsInForward):
        torch.testing.assert_close(model.centered.features, plain.centered.features)


def test_buffer_values_leave_a_batch_norm_node_to_its_implementations():
    """ops.norm keeps a batch norm node's statistics on recomputation itself."""
    assert module_state.buffer_values(nn.BatchNorm2d(4)) == {}
    assert set(module_state.buffer_values(nn.Sequential(nn.BatchNorm2d(4)))) == {
        "0.running_mean",
        "0.running_var",
        "0.num_batches_tracked",
    }
