"""MonetWrapper: an nn.Module that trains like the model, following a schedule."""

from __future__ import annotations

import copy
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

from monet_opt import autocast_regions, input_layout, root_hooks
from monet_opt.keyword_inputs import KeywordRoot, StructuredRoot, as_traceable
from monet_opt.runtime.executor import ScheduleExecutor
from monet_opt.runtime.model_slots import ModelSlots
from monet_opt.runtime.one_call import OneCall, why_not
from monet_opt.step_in_backward import FINGERPRINT_SUFFIX, PerParameterSteps, optimizer_factory
from solver.schedule import FingerprintMismatch, Schedule

# how many smaller input shapes' retraced graphs a wrapper keeps (`MonetWrapper._retrace`)
RETRACED_SHAPES = 32


class InputShapeMismatch(ValueError):
    """The input's shape (or dtype) differs from the one the schedule was solved for."""


_STEP_ANCHOR = torch.empty(0, requires_grad=True)


class _SpecBox:
    """What `_ScheduledStep` and `_Stash` of one step hand each other: the outputs' structure,
    the outputs (forward) and their gradients (backward)."""

    spec: Any = None
    outs: tuple | None = None
    grads: list | None = None


class _Stash(torch.autograd.Function):
    """The step's outputs, after `_ScheduledStep`, which returns a token: their gradients (the
    user's loss made them) reach this backward, which hands them over in `box` and returns
    the token's. The engine lets go of its inputs when a backward returns and holds those of
    the node it runs to the end: had `_ScheduledStep` taken them, it would have held every
    output's gradient through the whole schedule's backward (the memory model frees it after
    its node's backward, as plain PyTorch does: the test GPT's logits, 4 MiB of 47)."""

    @staticmethod
    def forward(ctx, box: _SpecBox, token: torch.Tensor):
        ctx.box = box
        ctx.token = (token.dtype, token.device)
        ctx.set_materialize_grads(False)  # (an output the loss does not read: None)
        outs, box.outs = box.outs, None
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.box.grads = list(grads)
        dtype, device = ctx.token
        return None, torch.empty(0, dtype=dtype, device=device)


class _ScheduledStep(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        executor: ScheduleExecutor,
        box: _SpecBox,
        grad_outputs,
        dropped: list[int],
        autocast: tuple,
        n_inputs: int,
        *tensors,
    ):
        inputs = tensors[:n_inputs]
        ctx.grad_outputs = grad_outputs
        ctx.params = tensors[n_inputs:]
        # an output the loss does not use gets no gradient (None), not zeros: a parameter only it
        # reads then keeps grad None, as in plain PyTorch (zeros would let weight decay, momentum
        # and Adam's state move it)
        ctx.set_materialize_grads(False)
        with _autocast(autocast):
            run, flat, spec = executor.run_forward(inputs)
        ctx.executor = executor
        ctx.run = run
        ctx.autocast = autocast
        box.spec = spec
        # (an output that is not a tensor, `(logits, None)`, passes through and gets no gradient)
        outs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in flat)
        # outputs the loop drops before the backward (`build_problem`'s outputs_held="loss"):
        # watched, so that one still held when the backward starts is reported
        ctx.dropped = [(k, weakref.ref(outs[k])) for k in dropped if isinstance(outs[k], torch.Tensor)]
        ctx.box = box
        box.outs = outs
        device = next((t.device for t in outs if isinstance(t, torch.Tensor)), None)
        return torch.empty(0, device=device)  # (the token `_Stash` takes: on the outputs' device)

    @staticmethod
    def backward(ctx, _token):
        grads, ctx.box.grads = ctx.box.grads, None  # (the outputs' gradients, from `_Stash`)
        if ctx.run is None:
            raise RuntimeError(
                "monet-opt: a wrapped forward's backward runs once (the schedule frees what it used "
                "as it goes): retain_graph=True and a second backward through the same forward are "
                "not supported; run the forward again"
            )
        if torch.is_grad_enabled():
            raise RuntimeError(
                "monet-opt: higher-order gradients (create_graph=True) through a wrapped model are "
                "not supported: its backward is not differentiable; use the plain model for them"
            )
        if ctx.grad_outputs is not None:
            extra = [k for k, g in enumerate(grads) if g is not None and k not in ctx.grad_outputs]
            if extra:
                raise RuntimeError(_unsolved_message(extra[0], ctx.grad_outputs))
        _warn_if_held(ctx.dropped)
        ctx.dropped = []
        with _autocast(ctx.autocast):
            input_grads = ctx.executor.run_backward(ctx.run, grads)  # (which empties grads)
        ctx.run = None
        names = [p.name for p in ctx.executor.placeholders]
        params, ctx.params = ctx.params, None
        return (
            None,
            None,
            None,
            None,
            None,
            None,
            *[input_grads.get(n) for n in names],
            *[input_grads.get(("param", id(p))) for p in params],
        )


def _refuse_unsolved_gradients(flat: list, grad_outputs: list[int]) -> list:
    """In the caller's graph, an output the schedule's loss does not read comes through
    `_Unsolved`, which refuses a gradient (as `_ScheduledStep.backward` does: its memory was not
    counted). Not a hook on the output: the model's own loss reads it inside (a Hugging Face
    model's logits), and that gradient is the schedule's."""
    return [
        _Unsolved.apply(t, k, grad_outputs)
        if k not in grad_outputs and isinstance(t, torch.Tensor) and t.requires_grad
        else t
        for k, t in enumerate(flat)
    ]


class _Unsolved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, k: int, grad_outputs: list[int]) -> torch.Tensor:
        ctx.k, ctx.grad_outputs = k, grad_outputs
        return t.view_as(t)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        raise RuntimeError(_unsolved_message(ctx.k, ctx.grad_outputs))


def _unsolved_message(k: int, grad_outputs: list[int]) -> str:
    return (
        f"monet-opt: the loss reads output {k} of the wrapped model, but the schedule was solved "
        f"for a loss reading only output(s) {grad_outputs} (the model's own loss): train on that "
        "loss, or solve with grad_outputs='all'"
    )


def _warn_if_held(dropped: list[tuple[int, weakref.ref]]) -> None:
    held = [(k, r()) for k, r in dropped if r() is not None]
    if held:
        k, tensor = held[0]
        # (outputs sharing a storage, e.g. views of one tensor, count it once)
        storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for _, x in held}
        mib = sum(storages.values()) / 2**20
        warnings.warn(
            f"monet-opt: the model's output {k} (shape {list(tensor.shape)}) is still held when the "
            "backward starts, but the schedule was solved for a loop that drops it once the loss is "
            f"computed (outputs_held='loss'): this step may use up to {mib:.1f} MiB more than predicted. "
            "Keep only the loss (`loss = model(**batch).loss`), or solve with outputs_held='all'",
            RuntimeWarning,
            stacklevel=2,
        )


def _autocast_state(device_type: str) -> tuple:
    if torch.is_autocast_enabled(device_type):
        return (device_type, torch.get_autocast_dtype(device_type))
    return ()


class _autocast:
    """The caller's autocast, without its cache of weight casts: that cache lives until the
    outermost autocast exits, so the lower-precision copies of the weights of every node the step
    ran without a graph (to recompute later), or recomputed in the backward, piled up (resnet18
    under bfloat16 at its lowest budget: 1.7 MB over the prediction). Each cast is made where
    used and freed with it, as the profile measured."""

    def __init__(self, state: tuple) -> None:
        self.ctx = torch.autocast(state[0], dtype=state[1], cache_enabled=False) if state else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"schedule meta names an unknown input dtype {name!r}")
    return dtype


def resolve_schedule(schedule: Schedule | str | Path, input_shape: tuple[int, ...] | None = None) -> Schedule:
    """A Schedule, from itself, a JSON path, or a shipped-schedule shortcut ("resnet50@0.5"),
    whose batch and image size come from `input_shape` (the first input's) unless it names them."""
    if isinstance(schedule, Schedule):
        return schedule
    if not isinstance(schedule, (str, Path)):
        # (a baseline that found no fitting schedule returns None)
        raise TypeError(
            "MonetWrapper needs a solver.Schedule, the path of its JSON file or a shipped-schedule "
            f"shortcut such as 'resnet50@0.5', not {type(schedule).__name__}"
        )
    path = Path(schedule)
    if path.exists() or str(schedule).endswith(".json"):
        return Schedule.from_json(path)
    from monet_opt.zoo import load_schedule_by_shortcut

    return load_schedule_by_shortcut(str(schedule), input_shape)


def _flat_dims(input_shape) -> list:
    out = []
    for d in input_shape:
        out.extend(_flat_dims(d) if isinstance(d, (tuple, list)) else [d])
    return out


def _first_shape(input_shape, example_inputs) -> tuple[int, ...] | None:
    if isinstance(example_inputs, Mapping):  # (by keyword: the first tensor's)
        example_inputs = [v for v in example_inputs.values() if isinstance(v, torch.Tensor)][:1] or None
    if example_inputs is not None:
        first = example_inputs if isinstance(example_inputs, torch.Tensor) else example_inputs[0]
        return tuple(first.shape) if isinstance(first, torch.Tensor) else None
    if input_shape is None or len(input_shape) == 0:
        return None
    return tuple(input_shape) if isinstance(input_shape[0], int) else tuple(input_shape[0])


def _without_model_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """A state_dict hook: the wrapper's entries under `prefix + 'model.'` move to `prefix`."""
    _rename_under(state_dict, prefix + "model.", prefix)


def _with_model_prefix(state_dict: dict, prefix: str, *_: Any) -> None:
    """A load_state_dict pre-hook: entries under `prefix` not already under `prefix + 'model.'`
    (a plain model's checkpoint) move there."""
    _rename_under(state_dict, prefix, prefix + "model.", skip=prefix + "model.")


def _rename_under(state_dict: dict, old: str, new: str, skip: str | None = None) -> None:
    """Rename the keys starting with `old` (but not `skip`) to start with `new`, in order, and
    the per-module metadata (`_metadata`: versions) with them."""

    def moves(key: str) -> bool:
        return key.startswith(old) and not (skip is not None and key.startswith(skip))

    for key in [k for k in state_dict if moves(k)]:
        state_dict[new + key[len(old) :]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        # (keyed by module path, 'model.0', the root's ''; its keys' prefix is the path and a dot)
        for path in [m for m in metadata if moves(m + "." if m else "")]:
            dotted = new + (path + "." if path else "")[len(old) :]
            metadata[dotted[:-1]] = metadata.pop(path)


class MonetWrapper(nn.Module):
    """Wrap `model` so its training steps follow `schedule`.

    schedule: a `solver.Schedule`, a path to its JSON, or a shipped-schedule
    shortcut such as "resnet50@0.5". input_shape: the shape (or tuple of shapes)
    the schedule was solved for; or example_inputs: tensors of those shapes (a tuple), or
    by keyword (a dict, as the schedule was solved with: `monet_opt.keyword_inputs`; the
    wrapper then returns the model's own output structure, a Hugging Face ModelOutput).
    In eval mode, or under no_grad, the model runs plainly. A schedule that recomputes nothing,
    the whole model one shared graph (`ScheduleExecutor.attachable`), runs in the caller's
    autograd graph: its backward is plain PyTorch's (`_attaches`). An input smaller than the solved
    one (no dimension larger: an epoch's last batch, a shorter sequence) runs the schedule
    too, once its traced graph is checked to run as the model at that shape (where the trace
    fixed the shape, as Hugging Face models' do, the model is traced again at it, once per
    shape, and must give the same graph but for the sizes); a larger one is refused
    (`InputShapeMismatch`).

    optimizer: for a schedule solved with the optimizer step in the backward
    (`build_problem(..., optimizer=...)`), the same optimizer: a factory
    (`params -> torch.optim.Optimizer`, called once per parameter) or a name in
    `monet_opt.step_in_backward.OPTIMIZERS`. Each parameter is then updated inside
    `loss.backward()` as soon as its gradient is complete, and `.grad` stays None:
    call neither `optimizer.step()` nor `zero_grad()`. The per-parameter optimizers (per chunk
    of a large parameter) are `wrapper.steps.all()`, made here (a learning-rate scheduler: one
    per optimizer); `wrapper.steps.state_dict()` / `load_state_dict()` save and restore them by
    parameter name.
    Under torch.distributed (more than one rank) each parameter's gradient is averaged over the
    ranks before its step, as DistributedDataParallel would (the wrapper may be wrapped in DDP
    or not: DDP never sees these gradients).

    `state_dict()` holds the model's own keys (no 'model.' prefix), so a checkpoint saved from
    the wrapper loads into the plain model and back; `load_state_dict` takes either form.
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: Schedule | str | Path,
        input_shape: tuple[int, ...] | list[tuple[int, ...]] | None = None,
        example_inputs: Any = None,
        optimizer: Any = None,
    ) -> None:
        super().__init__()
        self.model = model
        # the model's keys, without 'model.', both ways (checkpoints interchangeable with plain's)
        self._register_state_dict_hook(_without_model_prefix)
        self._register_load_state_dict_pre_hook(_with_model_prefix)
        if input_shape is not None and any(isinstance(d, torch.Tensor) for d in _flat_dims(input_shape)):
            raise TypeError("input_shape takes shapes; pass example tensors as example_inputs=(x,)")
        self.schedule = resolve_schedule(schedule, _first_shape(input_shape, example_inputs))
        made_up = example_inputs is None  # zeros of the given shapes stand in for real inputs
        if made_up and "input_structure" in self.schedule.meta:
            raise ValueError(
                "the schedule was solved for inputs holding containers of tensors "
                f"({self.schedule.meta['input_structure']}): pass example_inputs=(...) with them"
            )
        if example_inputs is None:
            if input_shape is None:
                shapes = self.schedule.meta.get("input_shapes")
                if not shapes:
                    raise ValueError("give input_shape (the shape the schedule was solved for)")
            else:
                shapes = [input_shape] if isinstance(input_shape[0], int) else list(input_shape)
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            # zeros of the dtypes the schedule was solved for (token ids: int64), float32 if unsaid
            dtypes = self.schedule.meta.get("input_dtypes") or []
            if len(dtypes) != len(shapes):
                dtypes = ["float32"] * len(shapes)
            example_inputs = tuple(
                torch.zeros(tuple(s), dtype=_dtype(d), device=device) for s, d in zip(shapes, dtypes)
            )
        names = self.schedule.meta.get("input_names")
        if names and not isinstance(example_inputs, Mapping) and not isinstance(model, KeywordRoot):
            # solved by keyword: tensors given in the names' order (or made up) are those inputs
            given = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
            if len(names) == len(given):
                example_inputs = {**dict(zip(names, given)), **self.schedule.meta.get("input_constants", {})}
        # inputs by keyword ({'input_ids': ids, 'use_cache': False}), or holding containers (a
        # batch dict): traced through a root that takes their tensors positionally and returns the
        # output's tensors flat (`monet_opt.keyword_inputs`)
        root, example_inputs = as_traceable(model, example_inputs)
        # (kept off the module tree: the model is registered once, as `self.model`)
        object.__setattr__(self, "_root", root if root is not model else None)
        object.__setattr__(self, "_keyword_root", root if isinstance(root, KeywordRoot) else None)
        # traced under the autocast the schedule was profiled under, whatever the caller's is (the
        # fingerprint holds the nodes' dtypes): its metadata says it (`build_problem` records it),
        # no record in metadata from build_problem means none; a schedule without that metadata
        # (solver.solve's own) is traced under the caller's
        graph = self._trace(root, example_inputs)
        _check_step_in_backward(self.schedule, graph.fingerprint, optimizer)
        _warn_if_profiled_elsewhere(self.schedule, example_inputs)
        expected = graph.fingerprint + (FINGERPRINT_SUFFIX if optimizer is not None else "")
        try:
            self.schedule.check_fingerprint(expected)
        except FingerprintMismatch as exc:
            raise FingerprintMismatch(
                f"{exc}{_what_differs(self.schedule, example_inputs, made_up)}"
            ) from None
        _check_weight_layouts(self.schedule, model)
        # the flat output positions the schedule's loss reads (None: every output; a model that
        # returns its loss is solved for it alone, `build_problem`'s grad_outputs)
        self.grad_outputs = self.schedule.meta.get("grad_outputs")
        # the flat output positions the training loop drops before the backward (outputs_held)
        self.dropped_outputs = list(self.schedule.meta.get("dropped_outputs", []))
        self.input_shapes = [tuple(x.shape) for x in example_inputs]
        self._smaller_shapes: list[list[tuple[int, ...]]] = []  # smaller shapes checked to run it
        # smaller shapes the traced graph fixed (a view's sizes): the model traced at each, the
        # schedule on that graph; the most recently used RETRACED_SHAPES kept
        self._retraced: OrderedDict[tuple, ScheduleExecutor] = OrderedDict()
        self._warned_autocast = False
        self._warned_global_hooks = False
        self.input_dtypes = [x.dtype for x in example_inputs]
        # the memory format each input was profiled in (what build_problem recorded, or the examples')
        self.input_layouts = self.schedule.meta.get("input_layouts") or [
            input_layout.layout_of(x) for x in example_inputs
        ]
        # the parameters the schedule was solved with frozen (the fingerprint says which), by name
        self._solved_frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        self._list_params()
        self.steps = None
        if optimizer is not None:
            self.steps = PerParameterSteps(
                optimizer_factory(optimizer), named=model.named_parameters(), average_over_ranks=True
            )
        self.executor = self._executor(graph)
        self._structure = graph.structure  # (a graph traced again may differ in its constants only)
        # what the graph was traced from: a submodule, parameter, buffer or hook put on the model
        # since is followed by tracing it again (`_follow_model`)
        self._slots = self._model_slots()

    def _list_params(self) -> None:
        """The model's parameters, listed once per trace (walking the modules every step cost
        ~0.2 ms on a small GPT; which need gradients is asked every step), and which of them the
        schedule was solved to train (by name: a parameter put where a frozen one was solved gets
        no gradient either)."""
        named = list(self.model.named_parameters())
        self._all_params = [p for _, p in named]
        self._solved_trainable = [name not in self._solved_frozen for name, _ in named]

    def _model_slots(self) -> ModelSlots:
        """The model's slots, those inside the modules its graph calls whole left out."""
        prefix = "model." if self._root is not None else ""  # (the root holds the model as .model)
        leaves = {
            str(n.target).removeprefix(prefix) for n in self.executor.gm.graph.nodes if n.op == "call_module"
        }
        return ModelSlots(self.model, leaves)

    def _trace(self, root: nn.Module, inputs: tuple) -> Any:
        """`root` traced on `inputs` under the autocast the schedule was profiled under."""
        from monet_opt.graph import trace

        with autocast_regions.under(self._profiled_autocast(self.model)):
            return trace(root, inputs)

    def _executor(self, graph: Any) -> ScheduleExecutor:
        """The schedule on a traced graph (its optimizer steps in the backward, if any)."""
        executor = ScheduleExecutor(graph.gm, self.schedule)
        if self.steps is not None:
            executor.step_in_backward(self.steps.step)
        return executor

    def forward(self, *inputs: Any, **named: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            # the model itself, not the traced graph: a trace fixes what Python read while it ran
            # (`self.training`, so a functional dropout's p; with concrete shapes, the shapes)
            return self.model(*inputs, **named)
        if torch.compiler.is_compiling():
            # torch.compile(wrapper): the step runs eagerly, nothing it calls compiled (dynamo
            # compiled pieces of the executor between graph breaks, and the gradients came out
            # wrong, silently). (Compiling, dynamo is imported: no start-up cost otherwise.)
            import torch._dynamo as dynamo

            return dynamo.disable(self._hooked_step, reason="monet-opt runs its schedule eagerly")(
                inputs, named
            )
        return self._hooked_step(inputs, named)

    def _hooked_step(self, inputs: tuple, named: dict[str, Any]) -> Any:
        """The training step, inside the hooks registered on the model itself if it has any
        (the graph is of its forward: `monet_opt.root_hooks`)."""
        if root_hooks.any_on(self.model):
            return root_hooks.through(self.model, lambda *a, **k: self._training_step(a, k), inputs, named)
        return self._training_step(inputs, named)

    def __getstate__(self) -> dict:
        raise TypeError(
            "monet-opt: a MonetWrapper is not pickled (torch.save(wrapped) saves the whole object, and "
            "it holds code generated for its traced graph): save wrapped.state_dict() (the model's own "
            "keys) and wrap the model again with the schedule's JSON after loading. copy.deepcopy works"
        )

    def __deepcopy__(self, memo: dict) -> MonetWrapper:
        """A copy wrapping a copy of the model (an EMA model), as deepcopy makes of any module:
        pickling's state is refused (`__getstate__`), deepcopy copies the attributes instead."""
        if self.steps is not None:
            raise TypeError(
                "monet-opt: a wrapper with the optimizer step in the backward is not deep-copied (its "
                "per-parameter optimizers are keyed by the parameters): copy the model, and wrap the "
                "copy if it is to train"
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return copied

    def _training_step(self, inputs: tuple, named: dict[str, Any]) -> Any:
        if not self._warned_global_hooks and (kinds := root_hooks.global_hooks()):
            self._warned_global_hooks = True
            warnings.warn(
                f"monet-opt: global module {' and '.join(kinds)} are registered "
                "(torch.nn.modules.module.register_module_*_hook): a wrapped training step runs them "
                "where its graph calls a module whole, at each call (again when it recomputes the "
                "module), and not for modules the trace went through; plain PyTorch runs them once "
                "per module call. Eval steps run the model plainly",
                RuntimeWarning,
                stacklevel=4,
            )
        if isinstance(self._root, StructuredRoot):
            if named:
                raise TypeError("monet-opt: the schedule was traced with structured positional inputs only")
            inputs = self._root.flat_inputs(inputs)
        if self._keyword_root is not None:
            named = self._without_constants(named)
        if named:
            inputs = self._positional(inputs, named)
        shapes = [tuple(x.shape) for x in inputs]
        changed = self._slots.changed()
        if changed:
            self._follow_model(changed, inputs, shapes)
        if shapes != self.input_shapes and shapes not in self._smaller_shapes:
            self._admit_smaller(inputs, shapes)
        executor = self._retraced.get(tuple(shapes), self.executor)
        if executor is not self.executor:
            self._retraced.move_to_end(tuple(shapes))
        dtypes = [x.dtype for x in inputs]
        if dtypes != self.input_dtypes:
            raise InputShapeMismatch(
                f"input dtype {[str(d).removeprefix('torch.') for d in dtypes]} differs from the one the "
                f"schedule was solved for {[str(d).removeprefix('torch.') for d in self.input_dtypes]}; "
                "convert the input (autocast changes compute dtypes, not the input's), or solve for it"
            )
        for k, (x, solved) in enumerate(zip(inputs, self.input_layouts)):
            now = input_layout.layout_of(x)
            if input_layout.differs(now, solved):
                raise InputShapeMismatch(
                    f"input {k} is laid out {now}, the schedule was solved for {solved} inputs (its "
                    f"memory model does not hold: other kernels and temporaries); convert it "
                    f"({'x.contiguous()' if solved == 'contiguous' else 'x.contiguous(memory_format=torch.' + solved + ')'}) "
                    "or solve with inputs laid out so"
                )
        device_type = inputs[0].device.type if inputs and isinstance(inputs[0], torch.Tensor) else "cpu"
        if any(p.requires_grad and not t for p, t in zip(self._all_params, self._solved_trainable)):
            self._refuse_unfrozen()
        autocast = self._checked_autocast(device_type)
        if self._attaches(executor):
            # nothing recomputed, the model one plain graph: built in the caller's graph, whose
            # backward is then the engine's own, as plain PyTorch's (`ScheduleExecutor.run_forward`)
            with _autocast(autocast):
                _, flat, spec = executor.run_forward(inputs, attached=True)
            if self.grad_outputs is not None:
                flat = _refuse_unsolved_gradients(flat, self.grad_outputs)
            out = tree_unflatten(flat, spec)
        elif (one_call := self._one_call(executor, autocast)) is not None:
            # recomputing, run inside the caller's one backward call (`runtime/one_call.py`)
            flat, spec = one_call.run_forward(inputs)
            if self.grad_outputs is not None:
                flat = _refuse_unsolved_gradients(flat, self.grad_outputs)
            out = tree_unflatten(flat, spec)
        else:
            box = _SpecBox()
            # the parameters, whose gradients leave through the step's node; with the optimizer
            # step in the backward none do (each steps inside it), and an anchor stands in so the
            # outputs require grad: given the parameters, the engine ran their hooks a second
            # time, on None
            trainable = [p for p in self._all_params if p.requires_grad]
            params = trainable if self.steps is None else [_STEP_ANCHOR]
            token = _ScheduledStep.apply(
                executor,
                box,
                self.grad_outputs,
                self.dropped_outputs,
                autocast,
                len(inputs),
                *inputs,
                *params,
            )
            flat = _Stash.apply(box, token)
            out = tree_unflatten(list(flat), box.spec)
        if self._root is not None:  # the model's own output structure (a ModelOutput)
            return tree_unflatten(list(out), self._root.out_spec)
        return out

    def _attaches(self, executor: ScheduleExecutor) -> bool:
        """Whether this step runs in the caller's graph (`ScheduleExecutor.attachable`): not
        with the optimizer step in the backward (the executor's backward steps it), outputs
        dropped before the backward (the wrapper's node warns of one still held) or an observer
        of its stages or nodes (`ScheduleExecutor.observers`)."""
        return (
            executor.attachable and self.steps is None and not self.dropped_outputs and not executor.observers
        )

    def _one_call(self, executor: ScheduleExecutor, autocast: tuple) -> OneCall | None:
        """The schedule's run inside the caller's backward call (`runtime/one_call.py`), where the
        schedule allows it (`one_call.why_not`) and nothing needs the wrapper's own autograd node
        (as `_attaches`), without autocast; else None."""
        if self.steps is not None or self.dropped_outputs or executor.observers or autocast:
            return None
        if executor.one_call is False:
            executor.one_call = OneCall(executor) if why_not(executor) is None else None
        one_call = executor.one_call
        return one_call if one_call is not None and one_call.usable() else None

    def _refuse_unfrozen(self) -> None:
        solved = {id(p) for p, t in zip(self._all_params, self._solved_trainable) if t}
        unfrozen = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in solved]
        raise RuntimeError(
            f"monet-opt: parameter(s) {unfrozen[:3]}{' ...' if len(unfrozen) > 3 else ''} "
            f"({len(unfrozen)} in all) require grad now but were frozen when this wrapper was built: "
            "the schedule computes no gradient for them and does not count their memory. Solve a "
            "schedule with them trainable and wrap again (freezing more than was solved is fine)"
        )

    def _profiled_autocast(self, model: nn.Module) -> autocast_regions.Spec | None:
        meta = self.schedule.meta
        if "autocast" in meta:
            return autocast_regions.from_json(meta["autocast"])
        if "device" not in meta:
            return None
        device_type = next((p.device.type for p in model.parameters()), "cpu")
        return ((device_type, False, torch.get_autocast_dtype(device_type)),)

    def _checked_autocast(self, device_type: str) -> tuple:
        """The caller's autocast state; a warning, once, if a schedule whose metadata says what it
        was profiled under (solve_model, the command line) was profiled under another: its memory
        model is that one's (a float32 schedule under bfloat16 autocast keeps a bfloat16 copy of
        every weight a convolution or linear saves: resnet18 b4 64x64 measured 2 % over)."""
        state = _autocast_state(device_type)
        meta = self.schedule.meta
        if "device" in meta and not self._warned_autocast:
            recorded = [(d, t) for d, on, t in meta.get("autocast", []) if on and d == device_type]
            now = [(state[0], str(state[1]).removeprefix("torch."))] if state else []
            if recorded != now:
                self._warned_autocast = True
                warnings.warn(
                    f"monet-opt: this step runs under autocast {now or 'off'}, but the schedule was "
                    f"profiled under {recorded or 'none'}: its memory model may not hold. Solve under "
                    "the autocast you train with (build_problem / solve_model inside the autocast "
                    "block; command line: --autocast)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return state

    def _admit_smaller(self, inputs: tuple, shapes: list[tuple[int, ...]]) -> None:
        """Let an input smaller than the solved one (no dimension larger: an epoch's last, partial
        batch, a shorter sequence) run the schedule: each tensor of its step is no larger than
        the solved step's, so neither is its peak. Checked once per shape: the traced graph must
        run as the model does at it; traced at one shape, it may have fixed that shape (Hugging
        Face models' views fix batch and sequence length): the model is then traced at this
        shape, and the schedule runs on that graph if it has the solved graph's nodes and data
        flow (`_retrace`)."""
        from monet_opt.graph import TraceError, check_graph

        solved = self.input_shapes
        if not self._smaller(shapes):
            raise InputShapeMismatch(
                f"input shape {shapes} differs from the shape the schedule was solved for {solved}; "
                "a smaller input (no dimension larger) runs this schedule, a larger one needs a "
                "schedule solved for its shape"
            )
        try:
            check_graph(self.executor.gm, self._root or self.model, inputs)
        except TraceError:
            self._retraced[tuple(shapes)] = self._retrace(inputs, shapes)
            if len(self._retraced) > RETRACED_SHAPES:
                evicted, _ = self._retraced.popitem(last=False)
                self._smaller_shapes.remove(list(evicted))
        self._smaller_shapes.append(shapes)

    def _smaller(self, shapes: list[tuple[int, ...]]) -> bool:
        """Whether `shapes` are the solved input shapes with no dimension larger."""
        solved = self.input_shapes
        return len(shapes) == len(solved) and all(
            len(a) == len(b) and all(x <= y for x, y in zip(a, b)) for a, b in zip(shapes, solved)
        )

    def _retrace(self, inputs: tuple, shapes: list[tuple[int, ...]]) -> ScheduleExecutor:
        """The schedule on the model traced at `shapes`, whose graph must be the solved one but
        for the sizes its nodes were traced with (InputShapeMismatch otherwise, naming where)."""
        from monet_opt.graph import TraceError, graph_difference

        refused = (
            f"input shape {shapes} is smaller than the one the schedule was solved for "
            f"{self.input_shapes}, but the traced graph does not run as the model at this shape, "
            "and traced at it"
        )
        inputs = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs)
        try:
            graph = self._trace(self._root or self.model, inputs)
        except TraceError as exc:
            raise InputShapeMismatch(
                f"{refused} the model does not trace: {exc} Solve a schedule for this shape."
            ) from None
        where = graph_difference(self.executor.gm, graph.gm)
        if where is not None:
            raise InputShapeMismatch(
                f"{refused} its graph differs from the solved one ({where}: shape-dependent "
                "control flow). Solve a schedule for this shape, or pad the input to the solved shape."
            )
        return self._executor(graph)

    def _follow_model(self, changed: list[str], inputs: tuple, shapes: list[tuple[int, ...]]) -> None:
        """The model holds other submodules, parameters, buffers, hooks or Python values
        (`changed`, `ModelSlots`) than the graph was traced from (a head replaced,
        `model.to(device)` moving buffers, a temperature annealed): it is traced
        again, at the solved shape (this step's inputs, or zeros of their dtypes at the solved
        shape), and the schedule runs on the new graph if it has the solved graph's structure:
        its nodes, data flow, sizes and dtypes (the constants in it may differ;
        `graph._fingerprint`); FingerprintMismatch otherwise, naming
        the change. Traced again, it is said in a warning (a value changed every step is better
        kept in a buffer, which the graph reads when it runs)."""
        from monet_opt.graph import TraceError

        names = ", ".join(repr(c) for c in changed[:3]) + (
            f" ({len(changed)} in all)" if len(changed) > 3 else ""
        )
        what = f"{names} on the model changed since it was wrapped"
        _check_weight_layouts(self.schedule, self.model)  # (before tracing: another memory model)
        if self.steps is not None:
            raise RuntimeError(
                f"monet-opt: {what}; the optimizer steps in the backward hold the parameters it was "
                "wrapped with: wrap the model again"
            )
        if shapes == self.input_shapes:
            examples = tuple(x.detach() for x in inputs)
        elif not self._smaller(shapes):
            return  # refused as any larger input is (`_admit_smaller`)
        else:
            examples = tuple(
                torch.zeros(s, dtype=x.dtype, device=x.device) for s, x in zip(self.input_shapes, inputs)
            )
        start = time.perf_counter()
        try:
            graph = self._trace(self._root or self.model, examples)
        except TraceError as exc:
            raise TraceError(f"monet-opt: {what}, and tracing it again failed: {exc}") from None
        if graph.structure != self._structure:
            raise FingerprintMismatch(
                f"monet-opt: {what}, and the model traced again is not the one the schedule was "
                "solved for (its operations, their data flow, sizes or dtypes differ): solve a "
                "schedule for it"
                + (
                    " (a submodule with hooks is traced as one node, so the graph changed: register "
                    "hooks before solving)"
                    if any(c.endswith("hooks)") for c in changed)
                    else " (a module traced through in another train/eval mode runs other code: set "
                    "the modes before solving)"
                    if any(c.endswith(".training") for c in changed)
                    else ""
                )
            )
        warnings.warn(
            f"monet-opt: {what}: traced it again ({time.perf_counter() - start:.2f} s), the schedule "
            "runs on the new graph (a value changed every step is better kept in a tensor buffer, "
            "which the graph reads as it runs, than traced again each time)",
            RuntimeWarning,
            stacklevel=7,  # (the caller of wrapped(...))
        )
        self.executor = self._executor(graph)
        self._retraced.clear()
        self._smaller_shapes.clear()
        self._list_params()
        self._slots = self._model_slots()

    def _without_constants(self, named: dict[str, Any]) -> dict[str, Any]:
        """The keywords without the constants the schedule was traced with (`use_cache=False`);
        a constant given another value is refused (the traced steps run with the traced one)."""
        constants = self._keyword_root.constants
        for k, v in named.items():
            if k in constants and not (type(v) is type(constants[k]) and v == constants[k]):
                raise ValueError(
                    f"monet-opt: {k}={v!r}, but the schedule was traced with {k}={constants[k]!r}; "
                    f"training steps run it so: pass {constants[k]!r} or leave it out (eval mode runs "
                    "the model itself, with what it is given)"
                )
        return {k: v for k, v in named.items() if k not in constants}

    def _positional(self, inputs: tuple, named: dict[str, Any]) -> tuple:
        """Inputs given by keyword, in the traced model's order (its forward's argument names)."""
        names = [str(p.target) for p in self.executor.placeholders]
        unknown = [k for k in named if k not in names]
        if unknown:
            raise TypeError(
                f"monet-opt: the wrapped model got input {unknown[0]!r}, which the traced forward does "
                f"not take: its inputs are {names} (an argument left at its default when the schedule "
                "was solved stays so; solve with it given to pass it)"
            )
        twice = [k for k in named if k in names[: len(inputs)]]
        if twice:
            raise TypeError(f"monet-opt: input {twice[0]!r} given both by position and by keyword")
        missing = [n for n in names[len(inputs) :] if n not in named]
        if missing:
            raise TypeError(
                f"monet-opt: the wrapped model needs input {missing[0]!r} (its inputs are {names})"
            )
        return (*inputs, *(named[n] for n in names[len(inputs) :]))


def _what_differs(schedule: Schedule, example_inputs: tuple, made_up: bool) -> str:
    """What a fingerprint mismatch comes from, where the schedule's metadata can tell."""
    solved = schedule.meta.get("input_shapes")
    shapes = [list(x.shape) for x in example_inputs if isinstance(x, torch.Tensor)]
    if solved and [list(s) for s in solved] != shapes:
        return f". It was solved for input shapes {[tuple(s) for s in solved]}, these are {[tuple(s) for s in shapes]}"
    if solved and made_up:
        return (
            ". The input shapes agree, so the traced graph differs: the model (its layers, their sizes or "
            "dtypes, or which parameters are frozen) differs, or, if the model's shapes or control flow "
            "depend on the input's values, pass a real batch as example_inputs=(x,) instead of input_shape"
        )
    if solved:
        return (
            ". The input shapes agree: the model (its layers, their sizes or dtypes, or which "
            "parameters are frozen) differs"
        )
    return ""


def _warn_if_profiled_elsewhere(schedule: Schedule, example_inputs: tuple) -> None:
    """A warning where the schedule was profiled on another kind of device than the model runs
    on (a schedule solved on a CPU, a GPU of another name): its memory and time model are that
    device's kernels' (workspaces, algorithms), not this one's."""
    recorded = schedule.meta.get("device")  # ('cuda: NVIDIA A100...; torch 2.x', profile.device_fingerprint)
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), None)
    if not isinstance(recorded, str) or device is None:
        return
    kind, _, name = recorded.partition(":")
    here = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    if kind != device.type or (here is not None and not name.strip().startswith(here)):
        warnings.warn(
            f"monet-opt: this schedule was profiled on {recorded.split(';')[0]!r}, the model runs on "
            f"{device.type}{': ' + here if here else ''}: its memory and time model are the other "
            "device's kernels' (their workspaces and algorithms); solve on the device you train on "
            "(`monet-opt solve ... --device`) for a peak that holds here",
            RuntimeWarning,
            stacklevel=3,
        )


def _check_weight_layouts(schedule: Schedule, model: nn.Module) -> None:
    """FingerprintMismatch where the model's convolution weights are laid out otherwise than when
    the schedule was profiled (a model converted to channels_last since, or back): its
    convolutions run other kernels with other temporaries. Checked when the wrapper is made, and
    when the slot check sees a weight's strides change (`model.to(memory_format=...)` after
    wrapping keeps the Parameter objects)."""
    solved = schedule.meta.get("weight_layouts")
    now = input_layout.weight_layouts(model)
    if not isinstance(solved, dict):
        # (a schedule from before session 45, as the shipped ones, or solver.solve's own)
        if set(now.values()) != {input_layout.CONTIGUOUS} and "input_shapes" in schedule.meta:
            warnings.warn(
                f"monet-opt: the model's weights are laid out {now}, and this schedule does not "
                "record the layout it was profiled with (made before monet-opt recorded it, most "
                "likely for contiguous weights): if so, its memory model does not hold for this "
                "model; solve for the model as it is",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    for dim, layout in now.items():
        if dim in solved and solved[dim] != layout:
            raise FingerprintMismatch(
                f"the model's {dim}-dimensional weights are laid out {layout}, the schedule was solved "
                f"for {solved[dim]} ones (its memory model does not hold: other kernels and "
                "temporaries); convert the model back, or solve for it as it is"
            )


def _check_step_in_backward(schedule: Schedule, fingerprint: str, optimizer: Any) -> None:
    """A clear error where the schedule and the wrapper disagree on the optimizer step."""
    solved_with = schedule.fingerprint.endswith(FINGERPRINT_SUFFIX)
    if schedule.fingerprint.removesuffix(FINGERPRINT_SUFFIX) != fingerprint:
        return  # another model or shape: check_fingerprint says so
    if solved_with and optimizer is None:
        raise FingerprintMismatch(
            "this schedule was solved with the optimizer step in the backward (parameter gradients "
            "freed as they are made); pass the optimizer: MonetWrapper(..., optimizer=...)"
        )
    if optimizer is not None and not solved_with:
        raise FingerprintMismatch(
            "optimizer= given, but this schedule was solved without the optimizer step in the "
            "backward; solve with build_problem(..., optimizer=...) (CLI: --step-in-backward)"
        )
