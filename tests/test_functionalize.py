"""In-place changes read through the pre-change value (timm's drop_path, `x[i] = v`, a method
called for its effect) run out of place with the model's values: gradients equal plain
PyTorch's, with stochastic depth's masks replayed on recomputation. What cannot be followed
(a change through another view, a parameter or buffer changed in place) is refused by name."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
from torch import nn

from monet_opt.functionalize import functionalize, setitem_out_of_place
from monet_opt.graph import TraceError, trace
from monet_opt.pipeline import solve_model
from monet_opt.profile import build_problem
from monet_opt.runtime import MonetWrapper
from solver import baselines
from tests.test_runtime import assert_same_gradients, budget_at


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """timm.layers.drop_path, as timm writes it: the mask is scaled by a statement."""
    if p == 0.0 or not training:
        return x
    keep = 1 - p
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    random_tensor = x.new_empty(shape).bernoulli_(keep)
    random_tensor.div_(keep)
    return x * random_tensor


class StochasticDepthNet(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = x + drop_path(block(x), 0.5, self.training)
        y = self.head(x)
        y[:, 0] = y[:, 1] * 2  # setitem: later reads of y see it
        y.mul_(0.5)  # a method called for its effect
        return y


def test_a_change_made_by_a_statement_is_read_by_later_nodes():
    torch.manual_seed(0)
    model = StochasticDepthNet().train()
    x = torch.randn(16, 32)
    g = trace(model, (x,))
    by_name = {n.name: n for n in g.gm.graph.nodes}
    # each block's product reads the scaled mask (div_), not the unscaled one (bernoulli_)
    products = [n for n in g.gm.graph.nodes if n.op == "call_function" and n.target is operator.mul]
    reads = [{a.name.rstrip("_0123456789") for a in n.args if isinstance(a, fx.Node)} for n in products]
    assert sum("div" in r for r in reads) == 4 and not any("bernoulli" in r for r in reads), reads
    # x[:, 0] = ... is an out-of-place update, and the method called for its effect reads it
    assert by_name["setitem"].target is setitem_out_of_place
    assert by_name["mul_"].args[0] is by_name["setitem"]
    out = next(n for n in g.gm.graph.nodes if n.op == "output")
    assert out.args[0] is by_name["mul_"]


@pytest.mark.parametrize("separate", [False, True], ids=["shared graphs", "one graph per node"])
@pytest.mark.parametrize("how", ["no_recompute", "checkpoint_all", "solved"])
def test_stochastic_depth_gives_plain_gradients(how, separate):
    torch.manual_seed(0)
    model = StochasticDepthNet().train()
    x = torch.randn(16, 32)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    # the mask reads the block's output for its shape only: no gradient reaches it (a backward
    # stage for it fed, with one graph per node, a gradient to the shape-only `new_empty`)
    no_grad = {n.name.rstrip("_0123456789") for n in problem.nodes if not n.requires_backward}
    assert {"new_empty", "bernoulli", "div"} <= no_grad, sorted(no_grad)
    if how == "solved":
        _, schedule = solve_model(
            model, (x,), budget_at(problem, 0.0), time_limit=10, verbose=False, problem=problem
        )
    else:
        schedule = getattr(baselines, how)(problem)
    recomputed = {s.node for st in schedule.stages[1:] for s in st.steps if s.op == "compute"}
    if how == "checkpoint_all":
        # the masks are drawn again in the backward: the runtime replays the forward's RNG
        assert {"bernoulli_", "div_", "setitem"} <= recomputed, sorted(recomputed)
    wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
    if separate:  # as `measure_stage_peaks` and calibration run it
        wrapped.executor.separate_graphs()
    torch.manual_seed(3)
    expected = model(x)
    torch.manual_seed(3)
    torch.testing.assert_close(wrapped(x), expected, rtol=0, atol=0)
    assert_same_gradients(model, wrapped, x, f"stochastic depth, {how}")


class ChangesAView(nn.Module):
    def forward(self, x):
        y = x * 2
        head = y[:, :4]
        head.mul_(3)  # changes y through a view
        return y.sum(dim=1) + head.sum(dim=1)


class ChangesAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, x):
        self.seen.add_(1)  # lost if run out of place
        return x * 2


def test_a_change_through_another_view_is_refused_by_name():
    with pytest.raises(
        TraceError, match="'sum_1' reads 'mul' after node 'mul_'.*through another view"
    ) as info:
        trace(ChangesAView(), (torch.randn(4, 8),))
    assert info.value.node is not None


def test_a_parameter_changed_in_place_is_refused_by_name():
    # (fx records no buffer reads by default: a buffer changed in place changes once, at trace time)
    with pytest.raises(TraceError, match="'add_'.*parameter or buffer in place"):
        trace(ChangesAParameter(), (torch.randn(4, 8),))


def test_functionalize_leaves_operator_and_alone():
    # operator.and_ ends in "_" but changes nothing
    class M(nn.Module):
        def forward(self, x):
            m = (x > 0) & (x < 1)
            return x * m, x + 1

    gm = fx.symbolic_trace(M())
    assert functionalize(gm) == []
