"""Every implementation in monet_opt.ops against the reference op: values, gradients, what it keeps."""

from __future__ import annotations

import operator
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from monet_opt.memory import measure_peak
from monet_opt.ops import describe_registry, implementations_for
from monet_opt.ops.activation import hardtanh_bitmask, relu_bitmask
from monet_opt.ops.attention import query_chunked_attention
from monet_opt.ops.base import Implementation
from monet_opt.ops.common import pack_bits, unpack_bits
from monet_opt.ops.conv import _make_chunked, conv2d_chunked
from monet_opt.ops.elementwise import dropout_bitmask
from monet_opt.ops.pool import max_pool2d_indices

# offered by the registry on CUDA only; its correctness is tested here on CPU all the same
CONV_CHUNKED = Implementation("chunked", _make_chunked(2))

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one thread is faster and immune to a busy machine's OpenMP contention."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ----------------------------------------------------------------------------- helpers


def impls(op, target, example_args=None, example_kwargs=None):
    return {i.name: i for i in implementations_for(op, target, example_args, example_kwargs)}


def saved_bytes(fn, params=()):
    """Run fn() recording tensors saved for backward: bytes deduplicated by storage, params excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def grads_of(out, tensors, grad_out):
    """Gradients for `grad_out`, fed as a copy: in-place-gradient implementations overwrite it."""
    return torch.autograd.grad(out, tensors, grad_out.clone(), allow_unused=True)


def assert_close_all(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def leaf(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def run(impl, target, args, kwargs=None, recompute=False):
    return impl.run(target, tuple(args), dict(kwargs or {}), recompute)


# ----------------------------------------------------------------------------- registry


def test_registry_first_is_default_and_listing():
    rows = describe_registry()
    assert rows and all(isinstance(n, str) and names[0] == "default" for n, names in rows)
    cases = [
        ("call_module", nn.ReLU(inplace=True)),
        ("call_module", nn.BatchNorm2d(3)),
        ("call_module", nn.MaxPool2d(2)),
        ("call_module", nn.Conv2d(3, 4, 3)),
        ("call_module", nn.Linear(3, 4)),
        ("call_module", nn.Dropout(0.1)),
        ("call_module", nn.LayerNorm(3)),
        ("call_function", F.scaled_dot_product_attention),
        ("call_function", operator.add),
        ("call_method", "view"),
        ("call_method", "add_"),
        ("call_module", nn.Identity()),
    ]
    for op, target in cases:
        names = [i.name for i in implementations_for(op, target)]
        assert names[0] == "default" and len(set(names)) == len(names)
    assert list(impls("call_module", nn.ReLU())) == ["default", "bitmask", "inplace_grad", "input_activated"]
    assert list(impls("call_module", nn.MaxPool2d(3, 2, 1))) == [
        "default",
        "indices",
        "indices_channels_last",
    ]
    assert list(impls("call_module", nn.MaxPool2d(2, return_indices=True))) == ["default"]
    bn = nn.BatchNorm2d(3)
    assert list(impls("call_module", bn)) == ["default", "output_activated", "inplace_grad"]
    assert list(impls("call_module", bn.eval())) == ["default"]
    assert list(impls("call_module", nn.Dropout(0.3).eval())) == ["default"]


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_bits_roundtrip(n):
    m = torch.rand(n) > 0.5
    p = pack_bits(m)
    assert p.dtype == torch.uint8 and p.numel() == (n + 7) // 8
    assert torch.equal(unpack_bits(p, n, m.shape), m)
    m2 = torch.rand(3, 5, 7) > 0.3
    assert torch.equal(unpack_bits(pack_bits(m2), m2.numel(), m2.shape), m2)


# ----------------------------------------------------------------------------- in-place handling


def _target_id(target) -> str:
    """A test id that is the same in every process (a function's repr holds its address)."""
    if isinstance(target, (str, nn.Module)):
        return str(target)
    return f"{getattr(target, '__module__', None) or 'torch'}.{target.__name__}"


INPLACE_CASES = [
    ("call_module", nn.ReLU(inplace=True), lambda x: (x,), {}, torch.relu),
    ("call_module", nn.ReLU6(inplace=True), lambda x: (x,), {}, F.relu6),
    ("call_module", nn.Hardswish(inplace=True), lambda x: (x,), {}, F.hardswish),
    ("call_module", nn.SiLU(inplace=True), lambda x: (x,), {}, F.silu),
    ("call_module", nn.LeakyReLU(0.2, inplace=True), lambda x: (x,), {}, lambda x: F.leaky_relu(x, 0.2)),
    ("call_function", F.relu, lambda x: (x,), {"inplace": True}, torch.relu),
    ("call_function", F.relu, lambda x: (x, True), {}, torch.relu),
    ("call_function", F.hardtanh, lambda x: (x, -0.5, 0.5, True), {}, lambda x: F.hardtanh(x, -0.5, 0.5)),
    ("call_function", F.silu, lambda x: (x,), {"inplace": True}, F.silu),
    ("call_function", torch.relu_, lambda x: (x,), {}, torch.relu),
    ("call_function", F.relu_, lambda x: (x,), {}, torch.relu),
    ("call_function", torch.sigmoid_, lambda x: (x,), {}, torch.sigmoid),
    ("call_function", operator.iadd, lambda x: (x, 1.5), {}, lambda x: x + 1.5),
    ("call_function", operator.imul, lambda x: (x, 2.0), {}, lambda x: x * 2.0),
    ("call_method", "relu_", lambda x: (x,), {}, torch.relu),
    ("call_method", "add_", lambda x: (x, 2.0), {"alpha": 3}, lambda x: x + 6.0),
    ("call_method", "clamp_", lambda x: (x, -0.1, 0.1), {}, lambda x: x.clamp(-0.1, 0.1)),
    ("call_method", "fill_", lambda x: (x, 3.0), {}, lambda x: torch.full_like(x, 3.0)),
    ("call_method", "__iadd__", lambda x: (x, 1.0), {}, lambda x: x + 1.0),
    ("call_function", F.dropout, lambda x: (x, 0.0, True, True), {}, lambda x: x),
]


@pytest.mark.parametrize(
    "op,target,make_args,kwargs,ref", INPLACE_CASES, ids=[_target_id(c[1]) for c in INPLACE_CASES]
)
def test_inplace_ops_run_out_of_place(op, target, make_args, kwargs, ref):
    x = torch.randn(4, 6)
    before = x.clone()
    for impl in implementations_for(op, target):
        y = run(impl, target, make_args(x), kwargs)
        assert torch.equal(x, before), f"{impl.name} mutated its input"
        torch.testing.assert_close(y, ref(before), rtol=0, atol=0)
    if isinstance(target, nn.Module):
        assert target.inplace is True  # the module's flag is restored


def test_inplace_default_gradients():
    x = leaf(4, 6)
    y = implementations_for("call_module", nn.ReLU(inplace=True))[0].run(
        nn.ReLU(inplace=True), (x * 1,), {}, False
    )
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, (x > 0).float())
    a = leaf(3, 3)
    b = leaf(3, 3, seed=1)
    y = implementations_for("call_function", operator.iadd)[0].run(operator.iadd, (a, b), {}, False)
    ga, gb = torch.autograd.grad((y * y).sum(), (a, b))
    torch.testing.assert_close(ga, 2 * (a + b))
    torch.testing.assert_close(gb, 2 * (a + b))


def test_unknown_op_default():
    x = torch.randn(2, 3, 4)
    assert torch.equal(run(implementations_for("call_method", "flatten")[0], "flatten", (x, 1)), x.flatten(1))
    assert torch.equal(
        run(implementations_for("call_function", torch.cat)[0], torch.cat, ([x, x], 1)), torch.cat([x, x], 1)
    )
    sm = implementations_for("call_function", F.softmax)[0]
    assert torch.equal(run(sm, F.softmax, (x,), {"dim": -1}), F.softmax(x, dim=-1))


# ----------------------------------------------------------------------------- ReLU / Hardtanh


RELU_TARGETS = [
    ("call_module", nn.ReLU()),
    ("call_module", nn.ReLU(inplace=True)),
    ("call_function", F.relu),
    ("call_function", torch.relu),
    ("call_function", torch.relu_),
    ("call_method", "relu"),
    ("call_method", "relu_"),
]


@pytest.mark.parametrize("op,target", RELU_TARGETS, ids=[_target_id(t) for _, t in RELU_TARGETS])
def test_relu_implementations_match(op, target):
    x0 = torch.randn(2, 3, 5, 7)
    x0[0, 0, 0, :3] = 0.0  # exact zeros: gradient 0 like torch
    x0[0, 0, 1, 0] = float("nan")
    x = x0.clone().requires_grad_()
    ref = torch.relu(x)
    g = torch.randn_like(ref)
    ref_g = grads_of(ref, [x], g)
    found = impls(op, target)
    assert set(found) == {"default", "bitmask", "inplace_grad", "input_activated"}
    for impl in found.values():
        xi = x0.clone().requires_grad_()
        y = run(impl, target, (xi,))
        assert torch.equal(y.isnan(), ref.isnan())
        assert torch.equal(y.nan_to_num(), ref.nan_to_num())
        (gi,) = grads_of(y, [xi], g.clone())  # in-place backwards overwrite the gradient they get
        assert torch.equal(gi, ref_g[0]), impl.name
        assert torch.equal(xi, x0.clone().requires_grad_()) or torch.equal(xi.nan_to_num(), x0.nan_to_num())


@pytest.mark.parametrize(
    "x_stride,grad_stride",
    [
        ((87, 1, 1, 1), (87, 1, 87, 87)),  # an SE block's 1x1 ReLU: strides differ on size-1 dims
        ((128, 1, 32, 8), (128, 16, 4, 1)),  # a channels_last ReLU fed a contiguous gradient
    ],
)
def test_relu_gradients_are_laid_out_as_torchs(x_stride, grad_stride):
    """torch's ReLU backward lays its result out as its output, whatever the gradient's layout;
    the next backward's kernels round by layout, so an in-place backward writing into a gradient
    laid out otherwise made a channels_last rexnet's `bitwise` gradients differ from plain's in
    the last bits. Where strides differ only on size-1 dimensions (the SE case) every ReLU
    implementation's input gradient now has torch's strides; elsewhere the values are torch's."""
    shape = (2, 87, 1, 1) if x_stride[0] == 87 else (2, 8, 4, 4)
    x0 = torch.empty_strided(shape, x_stride).copy_(torch.randn(shape))
    g = torch.empty_strided(shape, grad_stride).copy_(torch.randn(shape))
    xr = x0.clone().requires_grad_()
    (expected,) = grads_of(torch.relu(xr), [xr], g)
    found = impls("call_module", nn.ReLU())
    for impl in found.values():
        xi = x0.detach().clone().requires_grad_()
        assert xi.stride() == x_stride
        (gi,) = grads_of(run(impl, nn.ReLU(), (xi,)), [xi], g)
        assert torch.equal(gi, expected), impl.name
        if x_stride[0] == 87:  # (where the layouts differ beyond size-1 dims, in place: no copy)
            assert gi.stride() == expected.stride(), (impl.name, gi.stride())


@pytest.mark.parametrize("numel", [8 * 4096 * 3 + 5, 1000])  # chunked (odd tail) and whole
def test_relu_bitmask_backward_is_torchs_with_inf_and_nan_gradients(numel):
    x = torch.randn(numel)
    x[:40] = 0.0
    g = torch.randn(numel)
    g[::97] = float("nan")  # at kept and at masked positions
    g[5::89] = float("inf")
    ref = torch.ops.aten.threshold_backward(g, torch.relu(x), 0)
    xi = x.clone().requires_grad_()
    (gi,) = grads_of(relu_bitmask(xi), [xi], g)
    assert torch.equal(gi.isnan(), ref.isnan()) and torch.equal(gi.nan_to_num(), ref.nan_to_num())
    assert gi.isnan().any() and gi.isinf().any()


@pytest.mark.parametrize("grad_format", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("shape", [(2, 16, 40, 40), (2, 3, 5, 7), (2, 8, 4, 6, 10)])  # chunked, whole, 3-d
def test_bitmasks_of_channels_last_tensors_are_torchs_gradients(shape, grad_format):
    """A channels_last tensor's mask is packed in its memory order (no copy; stem-sized
    backward 31 -> 13 ms): the ReLU and hardtanh gradients are torch's bit for bit, whether the
    gradient arrives channels_last, as the mask, or contiguous."""
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    grad_format = fmt if grad_format is torch.channels_last else grad_format
    x = torch.randn(shape).contiguous(memory_format=fmt)
    g = torch.randn(shape).contiguous(memory_format=grad_format)
    for ours, theirs in (
        (relu_bitmask, torch.relu),
        (lambda t: hardtanh_bitmask(t, 0.0, 0.5), lambda t: F.hardtanh(t, 0.0, 0.5)),
    ):
        xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        y = ours(xi)
        assert y.is_contiguous(memory_format=fmt)
        (gi,) = grads_of(y, [xi], g.clone())
        (gr,) = grads_of(theirs(xr), [xr], g.clone())
        assert torch.equal(gi, gr)


def test_relu_bitmask_gradcheck():
    x = torch.randn(3, 11, dtype=torch.float64)
    x = (x + 0.05 * x.sign()).requires_grad_()  # keep away from the kink
    assert torch.autograd.gradcheck(relu_bitmask, (x,))


def test_relu_bitmask_saves_one_thirtysecond():
    target = nn.ReLU(inplace=True)
    found = impls("call_module", target)
    x = torch.randn(8, 64, 28, 28, requires_grad=True)
    d, _ = saved_bytes(lambda: run(found["default"], target, (x,)))
    b, _ = saved_bytes(lambda: run(found["bitmask"], target, (x,)))
    assert d == x.numel() * 4
    assert b == x.numel() // 8
    assert b * 32 == d


def test_relu_input_activated_keeps_its_input_not_its_output():
    """The backward state is the input's storage (shared with whatever else keeps it, e.g. an
    output-activated BatchNorm before it), never the output's."""
    target = nn.ReLU()
    impl = impls("call_module", target)["input_activated"]
    x = torch.randn(8, 16, 14, 14, requires_grad=True)
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = run(impl, target, (x,))
    assert kept == [x.untyped_storage().data_ptr()]
    assert y.untyped_storage().data_ptr() not in kept


@pytest.mark.parametrize(
    "op,target,args,lo,hi",
    [
        ("call_module", nn.ReLU6(inplace=True), (), 0.0, 6.0),
        ("call_module", nn.Hardtanh(-2.0, 1.5), (), -2.0, 1.5),
        ("call_function", F.relu6, (), 0.0, 6.0),
        ("call_function", F.hardtanh, (-0.5, 0.5), -0.5, 0.5),
    ],
)
def test_hardtanh_bitmask(op, target, args, lo, hi):
    x0 = torch.randn(4, 8, 9) * 4
    x0[0, 0, :4] = torch.tensor([lo, hi, 0.0, 6.0])
    ref_x = x0.clone().requires_grad_()
    ref = F.hardtanh(ref_x, lo, hi)
    g = torch.randn_like(ref)
    (ref_g,) = grads_of(ref, [ref_x], g)
    found = impls(op, target)
    assert set(found) == {"default", "bitmask"}
    for impl in found.values():
        xi = x0.clone().requires_grad_()
        y = run(impl, target, (xi,) + args)
        assert torch.equal(y, ref)
        (gi,) = grads_of(y, [xi], g)
        assert torch.equal(gi, ref_g)
    xi = x0.clone().requires_grad_()
    d, _ = saved_bytes(lambda: run(found["default"], target, (xi,) + args))
    b, _ = saved_bytes(lambda: run(found["bitmask"], target, (xi,) + args))
    assert b * 32 == d


def test_hardtanh_bitmask_gradcheck():
    x = (torch.rand(5, 7, dtype=torch.float64) * 8 - 1).requires_grad_()
    x = (
        x.detach()
        .masked_fill((x - 0).abs() < 0.05, 0.3)
        .masked_fill((x - 6).abs() < 0.05, 5.5)
        .requires_grad_()
    )
    assert torch.autograd.gradcheck(lambda t: hardtanh_bitmask(t, 0.0, 6.0), (x,))


# ----------------------------------------------------------------------------- BatchNorm


def _bn_pair(cls=nn.BatchNorm2d, c=4, seed=0, **kw):
    torch.manual_seed(seed)
    ref = cls(c, **kw)
    if ref.affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-0.5, 0.5)
    mine = cls(c, **kw)
    mine.load_state_dict(ref.state_dict())
    return ref, mine


def _bn_state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


BN_CONFIGS = [
    (nn.BatchNorm2d, (6, 4, 5, 7), {}),
    (nn.BatchNorm2d, (6, 4, 5, 7), {"momentum": None}),
    (nn.BatchNorm2d, (6, 4, 5, 7), {"affine": False}),
    (nn.BatchNorm2d, (6, 4, 5, 7), {"track_running_stats": False}),
    (nn.BatchNorm1d, (10, 4), {}),
    (nn.BatchNorm1d, (5, 4, 9), {}),
    (nn.BatchNorm3d, (2, 4, 3, 4, 5), {}),
]


@pytest.mark.parametrize("name", ["default", "output_activated", "inplace_grad"])
@pytest.mark.parametrize("cls,shape,kw", BN_CONFIGS, ids=[f"{c.__name__}-{k}" for c, _, k in BN_CONFIGS])
def test_batchnorm_train(name, cls, shape, kw):
    ref, mine = _bn_pair(cls, **kw)
    impl = impls("call_module", mine)[name]
    x0 = torch.randn(*shape) * 2 + 0.5
    params_ref = [p for p in ref.parameters()]
    params_mine = [p for p in mine.parameters()]
    for step in range(2):  # two steps: the cumulative-average momentum path changes with the count
        xr = (x0 + step).requires_grad_()
        xm = (x0 + step).requires_grad_()
        yr = ref(xr)
        ym = run(impl, mine, (xm,))
        torch.testing.assert_close(ym, yr, rtol=0, atol=1e-6)
        g = torch.randn_like(yr)
        gr = grads_of(yr, [xr] + params_ref, g)
        gm = grads_of(ym, [xm] + params_mine, g.clone())
        assert_close_all(gm, gr, rtol=1e-4, atol=1e-5)
        for k, v in ref.state_dict().items():
            assert torch.equal(mine.state_dict()[k], v), k
        # recompute: bitwise identical output, running statistics and counter untouched
        state = _bn_state(mine)
        y2 = run(impl, mine, ((x0 + step).requires_grad_(),), recompute=True)
        assert torch.equal(y2, ym)
        for k, v in mine.state_dict().items():
            assert torch.equal(v, state[k]), k


def test_batchnorm_default_first_compute_bitwise_equals_module():
    ref, mine = _bn_pair()
    x = torch.randn(4, 4, 6, 6)
    assert torch.equal(run(impls("call_module", mine)["default"], mine, (x,)), ref(x))


@pytest.mark.parametrize(
    "module,shape",
    [
        (nn.InstanceNorm2d(4, track_running_stats=True, affine=True), (3, 4, 5, 5)),
        (nn.LazyBatchNorm2d(), (3, 4, 5, 5)),
        (type("MyBN", (nn.BatchNorm2d,), {})(4, momentum=None), (3, 4, 5, 5)),
    ],
    ids=["instancenorm", "lazy", "subclass"],
)
def test_norm_modules_recompute_leaves_stats(module, shape):
    x = torch.randn(*shape)
    impl = implementations_for("call_module", module)[0]
    y = run(impl, module, (x,))
    state = _bn_state(module)
    assert state  # has running statistics
    y2 = run(impl, module, (x,), recompute=True)
    assert torch.equal(y, y2)
    for k, v in module.state_dict().items():
        assert torch.equal(v, state[k]), k
    y3 = run(impl, module, (x,))  # a real second step updates them again
    assert torch.equal(y3, y)
    assert not all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_batchnorm_eval_default():
    ref, mine = _bn_pair()
    ref.running_mean.uniform_(-1, 1)
    mine.load_state_dict(ref.state_dict())
    ref.eval()
    mine.eval()
    (impl,) = implementations_for("call_module", mine)
    x = torch.randn(3, 4, 5, 5)
    assert torch.equal(run(impl, mine, (x,)), ref(x))
    assert torch.equal(run(impl, mine, (x,), recompute=True), ref(x))


def test_functional_batchnorm_recompute():
    rm, rv = torch.zeros(4), torch.ones(4)
    (impl,) = implementations_for("call_function", F.batch_norm)
    x = torch.randn(3, 4, 5, 5)
    y = run(impl, F.batch_norm, (x, rm, rv), {"training": True})
    rm1, rv1 = rm.clone(), rv.clone()
    assert not torch.equal(rm1, torch.zeros(4))
    y2 = run(impl, F.batch_norm, (x, rm, rv), {"training": True}, recompute=True)
    assert torch.equal(y, y2) and torch.equal(rm, rm1) and torch.equal(rv, rv1)


@pytest.mark.parametrize("function", ["BatchNormOutputActivated", "BatchNormInplaceGrad"])
def test_batchnorm_custom_gradcheck(function):
    bn = nn.BatchNorm2d(3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.7, -1.3, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, 0.4, -0.3]))
    impl = impls("call_module", bn)["output_activated"]
    x = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    w = bn.weight
    b = bn.bias

    def f(x, w, b):
        from monet_opt.ops import norm

        return getattr(norm, function).apply(x, w, b, None, None, 0.1, 1e-5)

    assert torch.autograd.gradcheck(f, (x, w, b))
    assert run(impl, bn, (x,)).dtype == torch.float64


def test_batchnorm_output_activated_zero_weight_channel():
    ref, mine = _bn_pair()
    with torch.no_grad():
        ref.weight[1] = 0.0
        mine.weight[1] = 0.0
    x = torch.randn(4, 4, 5, 5)
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    ym = run(impls("call_module", mine)["output_activated"], mine, (xm,))
    g = torch.randn_like(yr)
    assert_close_all(
        grads_of(ym, [xm, mine.weight, mine.bias], g.clone()),
        grads_of(yr, [xr, ref.weight, ref.bias], g),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "layout,kernel,shape",
    [
        ("contiguous", "on", (6, 5, 7, 9)),
        ("contiguous", "on", (4, 12, 40, 40)),  # big enough to split the channels over threads
        ("contiguous", "off", (6, 5, 7, 9)),
        ("channels_last", "on", (6, 5, 7, 9)),
    ],
)
def test_batchnorm_in_place_backward_from_kept_tensor_equals_x_hat_form(layout, kernel, shape, monkeypatch):
    """The float32 in-place backward (sums and g * k1 + z * k2 + k3 from the kept input or output:
    by the C kernel where it applies, else by torch's kernel and three in-place passes) gives the
    gradients of the chunked x_hat form it replaced, and torch's, from the input and from the
    output alike."""
    from monet_opt.ops import batch_norm_kernel, norm

    if kernel == "off":
        monkeypatch.setenv("MONET_OPT_BN_KERNEL", "0")
    torch.manual_seed(0)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    x = (torch.randn(*shape) * 3 + 2).contiguous(memory_format=fmt)
    c = shape[1]
    w, b = torch.randn(c), torch.randn(c)
    y, mean, invstd = norm._bn_statistics_forward(x, w, b, None, None, 0.1, 1e-5)
    g = torch.randn_like(x)
    gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
        g, x, w, None, None, mean, invstd, True, 1e-5, [True] * 3
    )
    scale = invstd * w
    m, s = norm._channel_view(mean, 4), norm._channel_view(invstd, 4)
    slow = g.clone()
    slow_sums = norm._bn_backward_in_place(slow, lambda i: x[i].sub(m).mul_(s), scale, True)
    for z, center, inv in ((x, mean, invstd), (y, b, 1.0 / w)):
        assert norm._fast_source(g, z, torch.float32)
        assert batch_norm_kernel.usable(g, z) == (layout == "contiguous" and kernel == "on")
        fast = g.clone()
        sums = norm._bn_backward_from_source(fast, z, center, inv, scale, True)
        torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fast, gx, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sums, slow_sums, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sums, (gw, gb), rtol=1e-5, atol=1e-5)
    # only the sums: g untouched
    kept = g.clone()
    sums = norm._bn_backward_from_source(kept, x, mean, invstd, scale, False)
    assert torch.equal(kept, g)
    torch.testing.assert_close(sums, (gw, gb), rtol=1e-5, atol=1e-5)
    # the kept tensor in another layout or dtype than the gradient: the x_hat form
    assert not norm._fast_source(
        g.contiguous(), x.contiguous(memory_format=torch.channels_last), torch.float32
    )
    assert not norm._fast_source(g.bfloat16(), x.bfloat16(), torch.float32)


def test_batch_norm_kernel_compiles_on_this_machine():
    # CI's machine is like this one (a C compiler on PATH): the fast path must be there
    from monet_opt.ops import batch_norm_kernel

    assert batch_norm_kernel.kernel() is not None, batch_norm_kernel.kernel_error()
    x = torch.randn(2, 3, 4)
    assert batch_norm_kernel.usable(x, x.clone())
    assert not batch_norm_kernel.usable(x.double(), x.double())
    assert not batch_norm_kernel.usable(x, x.transpose(1, 2).contiguous().transpose(1, 2))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(4, 6, 9, 11), (4, 12, 40, 40), (8, 20, 3), (3, 6, 17)])
def test_batch_norm_kernel_forward_is_torchs_bitwise_and_replays(shape, affine):
    """The custom forms' training forward by the C kernel: output, batch statistics and running
    statistics bitwise torch's; given the statistics it returned, the same output again."""
    from monet_opt.ops import batch_norm_kernel, norm

    assert batch_norm_kernel.forward_is_exact()  # the once-per-process probe holds on this CPU
    torch.manual_seed(0)
    c = shape[1]
    x = torch.randn(*shape) * 3 + 2
    w, b = (torch.randn(c), torch.randn(c)) if affine else (None, None)
    rm, rv = torch.randn(c), torch.rand(c) + 0.5
    rm2, rv2 = rm.clone(), rv.clone()
    want = norm._bn_statistics_forward(x, w, b, rm, rv, 0.1, 1e-5)
    ctx, memo = types.SimpleNamespace(), {}
    got = norm._bn_forward(ctx, x, w, b, rm2, rv2, 0.1, 1e-5, memo)
    assert memo["kernel"]
    for a, e in zip((*got, rm2, rv2), (*want, rm, rv)):
        assert torch.equal(a, e)
    again = norm._bn_forward(ctx, x, w, b, None, None, 0.1, 1e-5, memo)
    assert torch.equal(again[0], got[0])
    # one element per plane, 2-d, float64, channels_last: torch's op
    for other in (x[:, :, :1], x[:, :, 0] if x.dim() == 3 else x[:, :, 0, 0], x.double()):
        assert batch_norm_kernel.forward(other, None, None, None, None, 0.1, 1e-5) is None
    if x.dim() == 4:
        cl = x.contiguous(memory_format=torch.channels_last)
        assert batch_norm_kernel.forward(cl, None, None, None, None, 0.1, 1e-5) is None


@pytest.mark.parametrize("name", ["output_activated", "inplace_grad"])
def test_batchnorm_custom_forms_on_bfloat16_activations(name):
    """bfloat16 activations with float32 batch-norm parameters run the chunked x_hat form (in the
    statistics' dtype): gradients close to torch's at bfloat16's precision."""
    ref, mine = _bn_pair()
    x = (torch.randn(4, 4, 6, 6) * 2 + 1).bfloat16()
    xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref(xr)
    ym = run(impls("call_module", mine)[name], mine, (xm,))
    assert ym.dtype == yr.dtype == torch.bfloat16
    g = torch.randn_like(yr)
    got = grads_of(ym, [xm, mine.weight, mine.bias], g.clone())
    want = grads_of(yr, [xr, ref.weight, ref.bias], g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), rtol=0.05, atol=0.05)


def test_batchnorm_saved_bytes():
    bn = nn.BatchNorm2d(16)
    found = impls("call_module", bn)
    x = torch.randn(8, 16, 14, 14, requires_grad=True)
    params = list(bn.parameters())
    d, _ = saved_bytes(lambda: run(found["default"], bn, (x,)), params)
    o, y = saved_bytes(lambda: run(found["output_activated"], bn, (x,)), params)
    act = x.numel() * 4
    assert act <= d <= act + 1024  # input + mean/invstd
    assert act <= o <= act + 1024  # output + invstd
    # the output-activated version keeps its own output, not the input
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        y = run(found["output_activated"], bn, (x,))
    assert any(t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for t in seen)
    assert not any(t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for t in seen)


# ----------------------------------------------------------------------------- MaxPool2d

POOL_CONFIGS = [
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0), dilation=(2, 1)),
    dict(kernel_size=17, stride=1, padding=8),  # 289-element window: int16 offsets
]


@pytest.mark.parametrize("width", [18, 200])  # 200: offsets relative to the corner overflow uint8
@pytest.mark.parametrize("cfg", POOL_CONFIGS, ids=[str(c) for c in POOL_CONFIGS])
def test_maxpool_implementations_match(cfg, width):
    from monet_opt.ops.pool import _plan

    pool = nn.MaxPool2d(**cfg)
    x0 = torch.randn(2, 3, 19, width)
    if width == 200 and cfg["kernel_size"] not in (2, 17):
        assert _plan(
            nn.modules.utils._pair(cfg["kernel_size"]), nn.modules.utils._pair(cfg.get("dilation", 1)), width
        ) == ("window", torch.uint8)
    x0[0, 0, :4, :4] = 1.0  # ties: must resolve as torch does
    xr = x0.clone().requires_grad_()
    ref = pool(xr)
    g = torch.randn_like(ref)
    (ref_g,) = grads_of(ref, [xr], g)
    for impl in impls("call_module", pool).values():
        xi = x0.clone().requires_grad_()
        y = run(impl, pool, (xi,))
        assert torch.equal(y, ref)
        (gi,) = grads_of(y, [xi], g)
        torch.testing.assert_close(gi, ref_g, rtol=RTOL, atol=ATOL)


def test_maxpool_functional_and_unbatched():
    found = impls("call_function", F.max_pool2d)
    x = torch.randn(3, 10, 10, requires_grad=True)  # unbatched (C, H, W)
    ref = F.max_pool2d(x, 3, 2, 1)
    g = torch.randn_like(ref)
    (ref_g,) = grads_of(ref, [x], g)
    y = run(found["indices"], F.max_pool2d, (x, 3, 2, 1))
    assert torch.equal(y, ref)
    torch.testing.assert_close(grads_of(y, [x], g)[0], ref_g)
    y = run(found["indices"], F.max_pool2d, (x,), {"kernel_size": 2, "return_indices": True})
    assert isinstance(y, tuple)  # falls back to torch when indices are returned


@pytest.mark.parametrize("cfg", POOL_CONFIGS, ids=[str(c) for c in POOL_CONFIGS])
def test_maxpool_channels_last_chunks_match(cfg, monkeypatch):
    """Several channels_last chunks (a small chunk size forces 2-3 samples per copy), many ties
    (a ReLU output: zeros everywhere), an odd batch: values, saved offsets and gradient are the
    NCHW kernel's, exactly."""
    import monet_opt.ops.pool as pool_mod

    x0 = torch.relu(torch.randn(7, 4, 23, 31))
    x0[1, :, :6, :6] = 2.0
    monkeypatch.setattr(pool_mod, "CHUNK_BYTES", 3 * x0[0].numel() * 4 - 1)
    pool = nn.MaxPool2d(**cfg)
    found = impls("call_module", pool)
    outs, offs = [], []
    for name in ("indices", "indices_channels_last"):
        seen = []
        xi = x0.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t, seen=seen: seen.append(t) or t, lambda t: t):
            y = run(found[name], pool, (xi,))
        g = torch.arange(y.numel(), dtype=y.dtype).view_as(y)
        outs.append((y.detach(), grads_of(y, [xi], g)[0]))
        offs.append(seen[0])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert offs[0].dtype == offs[1].dtype and torch.equal(offs[0], offs[1])
    assert offs[1].is_contiguous() and outs[1][0].is_contiguous()


def test_maxpool_channels_last_offered_for_batched_nchw_only():
    pool = nn.MaxPool2d(3, 2, 1)
    assert "indices_channels_last" in [
        i.name
        for i in implementations_for("call_module", pool)
        if i.applies is None or i.applies((torch.ones(2, 3, 8, 8),), {})
    ]
    for x in (torch.ones(3, 8, 8), torch.ones(2, 8, 8, 3).permute(0, 3, 1, 2)):
        offered = [
            i.name
            for i in implementations_for("call_module", pool)
            if i.applies is None or i.applies((x,), {})
        ]
        assert offered == ["default", "indices"]
    # the runtime runs a named implementation anywhere: on unbatched input it is torch's NCHW path
    x = torch.randn(3, 10, 10, requires_grad=True)
    y = run(impls("call_module", pool)["indices_channels_last"], pool, (x,))
    assert torch.equal(y, pool(x))


def test_maxpool_indices_gradient_of_a_channels_last_input_is_laid_out_as_torchs():
    """torch's max-pool backward lays the input gradient out as the input. The "indices"
    backward, handing torch a stand-in input of the right sizes, got a contiguous gradient for a
    channels_last input: a channels_last ResNet's stem ReLU, BatchNorm and convolution then ran
    their backwards on a contiguous gradient, and the pool's backward took twice torch's memory
    (a contiguous copy of the gradient) and 3x its time (ResNet-50's stem pool, 102 ms vs 29)."""
    pool = nn.MaxPool2d(3, 2, 1)
    x0 = torch.relu(torch.randn(4, 16, 24, 24)).contiguous(memory_format=torch.channels_last)
    xr = x0.clone().requires_grad_()
    ref = pool(xr)
    g = torch.randn_like(ref)
    (ref_g,) = torch.autograd.grad(ref, [xr], g, retain_graph=True)
    assert ref_g.is_contiguous(memory_format=torch.channels_last) and not ref_g.is_contiguous()
    xi = x0.clone().requires_grad_()
    y = run(impls("call_module", pool)["indices"], pool, (xi,))
    assert torch.equal(y, ref) and y.stride() == ref.stride()
    ran = {}

    def backward(out, x):
        ran["grad"] = torch.autograd.grad(out, [x], g, retain_graph=True)[0]

    peak = measure_peak(backward, y, xi).peak_bytes
    assert torch.equal(ran["grad"], ref_g) and ran["grad"].stride() == ref_g.stride()
    default = measure_peak(backward, ref, xr).peak_bytes
    # torch's, plus the int64 indices rebuilt from the offsets (and their window corners); a
    # contiguous gradient added a copy of the gradient (+147 KB here)
    assert peak <= default + y.numel() * 8 + 4096, (peak, default)


def _channels_last(*shape):
    return torch.randn(*shape).contiguous(memory_format=torch.channels_last)


LAYOUT_CASES = [
    ("conv3x3", "call_module", lambda: nn.Conv2d(8, 16, 3, padding=1).to(memory_format=torch.channels_last)),
    ("conv1x1s2", "call_module", lambda: nn.Conv2d(8, 16, 1, stride=2).to(memory_format=torch.channels_last)),
    ("conv_contiguous_weight", "call_module", lambda: nn.Conv2d(8, 16, 3, padding=1)),
    (
        "depthwise",
        "call_module",
        lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8).to(memory_format=torch.channels_last),
    ),
    ("batch_norm", "call_module", lambda: nn.BatchNorm2d(8)),
    ("relu", "call_module", lambda: nn.ReLU()),
    ("relu6", "call_module", lambda: nn.ReLU6()),
    ("max_pool", "call_module", lambda: nn.MaxPool2d(3, 2, 1)),
    ("avg_pool", "call_module", lambda: nn.AvgPool2d(2)),
    ("dropout", "call_module", lambda: nn.Dropout(0.2)),
]


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=[c[0] for c in LAYOUT_CASES])
def test_every_implementation_lays_out_gradients_of_channels_last_tensors_as_the_default(case):
    """On channels_last inputs every implementation's output, input gradient and parameter
    gradients (as the engine makes them, before a leaf's AccumulateGrad restrides them) have
    torch's strides (the "indices" max pool's input gradient came out contiguous, and the
    backwards before it ran on it)."""
    _, op, make = case
    target = make()
    x0 = _channels_last(2, 8, 10, 10)
    params = list(target.parameters())

    def strides(fn):
        x = x0.clone().requires_grad_()
        torch.manual_seed(1)
        y = fn(x)
        grads = torch.autograd.grad(y, [x, *params], torch.ones_like(y))
        return [y.stride(), *(g.stride() for g in grads)]

    plain = strides(target)
    layouts = {
        name: strides(lambda x, impl=impl: run(impl, target, (x,)))
        for name, impl in impls(op, target, (x0,), {}).items()
        if impl.applies is None or impl.applies((x0,), {})
    }
    assert len(layouts) > 1 or case[0] in ("avg_pool", "conv_contiguous_weight"), layouts
    assert all(v == plain for v in layouts.values()), (plain, layouts)


def test_maxpool_indices_gradcheck():
    x = torch.randperm(2 * 2 * 7 * 7, dtype=torch.float64).view(2, 2, 7, 7).div(10).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: max_pool2d_indices(t, 3, 2, 1), (x,))
    assert torch.autograd.gradcheck(lambda t: max_pool2d_indices(t, 3, 2, 1, channels_last=True), (x,))


def test_maxpool_indices_saves_less():
    pool = nn.MaxPool2d(3, 2, 1)
    found = impls("call_module", pool)
    x = torch.randn(8, 64, 56, 56, requires_grad=True)
    d, y = saved_bytes(lambda: run(found["default"], pool, (x,)))
    i, _ = saved_bytes(lambda: run(found["indices"], pool, (x,)))
    assert d == x.numel() * 4 + y.numel() * 8
    assert i == y.numel()  # one uint8 per output element
    assert i * 20 < d


# ----------------------------------------------------------------------------- Conv2d

CONV_CONFIGS = [
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, bias=False),
    dict(in_channels=4, out_channels=8, kernel_size=(3, 1), padding=(1, 0), dilation=2, groups=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding="same"),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"),
    dict(in_channels=6, out_channels=5, kernel_size=1),  # ("gemm_backward" runs its matrix products)
    dict(in_channels=6, out_channels=4, kernel_size=1, bias=False),
    dict(in_channels=6, out_channels=4, kernel_size=1, stride=2),  # (strided products)
]


@pytest.mark.parametrize("cfg", CONV_CONFIGS, ids=[str(c) for c in CONV_CONFIGS])
@pytest.mark.parametrize("batch", [5, 1])
def test_conv_implementations_match(cfg, batch):
    torch.manual_seed(0)
    conv = nn.Conv2d(**cfg)
    x0 = torch.randn(batch, cfg["in_channels"], 11, 10)
    xr = x0.clone().requires_grad_()
    ref = conv(xr)
    g = torch.randn_like(ref)
    params = list(conv.parameters())
    ref_g = grads_of(ref, [xr] + params, g)
    found = impls("call_module", conv)
    chunkable = cfg.get("padding_mode", "zeros") == "zeros" and not isinstance(cfg.get("padding"), str)
    assert ("chunked" in found) == (chunkable and torch.cuda.is_available())
    assert ("chunked_backward" in found) == chunkable  # (batch 1 runs F.conv2d itself)
    for impl in [*found.values(), *([CONV_CHUNKED] if chunkable else [])]:
        xi = x0.clone().requires_grad_()
        y = run(impl, conv, (xi,))
        torch.testing.assert_close(y, ref, rtol=RTOL, atol=ATOL)
        got = grads_of(y, [xi] + params, g)
        assert_close_all(got, ref_g, rtol=RTOL, atol=1e-5)
        if impl.name == "chunked_backward":
            assert torch.equal(y, ref)  # the forward is torch's own


@pytest.mark.parametrize("cfg", CONV_CONFIGS, ids=[str(c) for c in CONV_CONFIGS])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_conv_state_from_input_gives_the_defaults_gradients_bit_for_bit(cfg, layout):
    """`state_from_inputs` (a schedule's make_state) of the default, "chunked_backward" and
    "gemm_backward" (the default's where its products do not apply: a channels_last input): no
    forward, a stand-in of the output's shape that holds one element, and the implementation's
    own backward: its gradients bit for bit. Where it cannot (string padding, a padding mode), it
    is absent or raises."""
    torch.manual_seed(0)
    conv = nn.Conv2d(**cfg)
    x0 = torch.randn(3, cfg["in_channels"], 11, 10)
    if layout == "channels_last":
        x0 = x0.to(memory_format=torch.channels_last)
    xr = x0.clone().requires_grad_()
    ref = conv(xr)
    g = torch.randn_like(ref)
    params = list(conv.parameters())
    ref_g = grads_of(ref, [xr] + params, g)
    default = impls("call_module", conv)["default"]
    xi = x0.clone().requires_grad_()
    if cfg.get("padding_mode", "zeros") != "zeros" or isinstance(cfg.get("padding"), str):
        assert default.state_from_inputs is None
        functional = impls("call_function", F.conv2d)["default"]
        with pytest.raises(RuntimeError, match="numeric padding"):
            functional.state_from_inputs(F.conv2d, (xi, conv.weight), {"padding": "same"}, True)
        return
    found = impls("call_module", conv)
    for name in ("default", "chunked_backward", "gemm_backward"):  # (each against its own run's gradients)
        if name != "default":
            xr = x0.clone().requires_grad_()
            ref_g = grads_of(run(found[name], conv, (xr,)), [xr] + params, g)
        xi = x0.clone().requires_grad_()
        stand_in = found[name].state_from_inputs(conv, (xi,), {}, True)
        assert stand_in.shape == ref.shape and stand_in.dtype == ref.dtype
        assert stand_in.untyped_storage().nbytes() == stand_in.element_size()
        got = grads_of(stand_in, [xi] + params, g)
        for a, b in zip(got, ref_g):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch", [6, 1])
def test_conv_gemm_backward_is_the_convolution(bias, batch):
    """The "gemm_backward" implementation on a 1x1 convolution, strided or not: torch's own output,
    and torch's gradients up to float rounding, both ways of summing the weight gradient (one bmm
    where its temporary is no larger than the gradient, one addmm per sample otherwise), the same
    tensors kept; offered only where it applies (the profiler asks `applies` with the node's
    example)."""
    from monet_opt.ops.conv import Conv2dGemm

    torch.manual_seed(0)
    for cin, cout, side, stride in ((8, 3, 9, 1), (64, 32, 2, 1), (8, 3, 9, 2), (64, 32, 5, (3, 2))):
        # (bmm; then addmm: 6*32*64 > 6*32*4; the same strided, odd sides)
        conv = nn.Conv2d(cin, cout, 1, stride=stride, bias=bias)
        x0 = torch.randn(batch, cin, side, side + 1)
        xr = x0.clone().requires_grad_()
        ref = conv(xr)
        g = torch.randn_like(ref)
        params = list(conv.parameters())
        ref_g = grads_of(ref, [xr] + params, g)
        gemm = impls("call_module", conv, (x0,), {})["gemm_backward"]
        assert gemm.applies((x0,), {}) and not gemm.bitwise
        xi = x0.clone().requires_grad_()
        y = run(gemm, conv, (xi,))
        assert y.grad_fn is not None and type(y.grad_fn).__name__ == f"{Conv2dGemm.__name__}Backward"
        assert torch.equal(y, ref)  # (torch's own forward)
        assert_close_all(grads_of(y, [xi] + params, g), ref_g, rtol=1e-5, atol=1e-5)
        default = impls("call_module", conv)["default"]
        kept = [
            saved_bytes(lambda im=im, c=conv, t=xr: run(im, c, (t,)), params)[0] for im in (default, gemm)
        ]
        assert kept == [x0.numel() * 4] * 2
    x = torch.randn(2, 8, 5, 5)
    for conv, example in (
        (nn.Conv2d(8, 4, 3), x),
        (nn.Conv2d(8, 4, 1, dilation=2), x),
        (nn.Conv2d(8, 4, 1, padding=1), x),
        (nn.Conv2d(8, 4, 1, groups=2), x),
        (nn.Conv2d(8, 4, 1), x.to(memory_format=torch.channels_last)),
    ):
        assert not impls("call_module", conv)["gemm_backward"].applies((example,), {}), conv


def test_conv_gemm_backward_under_autocast_runs_the_default():
    """Not written for autocast: there the default runs (and makes its states)."""
    conv = nn.Conv2d(8, 4, 1)
    x = torch.randn(2, 8, 5, 5)
    gemm = impls("call_module", conv)["gemm_backward"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = run(gemm, conv, (x.requires_grad_(),))
        stand_in = gemm.state_from_inputs(conv, (x,), {}, True)
        ref = conv(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    assert type(stand_in.grad_fn).__name__ == "Conv2dFromInputBackward"


def test_conv_functional_and_channels_last():
    w = torch.randn(6, 3, 3, 3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()
    ref = F.conv2d(x, w, b, 1, 1)
    g = torch.randn_like(ref)
    y = run(CONV_CHUNKED, F.conv2d, (x, w, b), {"padding": 1})
    torch.testing.assert_close(y, ref, rtol=RTOL, atol=ATOL)
    assert_close_all(grads_of(y, [x, w, b], g), grads_of(ref, [x, w, b], g), rtol=RTOL, atol=1e-5)


def test_conv_chunked_gradcheck():
    x = torch.randn(3, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: conv2d_chunked(x, w, b, 2, 1), (x, w, b))


def test_conv_chunked_backward_gradcheck_and_smaller_backward_peak():
    from monet_opt.ops.conv import Conv2dChunkedBackward

    x = torch.randn(3, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    f = lambda x, w, b: Conv2dChunkedBackward.apply(x, w, b, (1, 1), (1, 1), (1, 1), 1, 2)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, w, b))
    # ResNet-50's layer1 conv3 at batch 8, 224x224: oneDNN's backward workspace copies the whole
    # output gradient (small shapes have none, and there chunking costs a little instead)
    conv = nn.Conv2d(64, 256, 1, bias=False)
    found = impls("call_module", conv)
    x0 = torch.randn(8, 64, 56, 56)
    g0 = torch.randn(8, 256, 56, 56)

    def peak(name):
        x = x0.clone().requires_grad_()
        y = run(found[name], conv, (x,))
        return _allocation_peak(lambda: torch.autograd.grad(y, [x, conv.weight], g0))

    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the workspace is oneDNN's multi-threaded one (CI has 2 cores)
    try:
        peaks = {n: peak(n) for n in ("default", "chunked_backward")}
    finally:
        torch.set_num_threads(threads)
    assert peaks["chunked_backward"] < peaks["default"] - g0.numel() * 4 // 2, peaks


def test_conv_chunked_keeps_same_tensors():
    conv = nn.Conv2d(8, 8, 3, padding=1)
    found = impls("call_module", conv)
    x = torch.randn(4, 8, 16, 16, requires_grad=True)
    d, _ = saved_bytes(lambda: run(found["default"], conv, (x,)), conv.parameters())
    c, _ = saved_bytes(lambda: run(CONV_CHUNKED, conv, (x,)), conv.parameters())
    assert d == c == x.numel() * 4


# ----------------------------------------------------------------------------- attention

SDPA = F.scaled_dot_product_attention


def _qkv(b=2, h=3, lq=13, lk=11, e=8, dtype=torch.float32, hk=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, e, generator=g, dtype=dtype)
    k = torch.randn(b, hk or h, lk, e, generator=g, dtype=dtype)
    v = torch.randn(b, hk or h, lk, e, generator=g, dtype=dtype)
    return q, k, v


ATTN_CASES = [
    ("plain", {}, {}),
    ("causal_square", {"lk": 13}, {"is_causal": True}),
    ("causal_rect", {"lq": 9, "lk": 15}, {"is_causal": True}),
    ("bool_mask", {}, {"attn_mask": "bool"}),
    ("float_mask_bcast", {}, {"attn_mask": "float_row"}),
    ("scale", {}, {"scale": 0.3}),
    ("gqa", {"h": 4, "hk": 2}, {"enable_gqa": True}),
]


def _make_kwargs(kw, lq, lk):
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        m = torch.rand(lq, lk, generator=torch.Generator().manual_seed(1)) > 0.3
        m[:, 0] = True
        kw["attn_mask"] = m
    elif kw.get("attn_mask") == "float_row":
        kw["attn_mask"] = torch.randn(2, 1, 1, lk)
    return kw


@pytest.mark.parametrize("case,shape,kw", ATTN_CASES, ids=[c[0] for c in ATTN_CASES])
def test_attention_implementations_match(case, shape, kw):
    q0, k0, v0 = _qkv(**shape)
    kw = _make_kwargs(kw, q0.size(-2), k0.size(-2))
    ref_in = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    ref = SDPA(*ref_in, **kw)
    g = torch.randn_like(ref)
    ref_g = grads_of(ref, ref_in, g)
    found = impls("call_function", SDPA, (q0, k0, v0), kw)
    assert {"default", "math", "query_chunked"} <= set(found)
    for impl in found.values():
        ins = [t.clone().requires_grad_() for t in (q0, k0, v0)]
        y = run(impl, SDPA, ins, kw)
        torch.testing.assert_close(y, ref, rtol=RTOL, atol=1e-5)
        assert_close_all(grads_of(y, ins, g), ref_g, rtol=RTOL, atol=1e-5)


@pytest.mark.parametrize("gqa", [False, True])
def test_attention_outputs_keep_the_default_layout(gqa):
    """Queries that are a transposed (B, S, H, D) projection give torch's attention an output whose
    transpose back is contiguous; every implementation must return the same strides, or a model's
    `.transpose(1, 2).contiguous()` copies where the profile (taken with the default) saw a view."""
    hk = 2 if gqa else 4
    q = torch.randn(2, 12, 4, 8).transpose(1, 2)
    k, v = (torch.randn(2, 12, hk, 8).transpose(1, 2) for _ in range(2))
    kw = {"is_causal": True, "enable_gqa": gqa}
    ref = SDPA(q, k, v, **kw)
    assert ref.transpose(1, 2).is_contiguous()  # torch's own layout, which the others must follow
    for name, impl in impls("call_function", SDPA, (q, k, v), kw).items():
        y = run(impl, SDPA, [t.clone().requires_grad_() for t in (q, k, v)], kw)
        assert y.stride() == ref.stride(), (name, y.stride(), ref.stride())


def test_attention_chunked_gradcheck():
    q, k, v = (t.double().requires_grad_() for t in _qkv(b=1, h=2, lq=7, lk=7, e=4))
    assert torch.autograd.gradcheck(
        lambda q, k, v: query_chunked_attention(q, k, v, is_causal=True), (q, k, v)
    )
    m = torch.randn(7, 7, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: query_chunked_attention(q, k, v, attn_mask=m), (q, k, v))


def test_attention_dropout_only_default():
    q, k, v = _qkv()
    assert list(impls("call_function", SDPA, (q, k, v), {"dropout_p": 0.1})) == ["default"]
    m = torch.randn(13, 11, requires_grad=True)
    assert list(impls("call_function", SDPA, (q, k, v, m))) == ["default"]


def test_attention_math_keeps_matrix_chunked_does_not():
    b, h, L, e = 2, 4, 256, 16
    q0, k0, v0 = _qkv(b, h, L, L, e)
    found = impls("call_function", SDPA, (q0, k0, v0))
    ins = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    qkv_bytes = 3 * q0.numel() * 4
    attn_bytes = b * h * L * L * 4
    m, _ = saved_bytes(lambda: run(found["math"], SDPA, ins))
    c, _ = saved_bytes(lambda: run(found["query_chunked"], SDPA, ins))
    assert m >= attn_bytes  # the softmax matrix is kept
    assert c == qkv_bytes  # only q, k, v
    assert c < m / 4


def _allocation_peak(fn) -> int:
    """Peak bytes allocated while fn runs, above what lived before (profiler memory events)."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
    ) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda ev: ev.start_ns(),
    )
    cur = top = 0
    for ev in events:
        cur += ev.nbytes()
        top = max(top, cur)
    return top


def test_attention_chunked_backward_peak_lower_than_math():
    """Peak allocation during forward+backward (profiler memory events) is lower with chunking."""
    b, h, L, e = 1, 4, 512, 16
    q0, k0, v0 = _qkv(b, h, L, L, e)
    found = impls("call_function", SDPA, (q0, k0, v0))

    def peak(impl):
        ins = [t.clone().requires_grad_() for t in (q0, k0, v0)]

        def step():
            y = run(impl, SDPA, ins)
            y.backward(torch.ones_like(y))

        return _allocation_peak(step)

    attn = b * h * L * L * 4
    pm, pc = peak(found["math"]), peak(found["query_chunked"])
    assert pm > attn
    assert pc < pm / 2


# ----------------------------------------------------------------------------- dropout


DROPOUT_TARGETS = [
    ("call_module", nn.Dropout(0.3), ()),
    ("call_module", nn.Dropout(0.3, inplace=True), ()),
    ("call_function", F.dropout, (0.3, True)),
    ("call_function", F.dropout, (0.3, True, True)),
]


@pytest.mark.parametrize(
    "op,target,extra", DROPOUT_TARGETS, ids=[str(i) for i in range(len(DROPOUT_TARGETS))]
)
def test_dropout_implementations_match(op, target, extra):
    x0 = torch.randn(4, 5, 33)
    torch.manual_seed(123)
    xr = x0.clone().requires_grad_()
    ref = F.dropout(xr, 0.3, True)
    g = torch.randn_like(ref)
    (ref_g,) = grads_of(ref, [xr], g)
    found = impls(op, target)
    assert set(found) == {"default", "mask_bitmask"}
    for impl in found.values():
        xi = x0.clone().requires_grad_()
        torch.manual_seed(123)
        y = run(impl, target, (xi,) + extra)
        assert torch.equal(xi, x0)
        assert torch.equal(y, ref), impl.name
        (gi,) = grads_of(y, [xi], g)
        assert torch.equal(gi, ref_g)


def test_dropout_bitmask_saves_one_thirtysecond_and_eval():
    x = torch.randn(16, 1024, requires_grad=True)
    found = impls("call_module", nn.Dropout(0.1))
    d, _ = saved_bytes(lambda: run(found["default"], nn.Dropout(0.1), (x,)))
    b, _ = saved_bytes(lambda: run(found["mask_bitmask"], nn.Dropout(0.1), (x,)))
    assert d == x.numel() * 4  # CPU: the float scaled noise
    assert b * 32 == d
    assert torch.equal(dropout_bitmask(x, 0.5, training=False), x)
    ev = nn.Dropout(0.5).eval()
    assert torch.equal(run(found["mask_bitmask"], ev, (x,)), x)


def test_dropout_bitmask_gradcheck():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)

    def f(t):
        torch.manual_seed(0)
        return dropout_bitmask(t, 0.4)

    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention_module(causal):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True)
    x0 = torch.randn(2, 24, 16)
    kw = {"need_weights": False}
    if causal:
        kw.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(24), is_causal=True)
    found = impls("call_module", mha)
    assert list(found) == ["default", "math", "query_chunked"]
    params = list(mha.parameters())
    outs, kept = {}, {}
    for name, impl in found.items():
        x = x0.clone().requires_grad_()
        kept[name], y = saved_bytes(lambda impl=impl, x=x: run(impl, mha, (x, x, x), kw)[0], params)
        g = torch.ones_like(y)
        outs[name] = (y, grads_of(y, [x] + params, g))
    for name in ("math", "query_chunked"):
        torch.testing.assert_close(outs[name][0], outs["default"][0], rtol=RTOL, atol=1e-5)
        assert_close_all(outs[name][1], outs["default"][1], rtol=1e-4, atol=1e-5)
    assert F.scaled_dot_product_attention is SDPA  # swapped back
    assert kept["query_chunked"] < kept["math"]
    assert list(impls("call_module", nn.MultiheadAttention(16, 4, dropout=0.1))) == ["default"]


@pytest.mark.parametrize("name", ["default", "output_activated"])
def test_batchnorm_recompute_then_backward(name):
    """The recomputed node's backward must run (nothing it saved is modified in place afterwards)
    and give the first computation's gradients."""
    ref, mine = _bn_pair()
    impl = impls("call_module", mine)[name]
    x0 = torch.randn(4, 4, 5, 5)
    x1 = x0.clone().requires_grad_()
    y1 = run(impl, mine, (x1,))
    g = torch.randn_like(y1)
    g1 = grads_of(y1, [x1, mine.weight, mine.bias], g)
    state = _bn_state(mine)
    x2 = x0.clone().requires_grad_()
    y2 = run(impl, mine, (x2,), recompute=True)
    g2 = grads_of(y2, [x2, mine.weight, mine.bias], g)
    assert torch.equal(y1, y2)
    assert_close_all(g2, g1, rtol=0, atol=0)
    for k, v in mine.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("name", ["default", "output_activated", "inplace_grad"])
@pytest.mark.parametrize("cls,shape,kw", BN_CONFIGS, ids=[f"{c.__name__}-{k}" for c, _, k in BN_CONFIGS])
def test_batchnorm_replay_from_memo_is_bitwise(name, cls, shape, kw):
    """Given a memo, the first computation leaves its batch statistics there and a recomputation
    is one affine pass with them: the module's output bitwise, the first computation's gradients
    bitwise, running statistics and counter untouched by the recomputation."""
    from monet_opt.ops.norm import replay_is_exact

    assert replay_is_exact(torch.device("cpu"), torch.float32)  # the probe holds on this CPU
    ref, mine = _bn_pair(cls, **kw)
    impl = impls("call_module", mine)[name]
    assert impl.replays
    x0 = torch.randn(*shape) * 2 + 0.5
    params_ref, params_mine = list(ref.parameters()), list(mine.parameters())
    xr = x0.clone().requires_grad_()
    yr = ref(xr)
    g = torch.randn_like(yr)
    gr = grads_of(yr, [xr] + params_ref, g)
    memo: dict = {}
    x1 = x0.clone().requires_grad_()
    y1 = impl.run(mine, (x1,), {}, False, memo=memo)
    # (the module's own op needs a weight to record autograd: non-affine defaults run in full)
    assert ("stats" in memo) == (name != "default" or mine.affine)
    state = _bn_state(mine)
    for k, v in ref.state_dict().items():
        assert torch.equal(state[k], v), k
    x2 = x0.clone().requires_grad_()
    y2 = impl.run(mine, (x2,), {}, True, memo=memo)
    assert torch.equal(y1, yr) and torch.equal(y2, yr)
    g1 = grads_of(y1, [x1] + params_mine, g)
    g2 = grads_of(y2, [x2] + params_mine, g)
    assert_close_all(g2, g1, rtol=0, atol=0)  # the replay's backward is the first computation's
    if name == "default":
        assert_close_all(g1, gr, rtol=0, atol=0)  # (the custom backwards: float rounding, tested above)
    for k, v in mine.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_batchnorm_replay_off_where_not_exact(monkeypatch):
    """Where the affine replay would not be bitwise the kernel's, a recomputation given a memo
    runs the full batch norm (statistics again), and the profiler records no recompute time."""
    from monet_opt.ops import norm

    monkeypatch.setitem(norm._EXACT, ("cpu", torch.float32), False)
    ref, mine = _bn_pair()
    impl = impls("call_module", mine)["default"]
    x = torch.randn(4, 4, 5, 5)
    memo: dict = {}
    y1 = impl.run(mine, (x,), {}, False, memo=memo)
    assert memo == {}
    calls = []
    monkeypatch.setattr(norm, "_affine", lambda *a: calls.append(a))
    y2 = impl.run(mine, (x,), {}, True, memo=memo)
    assert torch.equal(y1, y2) and torch.equal(y1, ref(x)) and not calls


# ----------------------------------------------------------------------------- in-place gradients

INPLACE_GRAD_CASES = [
    (nn.ReLU(), "bitmask"),
    (nn.ReLU(), "inplace_grad"),
    (nn.ReLU(), "input_activated"),
    (nn.ReLU6(), "bitmask"),
    (nn.BatchNorm2d(8), "output_activated"),
    (nn.BatchNorm2d(8), "inplace_grad"),
]


@pytest.mark.parametrize(
    "target,name", INPLACE_GRAD_CASES, ids=[f"{type(t).__name__}-{n}" for t, n in INPLACE_GRAD_CASES]
)
def test_inplace_grad_writes_into_the_output_gradient(target, name):
    """The input gradient is the very buffer the output gradient came in (no new allocation),
    with the same values as the default implementation's."""
    impl = impls("call_module", target)[name]
    assert impl.grad_in_place
    x0 = torch.randn(16, 8, 6, 6) * 2 + 0.3
    g = torch.randn(16, 8, 6, 6)
    xd = x0.clone().requires_grad_()
    (expected,) = grads_of(run(impls("call_module", target)["default"], target, (xd,)), [xd], g.clone())
    xi = x0.clone().requires_grad_()
    fed = g.clone()
    (got,) = torch.autograd.grad(run(impl, target, (xi,)), [xi], fed)
    assert got.data_ptr() == fed.data_ptr()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _backward_peak(impl, target, x0, g0):
    """Peak bytes allocated by one backward (profiler memory events), above what lived before it."""
    x = x0.clone().requires_grad_()
    y = run(impl, target, (x,))
    g = g0.clone()
    return _allocation_peak(lambda: torch.autograd.grad(y, [x], g))


@pytest.mark.parametrize("target", [nn.ReLU(), nn.BatchNorm2d(16)], ids=["relu", "batchnorm"])
def test_inplace_grad_backward_allocates_a_fraction_of_the_default(target):
    x0 = torch.randn(16, 16, 32, 32)
    g0 = torch.randn_like(x0)
    act = x0.numel() * 4
    found = impls("call_module", target)
    default = _backward_peak(found["default"], target, x0, g0)
    assert default >= act  # at least the new input gradient
    for name, impl in found.items():
        if impl.grad_in_place:
            peak = _backward_peak(impl, target, x0, g0)
            assert peak <= act // 4, f"{name}: {peak} bytes vs an activation of {act}"
