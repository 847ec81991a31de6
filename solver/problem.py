"""The problem: an operator DAG with measured costs. Plain data, versioned JSON, no torch.

A `Problem` is what `monet_opt.build_problem` produces and what every strategy in
`solver` consumes. Nodes are in topological order; a node's `inputs` name earlier
nodes only (the model's own inputs and parameters live outside the problem: they
exist before the step and are not counted).

Bytes are storage bytes. The memory model that gives them meaning is written once,
in `solver.simulate`'s docstring.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from solver.jsonio import atomic_write_text, read_json_object

# 2: Impl.grad_in_place; 3: Impl.recompute_time; 4: Impl.fwd_in_place, Impl.grad_shared;
# 6: Node.restores; 7: Problem.recompute_overhead_s; 8: Impl.grad_shared without grad_in_place;
# 9: Node.output_grad; 10: Node.user_holds; 11: Impl.bwd_from_inputs; 12: Node.deferred_param_grad_bytes
# 13: Impl.nograd_fwd_workspace
PROBLEM_FORMAT_VERSION = 13
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)  # (older files still load)


class ProblemError(ValueError):
    """A problem file or object is malformed; the message names the field."""


@dataclass(frozen=True)
class Impl:
    """One way to run a node, with its measured costs.

    keeps_inputs: positions in `Node.inputs` whose storage the backward state holds.
    keeps_output: the backward state holds the node's own output storage.
    state_bytes: private bytes the backward state holds besides those storages
        (batch-norm statistics, a 1-bit ReLU mask, packed pooling indices, ...).
    fwd_workspace / bwd_workspace: transient bytes during the call, beyond the
        output (forward) or the new input gradients (backward). `fwd_workspace` is of a
        computation with grad, beyond its output and `state_bytes`.
    nograd_fwd_workspace: transient bytes of a computation without grad (one that makes no
        backward state) beyond its output; None: `fwd_workspace`. It may exceed
        `fwd_workspace`: without grad a node still makes, and frees, some of what it keeps with
        grad (autocast's lower-precision copies of its input and weight, which the kernel
        reads; a ReLU's bitmask; pooling indices). See `forward_workspace`.
    recompute_time: forward time when the node runs again in a backward stage, if it
        differs from `fwd_time` (batch norm recomputed from the batch statistics of its
        first computation: one affine pass instead of a statistics pass and an affine
        pass); None: the same as `fwd_time`.
    grad_in_place: position in `Node.inputs` whose gradient the backward writes into
        the buffer of the node's own output gradient (same size), so that input's
        gradient needs no new allocation; None if the backward allocates every input
        gradient. If that buffer is shared (a model output's, which the autograd engine
        holds, or one an addition handed to several inputs) the runtime copies it first:
        see `solver.simulate`.
    grad_shared: positions in `Node.inputs`, besides `grad_in_place`, whose gradient is the
        very buffer the backward is fed, shared, not copied (an addition hands its
        output's gradient to both arguments). Without `grad_in_place`, the backward does not
        write into that buffer, so it is never copied: a view or reshape hands its input a
        view of its own gradient, an identity (`.contiguous()` of a contiguous tensor) the
        gradient itself.
    fwd_in_place: position in `Node.inputs` whose storage the forward writes its output
        into (an in-place ReLU or addition) when nothing but that input's own handle holds
        the storage and the schedule frees that input right after this step; None if the
        output always gets a new storage. See `solver.simulate`.
    bwd_from_inputs: the backward reads nothing but the inputs it keeps (`keeps_inputs`; no
        private state, not the output), so its state can be made from those inputs without
        running the forward (a schedule's `make_state` step: a convolution's backward from its
        input and weight). In the node's own backward stage, where nothing else reads its
        output, that replaces a recomputation: no forward time, no output storage.
    """

    name: str
    fwd_time: float
    bwd_time: float
    fwd_workspace: int = 0
    bwd_workspace: int = 0
    keeps_inputs: tuple[int, ...] = ()
    keeps_output: bool = False
    state_bytes: int = 0
    grad_in_place: int | None = None
    recompute_time: float | None = None
    grad_shared: tuple[int, ...] = ()
    fwd_in_place: int | None = None
    bwd_from_inputs: bool = False
    nograd_fwd_workspace: int | None = None

    def forward_workspace(self, grad: bool) -> int:
        """Transient bytes of a computation beyond its output and (with grad) `state_bytes`."""
        if grad or self.nograd_fwd_workspace is None:
            return self.fwd_workspace
        return self.nograd_fwd_workspace

    @property
    def keeps_inputs_only(self) -> bool:
        """Its backward state holds inputs and nothing else (not its output, no private bytes) and
        its forward is not in place: what `bwd_from_inputs` requires."""
        return not self.keeps_output and not self.state_bytes and self.fwd_in_place is None

    def __post_init__(self) -> None:
        object.__setattr__(self, "keeps_inputs", tuple(int(i) for i in self.keeps_inputs))
        object.__setattr__(self, "grad_shared", tuple(int(i) for i in self.grad_shared))
        for name in ("grad_in_place", "fwd_in_place"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))


@dataclass(frozen=True)
class Restore:
    """A second way to get a node's value back in a backward stage, besides recomputing it:
    read it out of a consumer's backward state, which holds a copy of it in another form (a
    convolution that keeps its ReLU input zero-packed). Only a backward stage restores, without
    autograd (it makes no state), and only while that consumer's state, made with
    `consumer_impl`, is held; it reads none of the node's inputs.

    name: the implementation name a schedule's compute step uses for it.
    time / workspace: of the restore (unpacking), like `Impl.fwd_time` / `fwd_workspace`.
    """

    name: str
    consumer: str
    consumer_impl: str
    time: float
    workspace: int = 0


@dataclass(frozen=True)
class Node:
    """One operator.

    output_bytes: bytes of the storage the output owns (0 for a view: see alias_of).
    alias_of: position in `inputs` whose storage the output shares (views,
        reshapes, getitem of a tuple), else None.
    grad_bytes: bytes of the gradient of the output (a view has a real gradient).
    requires_backward: the node has a backward stage (gradient reaches it and it
        has a parameter or an input that needs a gradient).
    param_grad_bytes: parameter-gradient bytes first allocated by this node's backward.
    param_grad_freed_bytes: parameter-gradient bytes freed right after this node's backward,
        when the optimizer steps inside the backward (`monet_opt` "step in backward": each
        parameter is updated, and its gradient dropped, once its last reader's backward ran).
    param_step_bytes: transient bytes of that optimizer step (its temporaries).
    deferred_param_grad_bytes: parameter-gradient bytes made after the last backward stage
        instead of by this node's backward (a weight gradient deferred: its backward makes the
        input gradients only and leaves held what the weight gradient is computed from, its
        input and its output's gradient, counted in `param_grad_bytes`; at the end of the step
        the weight gradient replaces them). `bwd_time` stays the whole backward's. 0: not deferred.
    deferred_workspace_bytes: transient bytes while those are made (a CPU convolution's weight
        gradient passes through a temporary of its size).
        Solver side only so far: `monet_opt.build_problem` does not offer it, and the runtime does
        not run it (see benchmarks/README.md, session 61).
    is_output: the model returns this value; the user holds it until the step ends.
    user_holds: for an output, False if the user drops it once the loss is computed, before the
        backward (a training loop that keeps only the loss, as Hugging Face's Trainer: the logits
        beside the loss a language model returns are then freed, or recomputed, as the schedule
        says).
    output_grad: for an output, the user's loss gives it a gradient at the start of the
        backward (False: the loss does not read it, as a language model's logits beside the
        loss it returns).
    restores: ways to read the value back out of a consumer's backward state (`Restore`).
    """

    name: str
    op: str
    inputs: tuple[str, ...]
    output_bytes: int
    impls: tuple[Impl, ...]
    grad_bytes: int = 0
    alias_of: int | None = None
    requires_backward: bool = False
    param_grad_bytes: int = 0
    is_output: bool = False
    param_grad_freed_bytes: int = 0
    param_step_bytes: int = 0
    restores: tuple[Restore, ...] = ()
    output_grad: bool = True
    user_holds: bool = True
    deferred_param_grad_bytes: int = 0
    deferred_workspace_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "impls", tuple(i if isinstance(i, Impl) else Impl(**i) for i in self.impls))
        object.__setattr__(
            self, "restores", tuple(r if isinstance(r, Restore) else Restore(**r) for r in self.restores)
        )

    def impl(self, name: str) -> Impl:
        for impl in self.impls:
            if impl.name == name:
                return impl
        raise ProblemError(f"node {self.name!r} has no implementation {name!r}")


@dataclass(frozen=True)
class Problem:
    """A model's operators in topological order, with their measured costs.

    fixed_bytes: bytes the step holds throughout besides what the nodes make.
    recompute_overhead_s: the runtime's own seconds per compute step in a backward stage (a
        recomputation or a restore), beyond the implementation's time: dispatching the node
        outside the forward's generated code, and the separate autograd graph (one more
        backward call) a recomputation with grad gets. Measured on the device by
        `monet_opt.runtime_cost`; 0 in problems that predate it.
    """

    nodes: tuple[Node, ...]
    fingerprint: str
    fixed_bytes: int = 0
    meta: dict = field(default_factory=dict)
    recompute_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        nodes = tuple(n if isinstance(n, Node) else Node(**n) for n in self.nodes)
        object.__setattr__(self, "nodes", nodes)
        _validate(nodes)
        overhead = self.recompute_overhead_s
        if not isinstance(overhead, (int, float)) or not 0.0 <= overhead < float("inf"):
            raise ProblemError(f"recompute_overhead_s must be a finite number >= 0, not {overhead!r}")

    # -- lookups -------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    def node(self, name: str) -> Node:
        return self.nodes[self.index()[name]]

    def without_deferral(self) -> Problem:
        """The problem with no weight gradient deferred (each made by its node's backward again):
        plain PyTorch's, whose no-recompute peak fractional budgets are fractions of."""
        if not any(n.deferred_param_grad_bytes for n in self.nodes):
            return self
        nodes = tuple(
            replace(
                n,
                param_grad_bytes=n.deferred_param_grad_bytes,
                deferred_param_grad_bytes=0,
                deferred_workspace_bytes=0,
            )
            if n.deferred_param_grad_bytes
            else n
            for n in self.nodes
        )
        return replace(self, nodes=nodes)

    # -- JSON ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format_version": PROBLEM_FORMAT_VERSION, "kind": "monet-opt problem", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Problem:
        if data.get("kind") != "monet-opt problem":
            raise ProblemError("not a monet-opt problem (field 'kind' missing or different)")
        version = data.get("format_version")
        if version not in READABLE_VERSIONS:
            raise ProblemError(
                f"problem format_version {version!r} is not supported "
                f"(readable: {', '.join(map(str, READABLE_VERSIONS))})"
            )
        try:
            return cls(
                nodes=tuple(data["nodes"]),
                fingerprint=data["fingerprint"],
                fixed_bytes=int(data.get("fixed_bytes", 0)),
                meta=dict(data.get("meta", {})),
                recompute_overhead_s=float(data.get("recompute_overhead_s", 0.0)),
            )
        except (KeyError, TypeError) as exc:
            raise ProblemError(f"malformed problem: {exc}") from exc

    def to_json(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> Problem:
        return cls.from_dict(read_json_object(path, what="problem"))


def storage_bytes(by_name: dict[str, Node], name: str) -> int:
    """Bytes of the storage node `name`'s output lives in (a view's: its base's)."""
    node = by_name[name]
    while node.alias_of is not None:
        node = by_name[node.inputs[node.alias_of]]
    return node.output_bytes


def _validate(nodes: tuple[Node, ...]) -> None:
    seen: set[str] = set()
    by_name = {n.name: n for n in nodes}
    for node in nodes:
        _validate_restores(node, by_name)
        if node.name in seen:
            raise ProblemError(f"duplicate node name {node.name!r}")
        for inp in node.inputs:
            if inp not in seen:
                raise ProblemError(
                    f"node {node.name!r} uses {inp!r}, which is not an earlier node "
                    "(nodes must be in topological order)"
                )
        if not node.impls:
            raise ProblemError(f"node {node.name!r} has no implementation")
        if min(node.param_grad_bytes, node.param_grad_freed_bytes, node.param_step_bytes) < 0:
            raise ProblemError(f"node {node.name!r}: negative parameter-gradient bytes")
        if (node.param_grad_freed_bytes or node.param_step_bytes) and not node.requires_backward:
            raise ProblemError(f"node {node.name!r}: an optimizer step after a backward it does not have")
        if min(node.deferred_param_grad_bytes, node.deferred_workspace_bytes) < 0:
            raise ProblemError(f"node {node.name!r}: negative deferred parameter-gradient bytes")
        if node.deferred_param_grad_bytes and (not node.requires_backward or node.param_grad_freed_bytes):
            raise ProblemError(
                f"node {node.name!r}: a deferred parameter gradient needs a backward and no optimizer "
                "step inside it (param_grad_freed_bytes)"
            )
        if not node.output_grad and not node.is_output:
            raise ProblemError(f"node {node.name!r}: output_grad False on a node that is not an output")
        if not node.user_holds and not node.is_output:
            raise ProblemError(f"node {node.name!r}: user_holds False on a node that is not an output")
        if node.alias_of is not None and not 0 <= node.alias_of < len(node.inputs):
            raise ProblemError(f"node {node.name!r}: alias_of {node.alias_of} is not an input position")
        for impl in node.impls:
            for pos in impl.keeps_inputs:
                if not 0 <= pos < len(node.inputs):
                    raise ProblemError(
                        f"node {node.name!r} impl {impl.name!r}: keeps input {pos}, "
                        f"but the node has {len(node.inputs)} inputs"
                    )
            if impl.grad_in_place is not None and not 0 <= impl.grad_in_place < len(node.inputs):
                raise ProblemError(
                    f"node {node.name!r} impl {impl.name!r}: grad_in_place {impl.grad_in_place} "
                    f"is not an input position (the node has {len(node.inputs)} inputs)"
                )
            shared = set(impl.grad_shared)
            if shared and (impl.grad_in_place in shared or not shared <= set(range(len(node.inputs)))):
                raise ProblemError(
                    f"node {node.name!r} impl {impl.name!r}: grad_shared {impl.grad_shared} must be "
                    "input positions other than grad_in_place"
                )
            if impl.fwd_in_place is not None and not (
                0 <= impl.fwd_in_place < len(node.inputs) and node.alias_of is None
            ):
                raise ProblemError(
                    f"node {node.name!r} impl {impl.name!r}: fwd_in_place {impl.fwd_in_place} "
                    "is not an input position of a node that owns its output"
                )
            if impl.bwd_from_inputs and not impl.keeps_inputs_only:
                raise ProblemError(
                    f"node {node.name!r} impl {impl.name!r}: bwd_from_inputs needs a backward that "
                    "keeps its inputs and nothing else (not its output, no private state bytes) "
                    "and a forward that is not in place"
                )
            if min(impl.fwd_time, impl.bwd_time, impl.recompute_time or 0.0) < 0:
                raise ProblemError(f"node {node.name!r} impl {impl.name!r}: negative time")
            for field_name in ("fwd_workspace", "bwd_workspace", "state_bytes", "nograd_fwd_workspace"):
                if (getattr(impl, field_name) or 0) < 0:
                    raise ProblemError(f"node {node.name!r} impl {impl.name!r}: negative {field_name}")
        seen.add(node.name)


def _validate_restores(node: Node, by_name: dict[str, Node]) -> None:
    names = [i.name for i in node.impls]
    for r in node.restores:
        where = f"node {node.name!r} restore {r.name!r}"
        if r.name in names or [x.name for x in node.restores].count(r.name) > 1:
            raise ProblemError(f"{where}: the name is already an implementation or another restore's")
        if node.alias_of is not None:
            raise ProblemError(f"{where}: a view has no storage of its own to restore")
        consumer = by_name.get(r.consumer)
        if consumer is None or node.name not in consumer.inputs:
            raise ProblemError(f"{where}: {r.consumer!r} is not a node that reads {node.name!r}")
        if not consumer.requires_backward or r.consumer_impl not in [i.name for i in consumer.impls]:
            raise ProblemError(
                f"{where}: {r.consumer!r} has no implementation {r.consumer_impl!r} with a backward state"
            )
        if r.time < 0 or r.workspace < 0:
            raise ProblemError(f"{where}: negative time or workspace")
