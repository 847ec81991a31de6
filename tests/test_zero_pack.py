"""Zero packing (bit mask + nonzero elements) and the convolution that keeps its input packed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from monet_opt.ops import implementations_for, zero_pack
from monet_opt.ops.conv import ZERO_PACK_MIN_ZEROS


def _sparse(shape, density=0.5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    keep = torch.rand(shape, generator=g) < density
    return torch.where(keep, x, torch.zeros((), dtype=dtype))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(ints), b.reshape(-1).view(ints))
    )


def test_kernel_compiles_on_this_machine():
    # CI's machine is like this one (a C compiler on PATH): the fast path must be there
    assert zero_pack.kernel() is not None, zero_pack.kernel_error()


@pytest.mark.parametrize("numel", [1, 7, 8, 16, 33, 16 * 40 + 5, (1 << 17) + 3])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_round_trip_is_bitwise(numel, path):
    x = _sparse((numel,), 0.4, seed=numel)
    specials = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 0.0, 1e-45])
    x[: min(numel, len(specials))] = specials[: min(numel, len(specials))]
    p = zero_pack.pack(x) if path == "kernel" else zero_pack._pack_torch(x)
    nonzero = int((x.view(torch.int32) != 0).sum())  # -0.0 is kept (its bits are not all zero)
    assert p.values.numel() == nonzero
    assert p.nbytes == (numel + 7) // 8 + 4 * nonzero
    assert _bits_equal(zero_pack.unpack(p), x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_take_the_torch_path_and_round_trip(dtype):
    x = _sparse((3, 5, 7), 0.3, dtype)
    p = zero_pack.pack(x)
    assert p.offsets == () and p.values.dtype == dtype
    assert _bits_equal(zero_pack.unpack(p), x)


def test_kernel_and_torch_paths_pack_the_same_bits_and_values():
    torch.manual_seed(0)
    x = torch.relu(torch.randn(4, 16, 33, 31))
    a, b = zero_pack.pack(x), zero_pack._pack_torch(x)
    assert torch.equal(a.bits, b.bits) and torch.equal(a.values, b.values)
    assert a.nbytes < x.numel() * 4 * 0.6  # density ~0.5: mask 1/32 + half the values


def test_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("MONET_OPT_ZERO_PACK_KERNEL", "0")
    x = _sparse((1000,), 0.5)
    p = zero_pack.pack(x)
    assert p.offsets == ()  # the torch path
    assert _bits_equal(zero_pack.unpack(p), x)


def test_threads_split_and_rejoin(monkeypatch):
    x = _sparse((3, (1 << 16) + 11), 0.5)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        p = zero_pack.pack(x)
        assert len(p.offsets) == 3 and all(a % 16 == 0 for a, _, _ in p.offsets)
        assert _bits_equal(zero_pack.unpack(p), x)
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the convolution


def _impl(conv, x=None):
    found = {i.name: i for i in implementations_for("call_module", conv)}
    return found["zero_packed_input"]


@pytest.mark.parametrize(
    "cfg",
    [
        dict(in_channels=8, out_channels=6, kernel_size=3, padding=1),
        dict(in_channels=8, out_channels=4, kernel_size=1, stride=2, bias=False),
        dict(in_channels=8, out_channels=8, kernel_size=3, padding=1, groups=2),
    ],
)
def test_zero_packed_conv_gives_torch_values_and_gradients_bitwise(cfg):
    torch.manual_seed(0)
    conv = nn.Conv2d(**cfg)
    x0 = torch.relu(torch.randn(4, 8, 12, 10))
    g = torch.randn_like(conv(x0))
    ref_x = x0.clone().requires_grad_()
    ref = conv(ref_x)
    ref_grads = torch.autograd.grad(ref, [ref_x, *conv.parameters()], g)
    x = x0.clone().requires_grad_()
    y = _impl(conv).run(conv, (x,), {}, False)
    grads = torch.autograd.grad(y, [x, *conv.parameters()], g)
    assert torch.equal(y, ref)
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)


def test_zero_packed_conv_keeps_the_packed_input_not_the_input():
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 16, 3, padding=1, bias=False)
    x = torch.relu(torch.randn(2, 16, 20, 20)).requires_grad_()
    saved = []

    def pack_hook(t):
        if not any(t is p for p in conv.parameters()):
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        y = _impl(conv).run(conv, (x,), {}, False)
    assert all(t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() for t in saved)
    kept = sum(t.numel() * t.element_size() for t in saved)
    nonzero = int((x != 0).sum())
    assert kept == x.numel() // 8 + 4 * nonzero < 0.6 * x.numel() * 4
    y.sum().backward()
    assert x.grad is not None


def test_offered_only_where_the_example_input_has_zeros():
    conv = nn.Conv2d(4, 4, 3, padding=1)
    impl = _impl(conv)
    dense = torch.randn(2, 4, 8, 8)
    sparse = torch.relu(dense)
    assert not impl.applies((dense,), {})
    assert impl.applies((sparse,), {})
    few = dense.clone()
    few.view(-1)[: int(few.numel() * ZERO_PACK_MIN_ZEROS) - 1] = 0
    assert not impl.applies((few,), {})


def test_profiled_problem_offers_it_after_a_relu_only():
    from monet_opt.profile import build_problem

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    x = torch.randn(2, 3, 16, 16)
    plain = build_problem(model, (x,), progress=False, use_cache=False)
    assert not any(i.name == "zero_packed_input" for n in plain.nodes for i in n.impls)  # opt-in
    problem = build_problem(model, (x,), progress=False, use_cache=False, zero_pack=True)
    assert problem.meta["zero_pack"] is True
    offered = {n.name: [i.name for i in n.impls] for n in problem.nodes if n.op == "conv2d"}
    first, second = sorted(offered)
    assert "zero_packed_input" not in offered[first]
    assert "zero_packed_input" in offered[second]
    node = next(n for n in problem.nodes if n.name == second)
    packed = node.impl("zero_packed_input")
    default = node.impl("default")
    assert packed.keeps_inputs == () and default.keeps_inputs == (0,)
    relu_bytes = 2 * 8 * 16 * 16 * 4
    assert 0 < packed.state_bytes < 0.7 * relu_bytes


class _TwoDensities(nn.Module):
    """Two convolutions of one shape behind ReLUs of different densities."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        h = self.stem(x)
        return self.a(F.relu(h)) + self.b(F.relu(h + 0.2))


def test_packed_bytes_are_each_nodes_own_not_a_same_shaped_nodes():
    """The profile cache is keyed by shapes; a zero-packed input's size follows its values."""
    from monet_opt.profile import build_problem

    torch.manual_seed(0)
    model = _TwoDensities()
    x = torch.randn(2, 3, 16, 16)
    h = model.stem(x).detach()
    want = {"a": zero_pack.packed_bytes(F.relu(h)), "b": zero_pack.packed_bytes(F.relu(h + 0.2))}
    assert want["a"] < want["b"]
    for _ in range(2):  # measured, then from the cache
        problem = build_problem(model, (x,), progress=False, zero_pack=True)
        got = {n.name: n.impl("zero_packed_input").state_bytes for n in problem.nodes if n.name in want}
        assert got == want


def test_functional_conv_without_grad_runs_plainly():
    x = torch.relu(torch.randn(2, 3, 8, 8))
    w = torch.randn(4, 3, 3, 3)
    impl = {i.name: i for i in implementations_for("call_function", F.conv2d)}["zero_packed_input"]
    with torch.no_grad():
        y = impl.run(F.conv2d, (x, w), {"padding": 1}, False)
    assert torch.equal(y, F.conv2d(x, w, padding=1)) and y.grad_fn is None


# ----------------------------------------------------------------------------- in training


@pytest.mark.parametrize("strategy", ["no_recompute", "chen_sqrt"])
def test_wrapped_resnet_with_packed_inputs_trains_like_plain_and_as_predicted(strategy):
    """ResNet-18 (batch 4, 64x64) with every convolution behind a ReLU keeping its input packed
    and every ReLU a bit mask: plain PyTorch's gradients, measured peak within 5 % of the simulator's, and below the same strategy with default implementations."""
    import solver
    from monet_opt.bench import measure_step
    from monet_opt.runtime import MonetWrapper
    from solver import baselines
    from tests import models
    from tests.test_runtime import assert_same_gradients

    torch.manual_seed(0)
    model, x = models.resnet18(batch=4, size=64)
    model.train()
    problem = build_problem_zero_pack(model, x)
    pick = {}
    for node in problem.nodes:
        names = {i.name for i in node.impls}
        if "zero_packed_input" in names:
            pick[node.name] = "zero_packed_input"
        elif node.op == "relu" and "bitmask" in names:
            pick[node.name] = "bitmask"
    packed = [n for n, i in pick.items() if i == "zero_packed_input"]
    assert len(packed) >= 10, packed
    peaks = {}
    for label, impls in (("packed", pick), ("default", None)):
        schedule = getattr(baselines, strategy)(problem, impls=impls)
        wrapped = MonetWrapper(model, schedule, example_inputs=(x,))
        assert_same_gradients(model, wrapped, x, f"{strategy}, {label}")
        peak, _ = measure_step(wrapped, (x,), steps=1)
        predicted = solver.simulate(problem, schedule).peak_bytes
        assert abs(peak - predicted) <= 0.05 * predicted, f"{label}: measured {peak} vs predicted {predicted}"
        peaks[label] = peak
    if strategy == "no_recompute":  # (chen_sqrt keeps some of those inputs whole anyway)
        assert peaks["packed"] < peaks["default"], peaks


def build_problem_zero_pack(model, x):
    from monet_opt.profile import build_problem

    return build_problem(model, (x,), progress=False, repeats=1, zero_pack=True)
