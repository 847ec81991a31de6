"""The optimizer step inside the backward: each parameter is updated, and its gradient freed,
as soon as its gradient is complete (PyTorch's "fuse the optimizer step into the backward pass").

A training step then never holds all parameter gradients at once: under a tight budget the
backward's late stages (where plain PyTorch holds nearly every gradient) get that memory back
for activations. The update equals a normal `optimizer.step()` for optimizers that treat each
parameter on its own (SGD, Adam, AdamW, ...); not for those that look across parameters
(LAMB's trust ratio over layers is per parameter and fine, gradient clipping by the global
norm is not). Users call only `loss.backward()`: no `optimizer.step()`, no `zero_grad()`.

* `OPTIMIZERS`: the optimizer names the command line knows, as factories.
* `step_bytes_per_param_byte(factory)`: the step's temporaries, measured (Adam: 2, SGD: 0).
* `steps_by_chunks(factory)`, `step_bytes(...)`: an optimizer that updates each element on its
  own (SGD, Adam, AdamW, ...: `ELEMENTWISE`) steps a large parameter in chunks of
  `CHUNK_ELEMENTS` elements, so its temporaries are those of one chunk, not of the parameter.
* `PerParameterSteps`: one optimizer per parameter (per chunk of it); `step(param, grad)`. The
  executor calls it.
* `fuse_into_backward(model, factory)`: the same for a plain model (post-accumulate-grad
  hooks), the baseline monet-opt's step-in-backward schedules are compared with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
FINGERPRINT_SUFFIX = ":step-in-backward"

# Chunked steps: the step's temporaries (Adam: 2 bytes per parameter byte) are those of one
# chunk. ResNet-50's layer-4 3x3 convolution (2.36M elements): Adam's temporaries 18 MiB -> 4 MiB,
# and its step alone 7.8 ms -> 2.6 ms on this CPU (2 threads); in whole ResNet-50 b8 224 training
# steps with the step fused, no difference in step time, peak 674.5 -> 665.9 MiB; the parameters
# are bitwise those of the whole-tensor step.
CHUNK_ELEMENTS = 1 << 19

# optimizers whose update of an element reads only that element's parameter, gradient and state
# (exact classes: a subclass may look across elements)
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)

OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
}


def optimizer_factory(optimizer: str | OptimizerFactory) -> OptimizerFactory:
    """The factory of a name in `OPTIMIZERS`, or `optimizer` itself if it is a factory."""
    if not isinstance(optimizer, str):
        return optimizer
    try:
        return OPTIMIZERS[optimizer]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r} (known: {', '.join(OPTIMIZERS)})") from None


def step_bytes_per_param_byte(factory: OptimizerFactory, device: torch.device | str = "cpu") -> float:
    """Peak bytes the optimizer's step allocates per byte of the parameter it updates, measured
    on a 1 Mi-element parameter after a first step (which makes the optimizer's state)."""
    from monet_opt.memory import measure_peak

    p = nn.Parameter(torch.zeros(1 << 20, device=device))
    opt = factory([p])
    p.grad = torch.ones_like(p)
    opt.step()
    p.grad = torch.ones_like(p)
    peak = measure_peak(opt.step).peak_bytes
    return peak / (p.numel() * p.element_size())


def steps_by_chunks(factory: OptimizerFactory) -> bool:
    """Whether `factory` makes an optimizer in `ELEMENTWISE` (its steps may run chunk by chunk),
    asked of one made for a 1-element CPU parameter (a factory that refuses one: no)."""
    try:
        probe = factory([nn.Parameter(torch.zeros(1))])
    except Exception:
        return False
    return type(probe) in ELEMENTWISE


def step_bytes(ratio: float, param_bytes: int, element_size: int, chunked: bool) -> int:
    """The temporaries of one parameter's step: `ratio` bytes per byte of what one step updates,
    the parameter or, stepped by chunks, at most `CHUNK_ELEMENTS` of its elements."""
    stepped = min(param_bytes, CHUNK_ELEMENTS * element_size) if chunked else param_bytes
    return math.ceil(ratio * stepped)


class PerParameterSteps:
    """One optimizer per parameter, made by `factory([param])`; for an `ELEMENTWISE` optimizer and
    a contiguous parameter of more than `CHUNK_ELEMENTS` elements, one per chunk of it (a 1-d view
    of the parameter's storage, re-pointed at the storage each step, so `param.data = ...` is
    followed). `optimizers[id(param)]`: the list of them.

    named: (name, parameter) pairs (`model.named_parameters()`): their optimizers are made now,
    so `all()` lists them before the first step (learning-rate schedulers: one per optimizer),
    and `state_dict()` names them. A parameter first seen in `step` gets its optimizers then.

    average_over_ranks: under torch.distributed (default process group, more than one rank),
    each gradient is averaged over the ranks (`all_reduce`, then divided by the world size, as
    DistributedDataParallel averages) before its step: the gradient never reaches `.grad`, so
    DDP's own reduction never sees it, and without this every rank would step with its own.
    """

    STATE_FORMAT = "monet-opt per-parameter steps"

    def __init__(
        self,
        factory: OptimizerFactory,
        chunk_elements: int = CHUNK_ELEMENTS,
        named: Iterable[tuple[str, nn.Parameter]] = (),
        average_over_ranks: bool = False,
    ) -> None:
        self.factory = factory
        self.average_over_ranks = average_over_ranks
        self.chunk_elements = chunk_elements if steps_by_chunks(factory) else None
        self.optimizers: dict[int, list[torch.optim.Optimizer]] = {}
        self.names: dict[int, str] = {}
        self._chunks: dict[int, list[tuple[torch.Tensor, int]]] = {}  # (view, first element)
        for name, param in named:
            self.names[id(param)] = name
            if param.requires_grad:
                self.optimizers[id(param)] = self._make(param)

    def all(self) -> list[torch.optim.Optimizer]:
        """Every optimizer made so far, parameter by parameter (a parameter's chunks in order)."""
        return [opt for opts in self.optimizers.values() for opt in opts]

    def state_dict(self) -> dict:
        """The optimizers' states by parameter name: {"format", "chunk_elements", "params": {name:
        [each chunk's `optimizer.state_dict()`]}}, for `torch.save` with the model's."""
        unnamed = [pid for pid in self.optimizers if pid not in self.names]
        if unnamed:
            raise ValueError(
                f"{len(unnamed)} stepped parameter(s) have no name; make PerParameterSteps with "
                "named=model.named_parameters()"
            )
        return {
            "format": self.STATE_FORMAT,
            "chunk_elements": self.chunk_elements,
            "params": {
                self.names[pid]: [opt.state_dict() for opt in opts] for pid, opts in self.optimizers.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict()` returned (same parameters by name, same chunking)."""
        if not isinstance(state, dict) or state.get("format") != self.STATE_FORMAT:
            raise ValueError(f"not a {self.STATE_FORMAT!r} state dict")
        if state["chunk_elements"] != self.chunk_elements:
            raise ValueError(
                f"the state was saved with parameters stepped in chunks of {state['chunk_elements']} "
                f"elements, these steps use {self.chunk_elements}"
            )
        ours = {self.names[pid]: opts for pid, opts in self.optimizers.items() if pid in self.names}
        saved = state["params"]
        missing, unexpected = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
        if missing or unexpected:
            raise ValueError(
                f"optimizer state does not match the parameters: missing {missing}, unexpected {unexpected}"
            )
        for name, opts in ours.items():
            if len(saved[name]) != len(opts):
                raise ValueError(f"parameter {name}: {len(saved[name])} chunk states saved, {len(opts)} here")
            for opt, sd in zip(opts, saved[name]):
                opt.load_state_dict(sd)

    def step(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if self.average_over_ranks:
            world = _world_size()
            if world > 1:
                torch.distributed.all_reduce(grad)
                grad.div_(world)
        opts = self.optimizers.get(id(param))
        if opts is None:
            opts = self.optimizers[id(param)] = self._make(param)
        chunks = self._chunks.get(id(param))
        if chunks is None:
            param.grad = grad
            opts[0].step()
            param.grad = None
            return
        if not param.is_contiguous():
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} stepped by chunks is no longer contiguous "
                "(its memory format changed after its first step)"
            )
        flat_grad = grad.contiguous().view(-1)
        storage, offset = param.untyped_storage(), param.storage_offset()
        with torch.no_grad():
            for opt, (view, start) in zip(opts, chunks):
                n = view.numel()
                if view.device != param.device or view.dtype != param.dtype:
                    view.data = param.new_empty(0)  # the model moved or was cast since: follow it
                view.set_(storage, offset + start, (n,), (1,))
                view.grad = flat_grad[start : start + n]
                opt.step()
                view.grad = None
        param.grad = None  # (as after a whole step: a hook's caller may have set it)

    def _make(self, param: nn.Parameter) -> list[torch.optim.Optimizer]:
        size = self.chunk_elements
        if size is None or param.numel() <= size or not param.is_contiguous():
            return [self.factory([param])]
        storage, offset, total = param.untyped_storage(), param.storage_offset(), param.numel()
        with torch.no_grad():
            chunks = [
                (param.new_empty(0).set_(storage, offset + a, (min(size, total - a),), (1,)), a)
                for a in range(0, total, size)
            ]
        self._chunks[id(param)] = chunks
        return [self.factory([view]) for view, _ in chunks]


def _world_size() -> int:
    """Ranks in torch.distributed's default process group (1 if there is none)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def fuse_into_backward(model: nn.Module, factory: OptimizerFactory) -> list:
    """Plain PyTorch with the step in the backward: each parameter steps when its gradient has
    been accumulated (`register_post_accumulate_grad_hook`). Returns the hook handles. One
    process only (the benchmarks' baseline): under DistributedDataParallel the hook fires before
    DDP has averaged the gradient; `MonetWrapper(..., optimizer=...)` averages it itself."""
    steps = PerParameterSteps(factory, named=model.named_parameters())

    def hook(param: torch.Tensor) -> None:
        steps.step(param, param.grad)

    return [p.register_post_accumulate_grad_hook(hook) for p in model.parameters() if p.requires_grad]
