"""monet_opt.graph: tracing, per-node facts, fingerprints, trace errors."""

from __future__ import annotations

import math
import operator
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from monet_opt.graph import OpGraph, TraceError, trace

sys.path.insert(0, str(Path(__file__).parent))
import models as M  # noqa: E402

# OpNode counts must stay in these ranges (measured: resnet18 69, resnet50 175,
# vgg11 30, googlenet 197, mobilenet_v2 153, vit_b_16 232, gpt 73).
NODE_RANGES = {
    "resnet18": (60, 80),
    "resnet50": (150, 200),
    "vgg11": (25, 40),
    "googlenet": (170, 230),
    "mobilenet_v2": (130, 180),
    "vit_b_16": (180, 300),
    "gpt": (50, 100),
}


@pytest.fixture(scope="module", params=sorted(M.ALL))
def traced(request):
    name = request.param
    model, x = M.ALL[name]()
    model.train()
    g = trace(model, x)
    return name, model, x, g


def _flatten_meta(meta) -> list[tuple[int, ...]]:
    if meta is None:
        return []
    if isinstance(meta, TensorMetadata):
        return [tuple(meta.shape)]
    if isinstance(meta, (list, tuple)):
        return [s for m in meta for s in _flatten_meta(m)]
    if isinstance(meta, dict):
        return [s for m in meta.values() for s in _flatten_meta(m)]
    return []


def _outputs(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _outputs(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _outputs(o)]
    return []


def test_traced_output_equals_eager(traced):
    name, model, x, g = traced
    assert isinstance(g, OpGraph)
    torch.manual_seed(123)
    with torch.no_grad():
        expected = model(x)
    torch.manual_seed(123)
    with torch.no_grad():
        got = g.gm(x)
    for a, b in zip(_outputs(got), _outputs(expected), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_node_counts_and_structure(traced):
    name, model, x, g = traced
    lo, hi = NODE_RANGES[name]
    assert lo <= len(g.nodes) <= hi, f"{name}: {len(g.nodes)} nodes"
    names = [n.name for n in g.nodes]
    assert len(set(names)) == len(names)
    pos = {n: i for i, n in enumerate(names)}
    for n in g.nodes:
        assert n.op in ("call_module", "call_function", "call_method")
        assert n.kind == n.kind.lower() and n.kind
        for inp in n.inputs:
            assert pos[inp] < pos[n.name], "topological order"
        if n.alias_of is not None:
            assert 0 <= n.alias_of < len(n.inputs)
            assert n.output_bytes == 0
        assert g.node(n.name) is n
    assert set(g.graph.nodes) == set(names)
    assert all(g.graph.has_edge(i, n.name) for n in g.nodes for i in n.inputs)
    assert g.output_names and all(g.node(o).is_output for o in g.output_names)
    assert any(n.uses_model_input for n in g.nodes)
    assert g.input_shapes == [tuple(x.shape)]


def test_kinds(traced):
    name, model, x, g = traced
    kinds = {n.kind for n in g.nodes}
    expected = {
        "resnet18": {
            "conv2d",
            "batchnorm2d",
            "relu",
            "maxpool2d",
            "add",
            "adaptiveavgpool2d",
            "flatten",
            "linear",
        },
        "resnet50": {"conv2d", "batchnorm2d", "relu", "add", "flatten", "linear"},
        "vgg11": {"conv2d", "relu", "maxpool2d", "dropout", "linear", "flatten"},
        "googlenet": {"conv2d", "batchnorm2d", "cat", "maxpool2d", "dropout"},
        "mobilenet_v2": {"conv2d", "batchnorm2d", "relu6", "add"},
        "vit_b_16": {"conv2d", "layernorm", "linear", "multiheadattention", "gelu", "getitem"},
        "gpt": {
            "embedding",
            "layernorm",
            "linear",
            "gelu",
            "dropout",
            "scaled_dot_product_attention",
            "view",
            "transpose",
            "split",
            "getitem",
            "size",
            "add",
        },
    }[name]
    assert expected <= kinds, expected - kinds


def test_shapes_match_shapeprop(traced):
    name, model, x, g = traced
    ours = {n.name: _flatten_meta(n.meta.get("tensor_meta")) for n in g.gm.graph.nodes}
    torch.manual_seed(0)
    ShapeProp(g.gm).propagate(x)
    by_name = {n.name: n for n in g.gm.graph.nodes}
    for n in g.nodes:
        ref = _flatten_meta(by_name[n.name].meta.get("tensor_meta"))
        assert n.shapes == ref, n.name
        assert ours[n.name] == ref, n.name  # trace() leaves ShapeProp-style meta on the gm
        assert len(n.dtypes) == len(n.shapes)
        assert n.is_tensor == bool(n.shapes)


def _eager_saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    storages: dict[int, int] = {}
    keep = []

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() and st.data_ptr() not in excluded:
            storages[st.data_ptr()] = st.nbytes()
        keep.append(t)
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    del out
    return sum(storages.values())


def test_saved_bytes_agree_with_eager(traced):
    name, model, x, g = traced
    union: dict[int, int] = {}  # storage id -> bytes, attributed to the first node saving it
    for n in g.nodes:
        assert n.saved_bytes == sum(s.nbytes for s in n.saved_storages)
        for s in n.saved_storages:
            union.setdefault(s.storage_id, s.nbytes)
            assert s.kind in ("input", "output", "private", "model_input", "other")
            if s.kind == "input":
                assert 0 <= s.position < len(n.inputs)
    ours = sum(union.values())
    assert ours == g.total_saved_bytes
    eager = _eager_saved_bytes(model, x)
    assert eager > 0
    assert abs(ours - eager) <= 0.05 * eager, (ours, eager)


def test_param_and_grad_bytes(traced):
    name, model, x, g = traced
    total_params = sum(p.numel() * p.element_size() for p in model.parameters())
    names = [pn for n in g.nodes for pn in n.param_names]
    assert len(names) == len(set(names))
    counted = set(names)
    assert (
        sum(p.numel() * p.element_size() for pn, p in model.named_parameters() if pn in counted)
        == total_params
    )
    assert any(n.grad_bytes > 0 for n in g.nodes)
    for n in g.nodes:
        if n.requires_grad:
            assert n.grad_bytes > 0


def test_resnet_details():
    model, x = M.resnet18()
    g = trace(model, x)
    conv = g.node("conv1")
    assert conv.kind == "conv2d" and conv.uses_model_input and conv.inputs == []
    assert conv.param_names == ["conv1.weight"]
    assert conv.output_bytes == 2 * 64 * 32 * 32 * 4
    assert conv.shapes == [(2, 64, 32, 32)]
    # torchvision's ReLU is in-place: a view of its input that mutates it
    relu = g.node("relu")
    assert relu.alias_of == 0 and relu.output_bytes == 0 and relu.mutated_inputs == [0]
    assert relu.keeps_output is False and relu.keeps_inputs == (0,)
    bn = g.node("bn1")
    assert bn.kind == "batchnorm2d" and bn.keeps_inputs == (0,) and bn.saved_private_bytes > 0
    assert g.node("fc").is_output and g.output_names == ["fc"]
    flat = g.node("flatten")
    assert flat.target == "torch.flatten" and flat.alias_of == 0


def test_gpt_details():
    model, idx = M.gpt()
    g = trace(model, idx)
    sdpa = [n for n in g.nodes if n.kind == "scaled_dot_product_attention"]
    assert len(sdpa) == 2
    assert sdpa[0].target.endswith("scaled_dot_product_attention")
    assert len(sdpa[0].inputs) == 3 and sdpa[0].saved_bytes > 0
    split = next(n for n in g.nodes if n.kind == "split")
    assert split.alias_of == 0 and split.output_bytes == 0 and len(split.shapes) == 3
    size = next(n for n in g.nodes if n.kind == "size")
    assert not size.is_tensor and size.output_bytes == 0 and size.shapes == []
    wte = g.node("wte")
    assert wte.uses_model_input and [s.kind for s in wte.saved_storages] == ["model_input"]


def test_fingerprint_changes_and_is_stable():
    model, x = M.resnet18()
    g1 = trace(model, x)
    g2 = trace(model, x)
    assert g1.fingerprint == g2.fingerprint and len(g1.fingerprint) == 64
    # parameter values do not matter
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    assert trace(model, x).fingerprint == g1.fingerprint
    assert trace(model, torch.randn(4, 3, 64, 64)).fingerprint != g1.fingerprint
    assert trace(model, torch.randn(2, 3, 32, 32)).fingerprint != g1.fingerprint
    other, _ = M.resnet50()
    assert trace(other, x).fingerprint != g1.fingerprint
    small = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    wide = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    xi = torch.randn(2, 8)
    assert trace(small, xi).fingerprint != trace(wide, xi).fingerprint


def test_fingerprint_stable_across_processes():
    model, x = M.resnet18()
    here = trace(model, x).fingerprint
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); import models as M; "
        "from monet_opt.graph import trace; m, x = M.resnet18(); print(trace(m, x).fingerprint)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == here


def test_transformer_encoder_layer_is_a_leaf_in_eval_and_traced_through_in_training():
    model, x = M.with_encoder_layer()
    model.eval()  # eval: the layer's fast path is live, fx could not trace into it
    g = trace(model, x)
    enc = g.node("enc")
    assert enc.op == "call_module" and enc.kind == "transformerencoderlayer"
    assert [n.kind for n in g.nodes] == ["linear", "relu", "transformerencoderlayer", "linear"]
    with torch.no_grad():
        torch.testing.assert_close(g.gm(x), model(x))
    model.train()  # (graph.TRACED_IN_TRAINING: the solver gets its layers to choose from)
    g = trace(model, x)
    assert "transformerencoderlayer" not in [n.kind for n in g.nodes]
    assert [n.kind for n in g.nodes if n.op == "call_module"] == [
        "linear",
        "multiheadattention",
        "dropout",
        "layernorm",
        "linear",
        "dropout",
        "linear",
        "dropout",
        "layernorm",
        "linear",
    ]
    assert trace(model, x, leaf_modules=[nn.TransformerEncoderLayer]).node("enc").saved_bytes > 0


def test_torch_nn_root_becomes_one_node():
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True).eval()
    x = torch.randn(2, 5, 32)
    g = trace(layer, x)
    assert [n.kind for n in g.nodes] == ["transformerencoderlayer"]
    assert g.nodes[0].is_output and g.nodes[0].uses_model_input


def test_untraceable_submodule_becomes_leaf():
    model = M.WithGate()
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = trace(model, x)
    assert "gate" in g.leaf_paths
    assert g.node("gate").op == "call_module"
    assert any("'gate'" in str(w.message) for w in caught)
    with torch.no_grad():
        torch.testing.assert_close(g.gm(x), model(x))
    with pytest.raises(TraceError, match="gate"):
        trace(model, x, leaf_fallback=False)


def test_a_root_assigning_what_it_computes_is_named_and_left_as_it_was():
    """fx records no attribute assignment: a root that keeps what it computes (`self.last = y`)
    cannot be one node (nothing would be left to schedule): a TraceError names it, and no fx
    Proxy is left on the model (before, one was, and the model failed later, far from it)."""

    class KeepsLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.last = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = self.lin(x)
            return self.last.relu()

    model = KeepsLast()
    with pytest.raises(TraceError, match=r"assignment to last in its forward .* submodule of its own"):
        trace(model, torch.randn(2, 4))
    assert model.last is None


def test_data_dependent_control_flow_raises_trace_error():
    model = M.DataDependent()
    with pytest.raises(TraceError) as info:
        trace(model, torch.randn(2, 8))
    msg = str(info.value)
    assert "DataDependent" in msg and "control flow" in msg and "h.sum() > 0" in msg
    assert "Fix" in msg
    assert info.value.module_path == ""
    assert info.value.__cause__ is not None  # the original fx error is chained


def test_default_args_are_bound_not_traced():
    class WithMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask=None):
            y = self.lin(x)
            if mask is not None:
                y = y * mask
            return y

    model = WithMask()
    x = torch.randn(2, 4)
    g = trace(model, x)
    assert [n.kind for n in g.nodes] == ["linear"]


def test_model_state_is_restored():
    model, x = M.resnet18()
    before = {k: b.clone() for k, b in model.named_buffers()}
    rng = torch.get_rng_state()
    trace(model, x)
    for k, b in model.named_buffers():
        assert torch.equal(b, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


def test_multiple_inputs_and_tuple_outputs():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 6)
            self.pool = nn.MaxPool1d(2, return_indices=True)

        def forward(self, x, y):
            h = self.a(x) + y
            out, idx = self.pool(h.unsqueeze(1))
            return out, idx

    model = Two()
    x, y = torch.randn(2, 4), torch.randn(2, 6)
    g = trace(model, (x, y))
    assert g.input_shapes == [(2, 4), (2, 6)]
    pool = g.node("pool")
    assert len(pool.shapes) == 2 and pool.dtypes == ["torch.float32", "torch.int64"]
    assert pool.output_bytes == 2 * 3 * 4 + 2 * 3 * 8
    getitems = [n for n in g.nodes if n.kind == "getitem"]
    assert all(n.alias_of == 0 for n in getitems)
    assert set(g.output_names) == {n.name for n in getitems}


def test_bad_inputs():
    with pytest.raises(TypeError):
        trace(nn.Linear(2, 2), [[1, 2]])
    with pytest.raises(TypeError):
        trace(lambda x: x, torch.randn(2))


@torch.fx.wrap
def _fails_when_run(x):
    raise RuntimeError("kernel exploded")


def test_graph_run_failure_names_the_node():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return _fails_when_run(self.lin(x))

    with pytest.raises(TraceError, match="_fails_when_run") as info:
        trace(Boom(), torch.randn(2, 4))
    assert info.value.node == "_fails_when_run"
    assert "kernel exploded" in str(info.value)


def test_traced_graph_that_differs_from_eager_is_refused():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1  # Python state: fx bakes in the value seen while tracing
            return x * self.calls

    with pytest.raises(TraceError, match="differs from the eager model"):
        trace(Counter(), torch.randn(2, 4))
    g = trace(Counter(), torch.randn(2, 4), check=False)
    assert [n.kind for n in g.nodes] == ["mul"]


class _Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.block(x))


def test_a_submodule_with_hooks_stays_whole_and_its_hooks_see_the_training_values():
    """Traced through, a submodule's hooks ran once on fx's proxies and never in training: a
    forward hook collecting features collected a Proxy. Kept whole (with a warning naming it),
    its forward hook sees the wrapped step's values and its backward hook fires."""
    import copy

    import solver
    from monet_opt.bench import loss_of
    from monet_opt.profile import build_problem
    from monet_opt.runtime import MonetWrapper

    torch.manual_seed(0)
    model, x = _Hooked(), torch.randn(64, 32)
    seen: list = []
    model.block.register_forward_hook(lambda m, i, out: seen.append(out.detach().clone()))
    model.head.register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
    plain = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"1 submodules with hooks are kept as one node.*\(block\)"):
        problem = build_problem(model, (x,), progress=False, repeats=1)
    assert [n.name for n in problem.nodes] == ["block", "head"]
    assert all(isinstance(v, (str, torch.Tensor)) for v in seen)  # (no Proxy left in the user's list)
    with pytest.warns(UserWarning, match="hooks"):
        wrapped = MonetWrapper(model, solver.baselines.no_recompute(problem), example_inputs=(x,))
    seen.clear()
    loss_of(wrapped(x)).backward()
    assert len(seen) == 2 and seen[1] == "backward", seen
    plain_seen = []
    plain.block._forward_hooks.clear()
    plain.block.register_forward_hook(lambda m, i, out: plain_seen.append(out.detach()))
    loss_of(plain(x)).backward()
    torch.testing.assert_close(seen[0], plain_seen[0])
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def _clamped_window(y: torch.Tensor, window: list) -> list:
    """Changes the list it is given, as torchvision's video Swin `_get_window_and_shift_size`."""
    for i in range(2):
        if y.shape[2 + i] < window[i]:
            window[i] = y.shape[2 + i]
    return window


torch.fx.wrap("_clamped_window")


class _ListChanging(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        window = _clamped_window(y, [16, 4])
        return torch.nn.functional.avg_pool2d(y, window)


def test_a_function_that_changes_a_list_argument_runs():
    """fx hands a node's list arguments over as immutable lists; a model's function changing
    one failed ("'immutable_list' object does not support mutation": torchvision's swin3d_t).
    They are plain lists now, at trace and in the runtime: plain gradients."""
    from monet_opt.profile import build_problem
    from monet_opt.runtime import MonetWrapper
    from solver import baselines
    from tests.test_runtime import assert_same_gradients

    torch.manual_seed(0)
    model, x = _ListChanging(), torch.randn(2, 3, 8, 8)
    graph = trace(model, (x,))
    assert any(n.target is _clamped_window for n in graph.gm.graph.nodes)
    problem = build_problem(model, (x,), progress=False, repeats=1)
    wrapped = MonetWrapper(model, baselines.checkpoint_all(problem), example_inputs=(x,))
    assert_same_gradients(model, wrapped, x, "list-changing function")


class _WithCompiledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.block = torch.compile(nn.Sequential(nn.Linear(32, 32), nn.GELU()), backend="eager")
        self.c = nn.Linear(32, 8)

    def forward(self, x):
        y = torch.relu(self.a(x))
        if y.shape[0] > 4:  # (shape-dependent Python: traced with concrete values)
            y = y * 0.5
        return self.c(self.block(y))


def test_a_compiled_submodule_is_one_node():
    """A submodule the user compiled (torch.compile) refused fx ('Detected that you are using FX
    to symbolically trace a dynamo-optimized function'), and computing its value for the
    concrete trace failed the same way: it is one node now, run compiled; plain gradients."""
    from monet_opt.profile import build_problem
    from monet_opt.runtime import MonetWrapper
    from solver import baselines
    from tests.test_runtime import assert_same_gradients

    torch.manual_seed(0)
    model, x = _WithCompiledBlock(), torch.randn(16, 32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        graph = trace(model, (x,))
    assert not [w for w in seen if "cannot be traced" in str(w.message)]  # (a known leaf, no fallback)
    assert [n.name for n in graph.nodes if n.name == "block"] == ["block"]
    problem = build_problem(model, (x,), progress=False, repeats=1)
    wrapped = MonetWrapper(model, baselines.checkpoint_all(problem), example_inputs=(x,))
    assert_same_gradients(model, wrapped, x, "compiled block")


class _ScaledGradient(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)

    def forward(self, x):
        y = torch.tanh(self.a(x))
        y.register_hook(lambda g: -0.5 * g)
        return y


def test_a_gradient_hook_registered_in_the_forward_is_named():
    """`y.register_hook(fn)` in a traced forward: the error named the wrong cause (a forward
    taking **kwargs); it names the hook and the fixes now."""
    with pytest.raises(
        TraceError, match=r"gradient hook registered inside the forward .* torch.autograd.Function"
    ):
        trace(_ScaledGradient(), (torch.randn(16, 32),))


class _OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        return torch.tanh(self.a(x)) + 0.1 * torch.randn(x.shape, generator=self.gen)


def test_a_private_random_generator_is_named():
    """Noise from a torch.Generator the model keeps: the traced run and the eager one differ
    (its state moves on) and a recomputation would draw other numbers; the error names it."""
    with pytest.raises(
        TraceError, match=r"differs from the eager model .* torch.Generator of its own \(_OwnGenerator\)"
    ):
        trace(_OwnGenerator(), (torch.randn(4, 16),))


class _Experts(nn.Module):
    """Top-2 routing over 4 experts, skipping an expert no token chose (Python reads the size of
    `torch.where`'s output)."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.router = nn.Linear(d, 4)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d)) for _ in range(4)
        )

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        weight, chosen = self.router(h).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(h[rows]) * weight[rows, slot, None])
        return out.view(x.shape)


class _MixtureOfExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.moe = _Experts()
        self.head = nn.Linear(32, 64)

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.moe(x))


def _route_to_first_two(model: _MixtureOfExperts, on: bool) -> None:
    with torch.no_grad():
        model.moe.router.bias.copy_(torch.tensor([50.0, 40.0, 0.0, 0.0]) if on else torch.zeros(4))


def test_a_size_that_depends_on_the_data_is_not_fixed_by_the_trace(monkeypatch, tmp_path):
    """Python reading the size of `torch.where(mask)`'s output got the example's number: traced
    while the router sent every token to experts 0 and 1, the graph skipped experts 2 and 3 for
    good, and on other data the outputs and gradients were wrong, silently. Such a read now
    makes its submodule a leaf (named in a warning), which runs as the model does on any data."""
    from monet_opt.profile import build_problem
    from monet_opt.runtime import MonetWrapper
    from solver import baselines
    from tests.test_runtime import assert_same_gradients

    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    model, ids = _MixtureOfExperts().train(), torch.randint(0, 64, (4, 16))
    _route_to_first_two(model, True)
    with pytest.warns(UserWarning, match=r"'moe' \(_Experts\).*DataDependentSize.*\(\.numel\(\)\)"):
        g = trace(model, (ids,))
    assert g.leaf_paths == ["moe"]
    problem = build_problem(model, (ids,), progress=False, repeats=1)
    wrapped = MonetWrapper(model, baselines.checkpoint_all(problem), example_inputs=(ids,))
    _route_to_first_two(model, False)
    assert_same_gradients(model, wrapped, ids, "experts 2 and 3 chosen after the trace")


class _MaskedMean(nn.Module):
    """A boolean mask selects rows; nothing in Python reads how many (math.sqrt of a shape:
    plain fx stops, the concrete trace runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.a(x)) / math.sqrt(x.shape[-1])
        picked = h[h[:, 0] > 0]
        return self.b(picked).mean(0) + self.b(h).mean(0)


def test_a_data_sized_value_no_python_reads_stays_in_the_graph():
    """Sizes only the ops see (a boolean mask, then a mean) need no leaf: the graph computes
    any size, and other data gives the eager model's output."""
    torch.manual_seed(0)
    model = _MaskedMean()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        g = trace(model, (torch.randn(64, 16),))
    assert g.leaf_paths == []
    masks = [n.name for n in g.gm.graph.nodes if n.op == "call_function" and n.target is operator.getitem]
    assert g.data_sized == masks[-1:], (g.data_sized, masks)  # (h[:, 0] is not; h[mask] is)
    other = torch.randn(64, 16) * 3
    with torch.no_grad():
        torch.testing.assert_close(g.gm(other), model(other))


def test_a_problem_with_data_sized_nodes_says_its_memory_is_the_examples(monkeypatch, tmp_path):
    """Their memory follows the data (a mixture of experts' routing): build_problem names them
    in a warning and in its metadata."""
    from monet_opt.profile import build_problem

    monkeypatch.setenv("MONET_OPT_CACHE", str(tmp_path))
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match=r"node\(s\) getitem_2 .*holds for this example batch"):
        problem = build_problem(_MaskedMean(), (torch.randn(64, 16),), progress=False, repeats=1)
    assert problem.meta["data_sized_nodes"] == ["getitem_2"]


def test_a_data_dependent_size_read_in_the_root_forward_is_named():
    class RootReads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            picked = h[h[:, 0] > 0]
            return picked.sum() if len(picked) > 0 else h.sum()

    with pytest.raises(
        TraceError, match=r"size of 'getitem.*' \(len\(\)\), which depends on the input's values"
    ):
        trace(RootReads(), (torch.randn(16, 8),))
