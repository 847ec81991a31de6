"""Measure every implementation of every node on this device, and build a solver Problem.

For each node and each of its implementations we run the node alone, on the
values it sees in a real forward pass, the way the runtime runs it (inputs
detached, its own local autograd graph), and measure:

* forward and backward time: median of `repeats` runs after a warm-up;
* what its backward keeps: saved-tensor hooks classify each saved storage as
  one of the node's inputs, its output, or private state (bytes);
* forward / backward workspace: `measure_peak` of one call, minus what the call
  leaves behind (output, private state; input and parameter gradients).

Results are cached on disk by device, torch version, op signature and shapes
(`~/.cache/monet-opt/`, or `$MONET_OPT_CACHE`), so a second run is near-instant.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from monet_opt import autocast_regions, input_layout, module_state
from monet_opt.graph import OpGraph, trace
from monet_opt.keyword_inputs import KeywordRoot, StructuredRoot, as_traceable, grad_output_positions
from monet_opt.memory import mark, measure_peak, segment_peaks, track_peak
from monet_opt.ops import implementations_for, shares_gradient
from monet_opt.ops.base import Implementation
from monet_opt.restore import CONSUMER_IMPL, restore_name
from monet_opt.runtime.deferred import deferrable, workspace_bytes
from monet_opt.runtime.executor import (
    _fetch_attr,
    _GradBox,
    _node_params,
    _resolve_target,
    _reuse_kind,
    _Root,
    _same_rng,
    _save_rng,
    reuse_arguments_allow,
)
from monet_opt.step_in_backward import (
    FINGERPRINT_SUFFIX,
    optimizer_factory,
    step_bytes,
    step_bytes_per_param_byte,
    steps_by_chunks,
)
from monet_opt.storage import spans_storage, storage_key
from monet_opt.train_modes import restore_training_modes, training_for_profile
from solver.jsonio import atomic_write_text
from solver.problem import Impl, Node, Problem, Restore, storage_bytes

RUNTIME_RESERVE_BYTES = 64 * 1024
CACHE_VERSION = 26  # 2: backward workspace net of memory the backward releases; 4: in-place gradients;
# 5: an in-place backward's workspace no longer net of the gradient buffer it was fed; 6: recompute_time
# 7: the runtime and profiler no longer make Python storage objects for gradients (monet_opt/storage.py)
# 8: bitmask backwards through threshold_backward (3-4x faster on CPU; workspace 1/8 -> 5/32 of the grad)
# 9: keys hold a non-contiguous input's strides (before, a same-shaped node's measurement was reused)
# 10: attention implementations return the query's layout, as torch's default does
# 11: grad_passed_flat: inputs whose gradient is the fed one (views, identities); out_strides
# 12: a non-contiguous output's backward workspace also measured with a contiguous gradient
# 13: a module's key holds its repr (children, parametrizations), not its extra_repr alone
# 14: state the forward leaves beyond saved tensors (a custom Function's ctx attributes)
# 15: a module's key holds its parameters' and buffers' dtypes and non-contiguous strides
# 16: channels_last ReLUs and additions may write into their input (fwd_in_place)
# 17: ReLU implementations lay their input gradient out as torch's (a copy where the gradient's layout differs)
# 18: ... but no copy (restrided on size-1 dims only): the copy was not in the memory model
# 19: the "indices" max pool lays a channels_last input's gradient out as torch does (was contiguous)
# 20: in-place batch-norm backwards take their sums from the kept tensor (about twice as fast)
# 21, 22: "gemm_backward" 1x1 convolutions (21 measured a forward of matrix products, since dropped)
# 23: "gemm_backward" also on strided 1x1 convolutions (ResNet downsamples)
# 24: under the caller's autocast, measured without autocast's cache of weight casts (as the runtime)
# 25: in-place batch-norm backwards in one C kernel on CPU float32 (ops/batch_norm_kernel.py)
# 26: ... and the custom batch norms' forward (bitwise torch's)


# -- device identity and cache -------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo's "model name"; else what `platform` says)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def device_fingerprint(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{cpu_model()} x{torch.get_num_threads()} threads"
    return f"{device.type}: {name}; torch {torch.__version__}"


def cache_dir() -> Path:
    return Path(os.environ.get("MONET_OPT_CACHE", Path.home() / ".cache" / "monet-opt"))


def cpu_load() -> float | None:
    """The 1-minute load average per CPU core (None where the OS does not report it)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return None


def busy_load() -> float:
    """Load per core above which the CPU counts as busy (`$MONET_OPT_BUSY_LOAD`, default 1.5:
    the profiler alone loads a core or so per thread; a test suite or a second job on top
    doubles that). Times measured busy are inflated: measured on this machine, a cache written
    during a test run made MobileNetV2's schedules +10 to +30 % slower than predicted."""
    try:
        return float(os.environ.get("MONET_OPT_BUSY_LOAD", "1.5"))
    except ValueError:
        return 1.5


def is_busy(load: float | None) -> bool:
    return load is not None and load > busy_load()


class ProfileCache:
    """Measurements of (op signature, implementation) on one device, one JSON file.

    Each entry records the CPU load it was measured under (`load`, per core). An entry
    measured while the CPU was busy is not trusted once the CPU is quiet again: `get`
    misses and the node is measured anew (while the CPU stays busy it is served, flagged
    by `busy_hits`)."""

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.device_key = device_fingerprint(device)
        digest = hashlib.sha256(self.device_key.encode()).hexdigest()[:16]
        self.path = cache_dir() / f"profile-{digest}.json"
        self.enabled = enabled
        self.entries: dict[str, dict] = {}
        self.dirty = False
        self.busy_hits = 0
        if enabled and self.path.exists():
            try:
                data = json.loads(self.path.read_text())
                if data.get("version") == CACHE_VERSION and data.get("device") == self.device_key:
                    self.entries = data.get("entries", {})
            except (OSError, ValueError):
                self.entries = {}  # a corrupt cache is rebuilt, never trusted

    def get(self, key: str, load: float | None = None) -> dict | None:
        """The entry for `key`, unless it was measured busy and the CPU (`load`) is quiet now."""
        entry = self.entries.get(key) if self.enabled else None
        if entry is not None and is_busy(entry.get("load")):
            if not is_busy(load):
                return None
            self.busy_hits += 1
        return entry

    def put(self, key: str, value: dict, load: float | None = None) -> None:
        self.entries[key] = {**value, "load": None if load is None else round(load, 2)}
        self.dirty = True

    def save(self) -> None:
        if self.enabled and self.dirty:
            payload = {"version": CACHE_VERSION, "device": self.device_key, "entries": self.entries}
            atomic_write_text(self.path, json.dumps(payload))
            self.dirty = False


# -- measuring one node ----------------------------------------------------------------
def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        desc = ["T", list(value.shape), str(value.dtype), bool(value.requires_grad)]
        if not value.is_contiguous():
            # a transposed or channels_last input takes other kernels and may make the op save
            # a contiguous copy instead of the input (timm's ResMLP: one node's measurement
            # reused for a same-shaped node with other strides put the memory model 7 % low)
            desc.append(list(value.stride()))
        return desc
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {k: _describe(v) for k, v in sorted(value.items())}
    if isinstance(value, (int, float, bool, str, type(None))):
        return value
    return type(value).__name__


def _signature(node: fx.Node, target: Any, args: tuple, kwargs: dict, impl: str) -> str:
    if isinstance(target, torch.nn.Module):
        # (repr, not extra_repr alone: it shows a module's children and parametrizations; an
        # orthogonal Linear was served a weight-normed one's measurement, whose backward is ~900 KB
        # lighter, and measured 13 % over its budget)
        what = f"{type(target).__module__}.{type(target).__name__}:{target!r} train={target.training}"
        # (and its tensors' dtypes and layouts, which the repr does not show: a contiguous
        # ResNet-18 was served its channels_last twin's convolutions and measured 14 % over)
        what += json.dumps([_describe(t) for t in (*target.parameters(), *target.buffers())])
    else:
        what = f"{node.op}:{getattr(target, '__module__', '')}.{getattr(target, '__name__', target)}"
    text = json.dumps([what, _describe(args), _describe(kwargs), impl], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _storage_bytes(t: torch.Tensor) -> int:
    # (makes t's storage unstealable for the autograd engine, monet_opt/storage.py: only on
    # tensors of the profiler's own measurement runs)
    if t.layout == torch.sparse_coo:  # (nn.Embedding(sparse=True)'s weight gradient)
        return _storage_bytes(t._indices()) + _storage_bytes(t._values())
    return t.untyped_storage().nbytes()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _root(grads: list, outs: list) -> torch.Tensor:
    """The runtime's stand-in output for a node's local graph, fed `grads` on backward."""
    box = _GradBox()
    box.grads = list(grads)
    return _Root.apply(box, *outs)


def _makes_state_from_inputs(
    impl: Implementation, target: Any, args: tuple, kwargs: dict, flat_out: list
) -> bool:
    """Whether `impl.state_from_inputs` applies to this node: on the example, without grad (no
    graph, no work), it returns a stand-in of the output's shape and dtype."""
    if impl.state_from_inputs is None or len(flat_out) != 1:
        return False
    try:
        with torch.no_grad():
            stand_in = impl.state_from_inputs(target, args, kwargs, True)
    except RuntimeError:
        return False
    out = flat_out[0]
    return isinstance(stand_in, torch.Tensor) and stand_in.shape == out.shape and stand_in.dtype == out.dtype


def _no_grad_forward_transient(impl: Implementation, target: Any, a: tuple, k: dict) -> int:
    """Peak bytes of one forward of `impl` without grad (as the runtime recomputes a node whose
    state it does not keep) beyond the outputs it leaves allocated."""
    with torch.no_grad():
        measured = measure_peak(impl.run, target, a, k, True)
    out = measured.result
    measured.result = None
    inputs = {storage_key(v) for v in tree_flatten((a, k))[0] if isinstance(v, torch.Tensor)}
    return max(0, measured.peak_bytes - _owned_bytes(tree_flatten(out)[0], inputs))


def _owned_bytes(flat_out: list, input_keys) -> int:
    """Bytes of the output tensors' storages, each once, but those of an input's storage."""
    outs = {storage_key(t): t for t in flat_out if isinstance(t, torch.Tensor)}
    return sum(_storage_bytes(t) for key, t in outs.items() if key not in input_keys)


def measure_node(
    node: fx.Node,
    target: Any,
    impl: Implementation,
    args: tuple,
    kwargs: dict,
    grad_positions: list[int],
    params: list[torch.Tensor],
    device: torch.device,
    repeats: int = 3,
) -> dict:
    """Time and memory of one implementation of one node, run as the runtime runs it."""
    needs_grad = bool(grad_positions) or any(p.requires_grad for p in params)

    def make_inputs():
        leaves = []

        def prep(pos_value):
            pos, value = pos_value
            if isinstance(value, torch.Tensor) and pos in grad_positions:
                leaf = value.detach().requires_grad_(True)
                leaves.append(leaf)
                return leaf
            return value

        flat, spec = tree_flatten((args, kwargs))
        a, k = torch.utils._pytree.tree_unflatten([prep(x) for x in enumerate(flat)], spec)
        return a, k, leaves

    def run(a, k, memo=None):
        extra = {} if memo is None else {"memo": memo}
        with torch.enable_grad() if needs_grad else torch.no_grad():
            return impl.run(target, a, k, True, **extra)

    def median_time(call) -> float:
        times = []
        for _ in range(repeats):
            a, k, _ = make_inputs()
            _sync(device)
            t0 = time.perf_counter()
            out = call(a, k)
            _sync(device)
            times.append(time.perf_counter() - t0)
            del out
        return statistics.median(times)

    # forward: warm-up, time, then memory and what is saved
    a, k, _ = make_inputs()
    run(a, k)
    fwd_time = median_time(run)
    recompute_time = None
    if impl.replays:
        # a recomputation given what a first computation left in the memo
        memo: dict = {}
        a, k, _ = make_inputs()
        run(a, k, memo)
        if memo:
            recompute_time = median_time(lambda a, k: run(a, k, memo))
        del memo

    # memory: one forward (what it keeps, its workspace) then one backward (its workspace).
    # On CPU both run in one allocation-tracking session split by a mark, so memory the
    # backward releases (saved tensors freed as the engine goes) is seen; on CUDA the
    # allocator's statistics see everything and each call is measured on its own.
    probe = [t for t in tree_flatten(run(*make_inputs()[:2]))[0] if isinstance(t, torch.Tensor)]
    grads = [torch.ones_like(t) for t in probe if t.requires_grad] if needs_grad else []
    del probe

    def fresh_grads():
        # an in-place backward overwrites the gradient it is given: give it its own copy
        return [g.clone() for g in grads] if impl.grad_in_place else grads

    old_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    a, k, leaves = make_inputs()
    # the storage of the gradient each input receives, as the engine hands it over (before a
    # leaf's AccumulateGrad, which may copy it: the runtime takes it as it is)
    reached: dict[int, int] = {}
    leaf_positions = [pos for pos, v in enumerate(tree_flatten((args, kwargs))[0]) if pos in grad_positions]
    for pos, leaf in zip(leaf_positions, leaves):
        leaf.register_hook(functools.partial(_note_storage, reached, pos))
    saved: list[tuple[int, int]] = []  # (storage key, bytes): no reference, so the backward can free them

    def pack(t):
        saved.append((storage_key(t), _storage_bytes(t)))
        return t.detach()  # not t: a saved output would hold its own grad_fn (a leaked cycle)

    def forward():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return run(a, k)

    bgrads = fresh_grads()
    fed = {storage_key(g) for g in bgrads}

    def backward(out, given: list):
        o = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        root = _root(given, o)
        del o
        if impl.grad_in_place:
            # the root holds the only reference, as in the runtime: otherwise a leaf's
            # AccumulateGrad copies the in-place gradient (a whole activation the runtime never
            # allocates, which also hid the backward's own chunked temporaries)
            given.clear()
        with autocast_regions.no_autocast(device.type):
            torch.autograd.backward(root, root.new_empty(0))

    def memory_run(forward, given: list) -> tuple:
        """(output, forward peak, bytes the forward left allocated, backward peak above them)"""
        if device.type == "cpu":
            with track_peak(device) as session:
                out = forward()
                mark()
                if given:
                    backward(out, given)
            (_, fwd_peak), (after_fwd, bwd_peak) = segment_peaks(session)
            return out, fwd_peak, after_fwd, bwd_peak - after_fwd
        measured = measure_peak(forward)
        bwd_peak = measure_peak(backward, measured.result, given).peak_bytes if given else 0
        return measured.result, measured.peak_bytes, measured.retained_bytes, bwd_peak

    def made_by_backward(leaves: list, fed: set) -> int:
        """Bytes of the input and parameter gradients a backward allocated."""
        # (an in-place backward's input gradient is the buffer it was fed, which existed before:
        # counting it hid the chunked temporaries of output-activated BatchNorm, 1/8 of an
        # activation, measured 3 MB over the prediction on ResNet-50 b8 224)
        in_grads = sum(
            _storage_bytes(x.grad) for x in leaves if x.grad is not None and storage_key(x.grad) not in fed
        )
        return in_grads + sum(_storage_bytes(p.grad) for p in params if p.grad is not None)

    out, fwd_peak, left_by_forward, bwd_peak = memory_run(forward, bgrads)

    flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    input_flat = [v for v in tree_flatten((a, k))[0]]
    input_ptrs: dict[int, list[int]] = {}
    for pos, v in enumerate(input_flat):
        if isinstance(v, torch.Tensor):
            input_ptrs.setdefault(storage_key(v), []).append(pos)
    out_ptrs = {storage_key(t) for t in flat_out}
    param_ptrs = {storage_key(p) for p in params}
    kept_input_flat: set[int] = set()
    keeps_output = False
    private: dict[int, int] = {}
    for key, nbytes in saved:
        if key in param_ptrs:
            continue
        if key in input_ptrs:
            kept_input_flat.update(input_ptrs[key])
        elif key in out_ptrs:
            keeps_output = True
        else:
            private[key] = nbytes
    out_owned = _owned_bytes(flat_out, input_ptrs)
    # what the forward left allocated beyond its outputs and the tensors it saved for the
    # backward is state the saved-tensor hooks do not see: a custom autograd.Function keeping a
    # tensor as an attribute of ctx (`ctx.t = torch.tanh(x)`), held until its graph is freed
    # (unseen, a stack of such Functions measured 77 % over its budget)
    saved_private = sum(private.values())
    unseen = max(0, left_by_forward - out_owned - saved_private)
    state_bytes = saved_private + unseen if needs_grad else 0
    fwd_workspace = max(0, fwd_peak - out_owned - state_bytes)
    # run without grad (a recomputation whose state is not kept), a node may still make what it
    # keeps with grad, and free it: autocast's lower-precision copies of its input and weight,
    # which the kernel reads (resnet18 b4 64 under bfloat16: a stem convolution recomputed
    # without grad measured 117 KB over its prediction, the schedule over its budget)
    nograd_fwd_workspace = (
        _no_grad_forward_transient(impl, target, *make_inputs()[:2]) if needs_grad else None
    )
    bwd_workspace = 0
    grad_passed_flat: list[int] = []
    if grads:
        # inputs whose gradient is the buffer the backward was fed, or a view of it: a view's or
        # an identity's backward allocates nothing (OPT returns logits.contiguous(): counted as a
        # new logits-sized buffer, its no-recompute peak was predicted 9 % high)
        if not impl.grad_in_place:
            grad_passed_flat = sorted(pos for pos, key in reached.items() if key in fed)
        bwd_workspace = max(0, bwd_peak - made_by_backward(leaves, fed))
    del out
    if any(not g.is_contiguous() for g in grads):
        # an output not in the default layout (an LSTM's batch_first output is a transposed
        # view of its own): the gradients above have its strides, but the one a consumer's
        # backward hands on may be contiguous, and the backward then copies it into its own
        # layout (LSTM b64 s20 behind h[:, -1]: a 160-KiB copy the profile missed; measured 80 KiB
        # over the prediction, and over the budget). The workspace is the larger of the two
        # layouts'.
        for p in params:
            p.grad = None
        a, k, leaves = make_inputs()
        dense = [torch.ones(g.shape, dtype=g.dtype, device=g.device) for g in grads]
        fed_dense = {storage_key(g) for g in dense}
        _, _, _, dense_peak = memory_run(lambda: run(a, k), dense)
        bwd_workspace = max(bwd_workspace, dense_peak - made_by_backward(leaves, fed_dense))
        del dense

    bwd_time = 0.0
    if grads:
        btimes = []
        for _ in range(repeats):
            a, k, leaves = make_inputs()
            o = [t for t in tree_flatten(run(a, k))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            root = _root(fresh_grads(), o)
            del o
            for p in params:
                p.grad = None
            _sync(device)
            t0 = time.perf_counter()
            with autocast_regions.no_autocast(device.type):
                torch.autograd.backward(root, root.new_empty(0))
            _sync(device)
            btimes.append(time.perf_counter() - t0)
            del root
        bwd_time = statistics.median(btimes)
    for p, g in zip(params, old_grads):
        p.grad = g
    return {
        "fwd_time": fwd_time,
        "recompute_time": recompute_time,
        "bwd_time": bwd_time,
        "fwd_workspace": int(fwd_workspace),
        "nograd_fwd_workspace": nograd_fwd_workspace,
        "bwd_workspace": int(bwd_workspace),
        "kept_input_flat": sorted(kept_input_flat),
        "keeps_output": keeps_output,
        "state_bytes": int(state_bytes),
        "grad_passed_flat": grad_passed_flat,
        "out_strides": _layout(flat_out),
    }


def _layout(flat_out: list) -> list[list[int]]:
    """The strides of each output tensor, of its dimensions longer than 1 (the others' strides do
    not matter)."""
    return [[st for st, size in zip(t.stride(), t.shape) if size > 1] for t in flat_out]


def _note_storage(into: dict[int, int], pos: int, grad: torch.Tensor) -> None:
    into[pos] = storage_key(grad)


def _memo_bytes(target: Any) -> int:
    """Bytes a replaying implementation keeps in its memo (batch norm: mean and invstd, in
    float32, or float64 for a float64 module)."""
    n = getattr(target, "num_features", 0)
    weight = getattr(target, "weight", None)
    size = 8 if isinstance(weight, torch.Tensor) and weight.dtype == torch.float64 else 4
    return 2 * int(n) * size


# -- the whole model -----------------------------------------------------------------
def build_problem(
    model: torch.nn.Module,
    example_inputs: Any,
    device: torch.device | str | None = None,
    repeats: int = 3,
    use_cache: bool = True,
    progress: bool = True,
    graph: OpGraph | None = None,
    meta: dict | None = None,
    calibrate: bool = False,
    optimizer: Any = None,
    zero_pack: bool = False,
    bitwise: bool = False,
    recompute_overhead: float | None = None,
    grad_outputs: str = "auto",
    outputs_held: str = "all",
    defer_weight_grads: bool = False,
) -> Problem:
    """Trace `model`, measure every implementation of every node here, return a solver Problem.

    calibrate: replace each implementation's isolated times by what it takes inside a real
    training step (`monet_opt.calibrate`; three steps per implementation name, never cached;
    ResNet-50 b8 224 on CPU: six names, ~65 s). Isolated timings misjudge memory-bound
    kernels unevenly (torch's BatchNorm backward is 4x faster in a step than alone, the
    in-place one is not), so schedules meant to be fast should be solved calibrated.

    optimizer: a factory (`params -> torch.optim.Optimizer`) or a name in
    `monet_opt.step_in_backward.OPTIMIZERS`: the optimizer steps inside the backward, each
    parameter as soon as its gradient is complete, and its gradient is freed then. The
    problem's fingerprint says so; run its schedules with `MonetWrapper(..., optimizer=...)`.

    zero_pack: also offer implementations whose kept bytes depend on the values (a convolution
    keeping its ReLU input as a bit mask and the nonzero elements, `monet_opt.ops.zero_pack`).
    Their memory is measured on `example_inputs`: profile with a real batch, and expect a
    batch whose activations are denser than it to use more memory than predicted.

    bitwise: offer only implementations whose gradients are bit for bit torch's
    (`Implementation.bitwise`); by default those within float rounding are offered too.

    recompute_overhead: the problem's `recompute_overhead_s`, the runtime's own seconds per
    recomputation; None: measured on the device once and cached (`monet_opt.runtime_cost`).

    grad_outputs: which outputs the training loss reads. "auto": a model given its inputs by
    keyword that returns a loss (a Hugging Face model given `labels=`: a ModelOutput with `loss`)
    is trained on that loss alone, and its other outputs (the logits) get no gradient; any other
    model, every output. "all": every output. The wrapper refuses a gradient on an output the
    schedule gave none.

    outputs_held: which outputs the training loop holds through the backward. "all" (as
    `out = model(**batch); out.loss.backward()`, which keeps `out`): every output. "loss": only
    those the loss reads; the loop drops the rest once the loss is computed, before the
    backward, as Hugging Face's Trainer does (`loss = model(**batch).loss; loss.backward()`), and
    the schedule may free them then (GPT-2's logits: 196 MiB at batch 8, 128 tokens). The
    wrapper warns if such an output is still held when its backward starts.

    defer_weight_grads: with gradients kept (no `optimizer`), let each convolution or linear
    layer whose weight gradient is bigger than its input and output gradient together make that
    gradient after the last backward stage instead of in its own backward
    (`Node.deferred_param_grad_bytes`, `monet_opt.runtime.deferred`): ResNet-50's layer4 and fc
    then hold 28.7 MiB less through the backward (b8 224). Not with an optimizer step in the
    backward (it frees each gradient as it is made), not under autocast, not for nodes inside the
    model's own autocast regions, for parameters several nodes use, or for implementations that
    do not keep the input itself (zero-packed inputs)."""
    if defer_weight_grads and optimizer is not None:
        raise ValueError(
            "defer_weight_grads is for gradients kept to the end of the step; with an optimizer step "
            "in the backward each gradient is freed as it is made"
        )
    if grad_outputs not in ("auto", "all"):
        raise ValueError(f"grad_outputs must be 'auto' or 'all', not {grad_outputs!r}")
    if outputs_held not in ("all", "loss"):
        raise ValueError(f"outputs_held must be 'all' or 'loss', not {outputs_held!r}")
    # (inputs by keyword, {'input_ids': ids, 'use_cache': False}: `monet_opt.keyword_inputs`)
    model, example_inputs = as_traceable(model, example_inputs)
    if device is None:
        device = next((p.device for p in model.parameters()), example_inputs[0].device)
    device = torch.device(device)
    model = model.to(device)
    example_inputs = tuple(x.to(device) for x in example_inputs)
    modes = training_for_profile(model)  # (a frozen BatchNorm in eval mode stays so)
    buffers = module_state.saved_buffers(model)  # (measuring runs move spectral norms' vectors on)
    try:
        return _build_problem(
            model,
            example_inputs,
            device,
            modes,
            repeats=repeats,
            use_cache=use_cache,
            progress=progress,
            graph=graph,
            meta=meta,
            calibrate=calibrate,
            optimizer=optimizer,
            zero_pack=zero_pack,
            bitwise=bitwise,
            recompute_overhead=recompute_overhead,
            grad_outputs=grad_outputs,
            outputs_held=outputs_held,
            defer_weight_grads=defer_weight_grads,
        )
    finally:  # (also when profiling fails midway: the model leaves as it came in)
        restore_training_modes(model, modes)
        module_state.restore_buffers(model, buffers)


def _build_problem(
    model: torch.nn.Module,
    example_inputs: tuple,
    device: torch.device,
    modes: Any,
    repeats: int,
    use_cache: bool,
    progress: bool,
    graph: OpGraph | None,
    meta: dict | None,
    calibrate: bool,
    optimizer: Any,
    zero_pack: bool,
    bitwise: bool,
    recompute_overhead: float | None,
    grad_outputs: str,
    outputs_held: str,
    defer_weight_grads: bool = False,
) -> Problem:
    """`build_problem`'s work, on a model in training mode for profiling (`modes`: the modes it
    came in, restored before calibration)."""
    graph = graph or trace(model, example_inputs)
    gm = graph.gm
    cache = ProfileCache(device, enabled=use_cache)

    env: dict[str, Any] = {}
    memo_bytes = 0  # what implementations that replay keep from a first computation for a recomputation
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for p, x in zip(placeholders, example_inputs):
        env[p.name] = x
    op_names = {n.name for n in graph.nodes}
    # whose output autograd tracked in the traced run: a node reading a gradient-carrying tensor
    # for its shape only (timm drop_path's `x.new_empty(shape)`, the mask it fills) has none
    traced_grad = {n.name for n in graph.nodes if n.requires_grad}
    fx_nodes = [n for n in gm.graph.nodes if n.name in op_names]
    flat_outputs = tree_flatten(next(n for n in gm.graph.nodes if n.op == "output").args)[0]
    output_refs = {n.name for n in flat_outputs if isinstance(n, fx.Node)}
    # the outputs the user's loss reads (`grad_output_positions`): the others get no gradient
    loss_outputs = grad_output_positions(model, grad_outputs)
    grad_refs = (
        output_refs
        if loss_outputs is None
        else {n.name for k, n in enumerate(flat_outputs) if k in loss_outputs and isinstance(n, fx.Node)}
    )
    # outputs_held="loss": the loop drops the outputs the loss does not read before the backward
    held_refs = output_refs if outputs_held == "all" else grad_refs
    dropped_outputs = [
        k
        for k, n in enumerate(flat_outputs)
        if isinstance(n, fx.Node) and n.name in op_names and n.name not in held_refs
    ]
    remaining_users = {n.name: len(n.users) for n in gm.graph.nodes}
    # every isolated backward time includes one autograd engine call, which a training step's
    # shared graph pays once for all its nodes: subtracted from each (the same from every
    # schedule, which runs each node's backward once: predicted overheads, not plans, change)
    from monet_opt.runtime_cost import backward_call_overhead

    backward_call = backward_call_overhead(device, use_cache=use_cache)
    bar = _progress(len(fx_nodes), progress, "profiling")
    started = time.perf_counter()
    hits = 0
    busy_measured = 0
    warned_busy = False
    other_layouts: list[str] = []  # node:implementation whose output layout is not the default's
    requires_grad: set[str] = set()
    random_nodes: list[str] = []
    param_owner: dict[int, str] = {}
    param_users: dict[int, list[str]] = {}
    param_bytes: dict[int, int] = {}
    param_element_size: dict[int, int] = {}  # 0: not contiguous (stepped whole, never by chunks)
    rows: list[dict] = []
    # node -> (restore from a consumer's state, bytes of the value it restores)
    restores: dict[str, list[tuple[Restore, int]]] = {}
    # profiled under the caller's autocast: measured so (its own cache entries), implementations
    # that cannot run under it left out, and the schedule's wrapper traced under it
    caller_autocast = (
        autocast_regions.spec_now([device.type]) if torch.is_autocast_enabled(device.type) else None
    )
    if defer_weight_grads and caller_autocast:
        raise ValueError("defer_weight_grads is not offered under autocast")
    # node -> (its parameters, its module, its input's and output's layouts: `_layout_of`), where
    # its module allows its weight gradient deferred (tensors are made only for the nodes deferred)
    deferrable_nodes: dict[str, tuple] = {}
    for fx_node in fx_nodes:
        target = _resolve_target(gm, fx_node)
        # (a node inside the model's own autocast block runs under it: autocast_regions)
        autocast = fx_node.meta.get(autocast_regions.AUTOCAST)
        impls = autocast_regions.with_spec(implementations_for(fx_node.op, target), autocast)
        if any(i.replays for i in impls):
            memo_bytes += _memo_bytes(target)

        def load(n: fx.Node) -> Any:
            return _fetch_attr(gm, n.target) if n.op == "get_attr" else env[n.name]

        args = fx.node.map_arg(fx_node.args, load)
        kwargs = fx.node.map_arg(fx_node.kwargs, load)
        impls = [
            i
            for i in impls
            if (zero_pack or i.value_state_bytes is None)
            and (i.bitwise or not bitwise)
            and (i.autocast or not caller_autocast)
            and (i.applies is None or i.applies(args, kwargs))
        ]
        sources, positions, inputs = _arg_layout(fx_node, args, kwargs, op_names)
        flat_vals = tree_flatten((args, kwargs))[0]
        grad_positions = [
            pos
            for pos, (src, val) in enumerate(zip(sources, flat_vals))
            if src is not None
            and isinstance(val, torch.Tensor)
            and (val.is_floating_point() or val.is_complex())
            and ((src.op == "placeholder" and val.requires_grad) or src.name in requires_grad)
        ]
        params = _node_params(gm, fx_node, target)
        rng_before = _save_rng()
        with torch.no_grad():
            out = impls[0].run(target, args, kwargs, True)
        if not _same_rng(rng_before, _save_rng()):
            random_nodes.append(fx_node.name)
        flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        is_tensor = bool(flat_out)
        if defer_weight_grads and autocast is None and params and deferrable(target) is None:
            x0 = args[0] if args else kwargs.get("input")
            if isinstance(x0, torch.Tensor) and isinstance(out, torch.Tensor):
                deferrable_nodes[fx_node.name] = (params, target, _layout_of(x0), _layout_of(out))
        float_out = any(t.is_floating_point() or t.is_complex() for t in flat_out)
        if float_out and (grad_positions or params) and fx_node.name in traced_grad:
            requires_grad.add(fx_node.name)
        for p in params:
            param_owner[id(p)] = fx_node.name  # the last user in topo order runs backward first
            param_bytes[id(p)] = p.numel() * p.element_size()
            param_element_size[id(p)] = p.element_size() if p.is_contiguous() else 0
            if p.requires_grad:
                param_users.setdefault(id(p), []).append(fx_node.name)
        in_ptrs = {}
        for pos, val in enumerate(flat_vals):
            if isinstance(val, torch.Tensor):
                in_ptrs.setdefault(storage_key(val), positions[pos])
        alias_of = None
        owned: dict[int, int] = {}
        for t in flat_out:
            key = storage_key(t)
            if key in in_ptrs:
                if in_ptrs[key] is not None and alias_of is None:
                    alias_of = in_ptrs[key]
            else:
                owned[key] = _storage_bytes(t)
        fwd_in_place = _fwd_in_place_position(fx_node, target, args, positions)
        impl_rows = []
        for impl in impls:
            if not is_tensor:
                impl_rows.append(Impl(impl.name, 0.0, 0.0))
                continue
            key = (
                _signature(fx_node, target, args, kwargs, impl.name)
                + f":{grad_positions}"
                + autocast_regions.describe(autocast)
                + autocast_regions.describe(caller_autocast)
            )
            load = cpu_load() if device.type == "cpu" else None
            entry = cache.get(key, load)
            if entry is None:
                if is_busy(load) and not warned_busy:
                    warned_busy = True
                    warnings.warn(
                        f"the CPU is busy (load {load:.1f} per core, over {busy_load():g}): operator "
                        "times measured now are inflated; they are cached as busy and measured "
                        "again once the CPU is quiet",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                with autocast_regions.without_cast_cache():
                    entry = measure_node(
                        fx_node, target, impl, args, kwargs, grad_positions, params, device, repeats
                    )
                busy_measured += is_busy(load)
                cache.put(key, entry, load)
            else:
                hits += 1
            if impl.name != "default" and entry["out_strides"] != _layout(flat_out):
                # another layout than torch's would change what later nodes copy or keep, which
                # the profile (made on the default's values) does not see: not offered
                other_layouts.append(f"{fx_node.name}:{impl.name}")
                continue
            if impl.value_state_bytes is not None:  # this node's values, not a same-shaped node's
                entry = dict(entry, state_bytes=int(impl.value_state_bytes(args, kwargs)))
            kept = sorted({positions[p] for p in entry["kept_input_flat"] if positions[p] is not None})
            in_place = _grad_in_place_position(impl, flat_vals, positions, flat_out)
            writes_into = fwd_in_place if impl.name == "default" else None
            if in_place is None:  # (a view, an identity: measured handing its gradient on)
                shared = tuple(
                    sorted({positions[p] for p in entry["grad_passed_flat"] if positions[p] is not None})
                )
            else:
                shared = _grad_shared_positions(
                    fx_node, target, kwargs, in_place, flat_vals, positions, flat_out
                )
            row = Impl(
                name=impl.name,
                fwd_time=entry["fwd_time"],
                recompute_time=entry.get("recompute_time"),
                bwd_time=max(0.0, entry["bwd_time"] - backward_call)
                if fx_node.name in requires_grad
                else 0.0,
                fwd_workspace=entry["fwd_workspace"],
                nograd_fwd_workspace=entry["nograd_fwd_workspace"],
                bwd_workspace=entry["bwd_workspace"] if fx_node.name in requires_grad else 0,
                keeps_inputs=tuple(kept),
                keeps_output=entry["keeps_output"],
                state_bytes=entry["state_bytes"],
                grad_in_place=in_place,
                grad_shared=shared,
                fwd_in_place=writes_into,
            )
            if (
                fx_node.name in requires_grad
                and row.keeps_inputs_only
                and _makes_state_from_inputs(impl, target, args, kwargs, flat_out)
            ):
                row = dataclasses.replace(row, bwd_from_inputs=True)
            impl_rows.append(row)
        if any(i.name == CONSUMER_IMPL for i in impl_rows):
            restore = _restore_from(fx_node, args, op_names, cache, device, repeats)
            if restore is not None:
                restores.setdefault(fx_node.args[0].name, []).append(restore)
        rows.append(
            {
                "name": fx_node.name,
                "op": getattr(_op_node(graph, fx_node.name), "kind", fx_node.op),
                "inputs": tuple(inputs),
                "output_bytes": 0 if alias_of is not None else sum(owned.values()),
                "impls": tuple(impl_rows),
                "grad_bytes": sum(
                    t.numel() * t.element_size() for t in flat_out if t.is_floating_point() or t.is_complex()
                )
                if fx_node.name in requires_grad
                else 0,
                "alias_of": alias_of,
                "is_output": fx_node.name in output_refs,
                "output_grad": fx_node.name in grad_refs or fx_node.name not in output_refs,
                "user_holds": fx_node.name in held_refs or fx_node.name not in output_refs,
            }
        )
        env[fx_node.name] = out
        for arg in fx_node.all_input_nodes:
            remaining_users[arg.name] -= 1
            if remaining_users[arg.name] == 0 and arg.op != "placeholder":
                env.pop(arg.name, None)
        bar.update(1)
    bar.close()
    cache.save()
    if other_layouts:
        warnings.warn(
            f"{len(other_layouts)} implementations not offered: their outputs are laid out unlike "
            f"torch's (node:implementation {', '.join(other_layouts[:6])})",
            RuntimeWarning,
            stacklevel=2,
        )
    env.clear()
    restore_training_modes(model, modes)

    # a node runs backward if it needs a gradient and its output reaches an output the loss reads
    # through nodes that need gradients (not through a mask: `x.masked_fill(y.abs() < e, 0)`
    # hands y no gradient)
    reaches = set(grad_refs)
    for row in reversed(rows):
        if row["name"] in reaches and row["name"] in requires_grad:
            reaches.update(row["inputs"])
    owner_bytes: dict[str, int] = {}
    for pid, owner in param_owner.items():
        owner_bytes[owner] = owner_bytes.get(owner, 0) + param_bytes[pid]
    backward_nodes = {row["name"] for row in rows if row["name"] in requires_grad and row["name"] in reaches}
    # a parameter several nodes use (tied embeddings): the owner's backward makes its gradient;
    # each other user's backward makes a new one and the engine sums the two, transiently two
    # parameter-sized buffers more (measured: GPT-2 with a tied 32-MiB embedding peaked 64 MiB
    # over a model that counted it once)
    tied_bytes: dict[str, int] = {}
    for pid, users in param_users.items():
        for name in set(users) - {param_owner[pid]}:
            if name in backward_nodes:
                tied_bytes[name] = tied_bytes.get(name, 0) + 2 * param_bytes[pid]
    for row in rows:
        extra = tied_bytes.get(row["name"], 0)
        if extra:
            row["impls"] = tuple(
                dataclasses.replace(im, bwd_workspace=im.bwd_workspace + extra) for im in row["impls"]
            )
    freed, step, step_ratio = _steps_in_backward(
        optimizer, device, param_users, param_bytes, param_element_size, backward_nodes
    )
    nodes = []
    for row in rows:
        backward = row["name"] in backward_nodes
        offered = tuple(  # (the whole storage of the node, read by a consumer with a backward)
            r
            for r, nbytes in restores.get(row["name"], [])
            if row["alias_of"] is None and row["output_bytes"] == nbytes and r.consumer in backward_nodes
        )
        nodes.append(
            Node(
                **row,
                restores=offered,
                requires_backward=backward,
                param_grad_bytes=owner_bytes.get(row["name"], 0) if backward else 0,
                param_grad_freed_bytes=freed.get(row["name"], 0),
                param_step_bytes=step.get(row["name"], 0),
            )
        )
    if defer_weight_grads:
        nodes = _defer_weight_grads(nodes, deferrable_nodes, param_users)
    info = {
        "device": cache.device_key,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "input_shapes": [list(x.shape) for x in example_inputs],
        "input_dtypes": [str(x.dtype).removeprefix("torch.") for x in example_inputs],
        "input_layouts": [input_layout.layout_of(x) for x in example_inputs],
        "weight_layouts": input_layout.weight_layouts(model),
        # inputs by keyword: their names, and the constants given with them
        **(
            {"input_names": list(model.names), "input_constants": model.constants}
            if isinstance(model, KeywordRoot)
            else {}
        ),
        # positional inputs holding containers: their structure (the wrapper needs real ones)
        **({"input_structure": str(model.in_spec)} if isinstance(model, StructuredRoot) else {}),
        # the flat output positions the loss reads (absent: every output; the wrapper checks it)
        **({"grad_outputs": loss_outputs} if loss_outputs is not None else {}),
        # the flat output positions the loop drops before the backward (`outputs_held`)
        **({"dropped_outputs": dropped_outputs} if dropped_outputs else {}),
        "profile_seconds": round(time.perf_counter() - started, 2),
        "profile_cache_hits": hits,
        # measurements taken on a busy CPU (now, or served from the cache while still busy)
        "profile_busy_measurements": busy_measured + cache.busy_hits,
        # the engine's cost per backward call, taken off every node's isolated backward time
        "backward_call_s": backward_call,
    }
    info.update(meta or {})
    # fixed memory: the RNG state each random node saw (the runtime keeps it to replay it on
    # recompute), one more while a random node runs (the forward compares the state before and
    # after it; a recompute keeps the current state to restore it: measured 5064 B over the
    # model on a GPT multilevel schedule without it), and a small reserve for per-op scratch the
    # per-node measurements miss (measured: up to 23 KB over a whole ViT-B/16 step; 8 B on
    # ResNets, GoogLeNet and GPT)
    info["random_nodes"] = random_nodes
    cpu_state, cuda_states = _save_rng()
    states = len(random_nodes) + (1 if random_nodes else 0)
    rng_bytes = states * sum(t.numel() * t.element_size() for t in [cpu_state, *(cuda_states or [])])
    # a leaf changing its own buffers keeps them as they were before its run, and a recomputation
    # runs on one more copy (`monet_opt.module_state`)
    state_bytes = 2 * sum(n.state_bytes for n in graph.nodes)
    info["fixed_bytes_detail"] = {
        "rng_states": rng_bytes,
        "runtime_reserve": RUNTIME_RESERVE_BYTES,
        "replay_memos": memo_bytes,
        "buffer_states": state_bytes,
    }
    # (memos and buffer states counted for every node that may keep one, recomputed or not: small)
    fixed = rng_bytes + RUNTIME_RESERVE_BYTES + memo_bytes + state_bytes
    fingerprint = graph.fingerprint
    if optimizer is not None:
        fingerprint += FINGERPRINT_SUFFIX
        info["step_in_backward"] = {
            "optimizer": optimizer if isinstance(optimizer, str) else repr(optimizer),
            "step_bytes_per_param_byte": step_ratio,
        }
    if caller_autocast:
        info["autocast"] = autocast_regions.to_json(caller_autocast)
    if bitwise:
        info["bitwise"] = True  # only implementations with torch's gradients bit for bit
    if defer_weight_grads:  # (which nodes: their deferred_param_grad_bytes)
        info["defer_weight_grads"] = True
    if zero_pack:
        info["zero_pack"] = True  # value-dependent implementations offered (memory from the example)
    if graph.data_sized:
        # (a mixture of experts' tokens per expert: another batch routes them otherwise)
        info["data_sized_nodes"] = list(graph.data_sized)
        warnings.warn(
            f"monet-opt: the sizes of node(s) {', '.join(graph.data_sized[:4])} (and what is computed "
            "from them) depend on the input's values (nonzero, a boolean mask, torch.where(mask), "
            "...): the schedule's memory model holds for this example batch; a batch that makes "
            "them larger may need more than the budget. Solve with a batch that makes them as large "
            "as training will",
            RuntimeWarning,
            stacklevel=3,
        )
    if recompute_overhead is None:
        recompute_overhead = 0.0
        if any(n.requires_backward for n in nodes):
            from monet_opt.runtime_cost import recompute_overhead as measured_overhead

            recompute_overhead = measured_overhead(device, use_cache=use_cache)
    problem = Problem(
        nodes=tuple(nodes),
        fingerprint=fingerprint,
        fixed_bytes=fixed,
        meta=info,
        recompute_overhead_s=float(recompute_overhead),
    )
    if calibrate and any(n.requires_backward for n in nodes):
        from monet_opt.calibrate import calibrate_in_situ

        problem = calibrate_in_situ(model, example_inputs, problem)
    return problem


def _restore_from(
    fx_node: fx.Node, args: tuple, op_names: set[str], cache, device: torch.device, repeats: int
) -> tuple[Restore, int] | None:
    """A convolution offering "zero_packed_input" on a problem node's whole storage: the
    restore of that node from its state (`monet_opt.restore`), with the unpacking timed, and the
    bytes it restores."""
    from monet_opt.ops import zero_pack

    src = fx_node.args[0] if fx_node.args else None
    x = args[0] if args else None
    if not isinstance(src, fx.Node) or src.name not in op_names or not isinstance(x, torch.Tensor):
        return None
    if not spans_storage(x) or not x.is_contiguous():
        return None
    key = f"unpack:{tuple(x.shape)}:{x.dtype}:{x.device}:{zero_pack.nonzero_count(x)}"
    load = cpu_load() if device.type == "cpu" else None
    entry = cache.get(key, load)
    if entry is None:
        packed = zero_pack.pack(x.detach())
        times = []
        for _ in range(max(3, repeats)):
            _sync(device)
            t0 = time.perf_counter()
            zero_pack.unpack(packed)
            _sync(device)
            times.append(time.perf_counter() - t0)
        entry = {"time": statistics.median(times)}
        cache.put(key, entry, load)
    restore = Restore(restore_name(fx_node.name), fx_node.name, CONSUMER_IMPL, entry["time"])
    return restore, x.numel() * x.element_size()


def _defer_weight_grads(nodes: list[Node], candidates: dict[str, tuple], param_users: dict) -> list[Node]:
    """`build_problem(defer_weight_grads=True)`: each candidate (a convolution or linear module
    with parameters) whose parameter gradients outweigh what computing them later needs held --
    its input's storage (a view's base) and its output's gradient -- gets them deferred: those
    bytes become its `param_grad_bytes`, held from its backward to the end of the step, and its
    parameter gradients its `deferred_param_grad_bytes`, and what making them allocates besides,
    measured here, its `deferred_workspace_bytes`. Only where every implementation keeps the input
    itself (the runtime holds that tensor) and no other node uses the parameters."""
    by_name = {n.name: n for n in nodes}
    out = []
    for n in nodes:
        params, module, x, y = candidates.get(n.name, ([], None, None, None))
        if (
            params
            and n.requires_backward
            and n.inputs
            and n.param_grad_bytes
            and all(p.requires_grad and param_users.get(id(p)) == [n.name] for p in params)
            and all(0 in im.keeps_inputs for im in n.impls)
        ):
            held = storage_bytes(by_name, n.inputs[0]) + n.grad_bytes
            if n.param_grad_bytes > held:
                n = dataclasses.replace(
                    n,
                    deferred_param_grad_bytes=n.param_grad_bytes,
                    param_grad_bytes=held,
                    deferred_workspace_bytes=workspace_bytes(module, _zeros(x), _zeros(y)),
                )
        out.append(n)
    return out


def _layout_of(t: torch.Tensor) -> tuple:
    """What `_zeros` needs to make a tensor laid out as t: (shape, strides, dtype, device)."""
    return tuple(t.shape), t.stride(), t.dtype, t.device


def _zeros(layout: tuple) -> torch.Tensor:
    shape, stride, dtype, device = layout
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


def _steps_in_backward(
    optimizer: Any,
    device: torch.device,
    users: dict[int, list[str]],
    nbytes: dict[int, int],
    element_size: dict[int, int],
    backward: set[str],
) -> tuple[dict[str, int], dict[str, int], float]:
    """Per node, the parameter-gradient bytes an optimizer step in the backward frees after the
    node's backward (parameters whose last backward, i.e. first reader with a backward in
    topological order, it is), and the step's transient bytes: the optimizer's temporaries for
    the largest step among them (parameters step one at a time, an elementwise optimizer a large
    contiguous one chunk by chunk: `step_in_backward.step_bytes`); and the measured step bytes
    per parameter byte. Nothing without an optimizer."""
    if optimizer is None:
        return {}, {}, 0.0
    factory = optimizer_factory(optimizer)
    ratio = step_bytes_per_param_byte(factory, device)
    chunked = steps_by_chunks(factory)
    freed: dict[str, int] = {}
    step: dict[str, int] = {}
    for pid, names in users.items():
        last = next((n for n in names if n in backward), None)
        if last is None:
            continue
        freed[last] = freed.get(last, 0) + nbytes[pid]
        size = element_size[pid]
        this = step_bytes(ratio, nbytes[pid], size, chunked and size > 0)
        step[last] = max(step.get(last, 0), this)
    return freed, step, round(ratio, 4)


def _grad_in_place_position(impl: Implementation, flat_vals: list, positions: list, flat_out: list):
    """The problem-input position whose gradient an in-place implementation writes into its
    output's gradient: its first tensor argument, if that is a problem node with the output's
    shape and dtype; else None (no in-place saving is claimed)."""
    if not impl.grad_in_place or len(flat_out) != 1:
        return None
    first = next(((pos, v) for pos, v in enumerate(flat_vals) if isinstance(v, torch.Tensor)), None)
    if first is None or positions[first[0]] is None:
        return None
    value, out = first[1], flat_out[0]
    if value.shape != out.shape or value.dtype != out.dtype:
        return None
    return positions[first[0]]


def _grad_shared_positions(
    fx_node: fx.Node, target: Any, kwargs: dict, in_place, flat_vals: list, positions: list, flat_out: list
) -> tuple[int, ...]:
    """Besides `in_place`, the problem-input positions an addition hands its gradient tensor to:
    its other tensor arguments of the output's shape and dtype (no reduction, no cast)."""
    if in_place is None or len(flat_out) != 1 or not shares_gradient(fx_node.op, target, kwargs):
        return ()
    out = flat_out[0]
    found = []
    for pos, value in enumerate(flat_vals):
        where = positions[pos]
        if where is None or where == in_place or where in found or not isinstance(value, torch.Tensor):
            continue
        if value.shape == out.shape and value.dtype == out.dtype:
            found.append(where)
    return tuple(found)


def _fwd_in_place_position(fx_node: fx.Node, target: Any, args: tuple, positions: list):
    """The problem-input position the runtime's default may write its output into (an in-place
    ReLU or addition on its first argument, `ScheduleExecutor._may_reuse`), if these arguments
    allow it; else None."""
    kind = _reuse_kind(fx_node, target)
    if kind is None or not args or not positions or positions[0] is None:
        return None
    y = args[1] if kind == "add" else None
    return positions[0] if reuse_arguments_allow(kind, args[0], y) else None


def _op_node(graph: OpGraph, name: str):
    return next((n for n in graph.nodes if n.name == name), None)


def _arg_layout(fx_node: fx.Node, args: tuple, kwargs: dict, problem_names: set[str]):
    """Per flat value leaf of (args, kwargs): its source fx node and its position in the
    problem node's `inputs`; and those inputs (problem nodes, in argument order, repeats kept)."""
    struct_leaves = tree_flatten((fx_node.args, fx_node.kwargs))[0]
    values = _leaf_values((fx_node.args, fx_node.kwargs), (args, kwargs))
    sources: list[fx.Node | None] = []
    positions: list[int | None] = []
    inputs: list[str] = []
    for item, value in zip(struct_leaves, values):
        is_node = isinstance(item, fx.Node)
        count = len(tree_flatten(value)[0]) if is_node else 1
        pos = None
        if is_node and item.name in problem_names:
            pos = len(inputs)
            inputs.append(item.name)
        sources += [item if is_node else None] * count
        positions += [pos] * count
    # nodes hidden where tree_flatten does not look (a slice bound: `w[: idx.shape[1]]`) are
    # inputs too: their values must be held until this node runs
    for node in fx_node.all_input_nodes:
        if node.name in problem_names and node.name not in inputs:
            inputs.append(node.name)
    return sources, positions, inputs


def _leaf_values(structure: Any, values: Any) -> list:
    """Pair each flat leaf of an fx argument structure with its (possibly nested) value."""
    if isinstance(structure, (list, tuple)) and not isinstance(structure, fx.Node):
        out = []
        for s, v in zip(structure, values):
            out.extend(_leaf_values(s, v))
        return out
    if isinstance(structure, dict):
        out = []
        for key in structure:
            out.extend(_leaf_values(structure[key], values[key]))
        return out
    return [values]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="node", leave=False)
