"""Example inputs given by keyword.

A model whose forward takes its inputs by keyword (a Hugging Face model: `input_ids=`, `labels=`,
`use_cache=`, and `**kwargs`) is traced through a `KeywordRoot`: a module whose forward takes the
tensors positionally, under the keywords' names, calls the model with them, and returns its
output's tensors as a flat tuple (the output's structure, a `ModelOutput` or a dict, is kept in
`out_spec` to rebuild it). Values in the dict that are not tensors (`use_cache=False`) are
constants of the trace: every traced step passes them as they were.

Positional inputs that hold containers of tensors (`model(batch)` with a batch dict, a list of
views) are traced through a `StructuredRoot` the same way: the tensors flat, the structure kept.

`as_traceable(model, example_inputs)` is the one entry: a mapping (a dict, a tokenizer's
BatchEncoding) gives a `KeywordRoot` and its tensors in order; positional inputs holding
containers a `StructuredRoot`; anything else passes through as a tuple.
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten, tree_unflatten


class KeywordRoot(nn.Module):
    """Calls `model` with keywords. `names`: the tensor inputs, in the order given (the root's
    positional order); `constants`: the other keywords, passed as given. Built by `keyword_root` (its forward is
    generated with the names as arguments: torch.fx names the graph's inputs after them)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], constants: dict[str, Any]) -> None:
        super().__init__()
        self.model = model
        self.names = names
        self.constants = dict(constants)
        self.out_spec: Any = None  # the model output's pytree structure, set by each forward

    def _flat(self, out: Any) -> tuple:
        leaves, self.out_spec = _flat_output(self.model, out)
        return leaves

    @property
    def grad_outputs(self) -> list[int] | None:
        """The flat output positions a training loss reads by default (`grad_output_positions`)."""
        return loss_positions(self.out_spec)


def _flat_output(model: nn.Module, out: Any) -> tuple[tuple, Any]:
    """(the output's leaves, its pytree structure); TraceError if a leaf is not a tensor."""
    leaves, spec = tree_flatten(out)
    odd = [type(v).__name__ for v in leaves if not isinstance(v, (torch.Tensor, fx.Proxy, type(None)))]
    if odd:
        hint = (
            " (a Hugging Face model returns its key/value cache: pass use_cache=False with the inputs)"
            if any("Cache" in name for name in odd)
            else ""
        )
        from monet_opt.graph import TraceError  # (graph.py imports this module)

        raise TraceError(
            f"{type(model).__name__}'s output holds a {odd[0]}, not a tensor{hint}; "
            "a traced model returns tensors (in tuples, lists, dicts or ModelOutputs)"
        )
    return tuple(leaves), spec


class StructuredRoot(nn.Module):
    """Calls `model` with positional inputs that hold containers of tensors (a batch dict, a list
    of views): its forward takes the tensors flat, in `tree_flatten`'s order, rebuilds the
    structure (`in_spec`, the other leaves as constants) and returns the output's tensors flat
    (`out_spec` rebuilds it). The wrapper flattens each step's inputs the same way
    (`flat_inputs`)."""

    def __init__(self, model: nn.Module, example_inputs: tuple) -> None:
        super().__init__()
        self.model = model
        leaves, self.in_spec = tree_flatten(tuple(example_inputs))
        self.tensor_positions = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self.constants = {k: v for k, v in enumerate(leaves) if not isinstance(v, torch.Tensor)}
        self.out_spec: Any = None
        self.training = model.training

    def _call(self, tensors: tuple) -> tuple:
        leaves: list[Any] = [None] * self.in_spec.num_leaves
        for k, t in zip(self.tensor_positions, tensors):
            leaves[k] = t
        for k, v in self.constants.items():
            leaves[k] = v
        out = self.model(*tree_unflatten(leaves, self.in_spec))
        flat, self.out_spec = _flat_output(self.model, out)
        return flat

    def flat_inputs(self, inputs: tuple) -> tuple:
        """A step's inputs as the traced root takes them; TypeError if their structure or their
        non-tensor entries differ from the example's."""
        leaves, spec = tree_flatten(tuple(inputs))
        if spec != self.in_spec or any(leaves[k] != v for k, v in self.constants.items()):
            raise TypeError(
                f"monet-opt: the wrapped model's inputs are structured as {spec}, but the schedule was "
                f"traced with {self.in_spec}: give the same containers, keys and constants"
            )
        return tuple(leaves[k] for k in self.tensor_positions)

    @property
    def grad_outputs(self) -> list[int] | None:
        return loss_positions(self.out_spec)


def structured_root(model: nn.Module, example_inputs: tuple) -> StructuredRoot:
    """A `StructuredRoot` whose forward takes the inputs' tensors as arguments in0, in1, ...
    (generated: torch.fx makes one graph input per argument, none of a *args)."""
    n = sum(isinstance(v, torch.Tensor) for v in tree_flatten(example_inputs)[0])
    names = ", ".join(f"in{k}" for k in range(n))
    cls = _with_forward(StructuredRoot, model, names, f"self._call(({names},))")
    return cls(model, example_inputs)


def _with_forward(base: type, model: nn.Module, arguments: str, returned: str) -> type:
    """A subclass of `base` whose forward is `def forward(self, <arguments>): return <returned>`,
    generated (torch.fx names the graph's inputs after the arguments)."""
    source = f"def forward(self, {arguments}):\n    return {returned}\n"
    namespace: dict[str, Any] = {}
    where = f"<monet_opt {base.__name__} of {type(model).__name__}>"
    exec(compile(source, where, "exec"), namespace)  # noqa: S102
    return type(f"{base.__name__}_{type(model).__name__}", (base,), {"forward": namespace["forward"]})


def keyword_root(model: nn.Module, names: list[str], constants: dict[str, Any]) -> KeywordRoot:
    """A `KeywordRoot` for `model` whose forward takes `names` positionally."""
    for name in [*names, *constants]:
        if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise ValueError(f"example input name {name!r} is not a Python argument name")
    call = ", ".join([f"{n}={n}" for n in names] + [f"{k}=self.constants[{k!r}]" for k in constants])
    cls = _with_forward(KeywordRoot, model, ", ".join(names), f"self._flat(self.model({call}))")
    root = cls(model, tuple(names), constants)
    root.training = model.training  # (not root.train(): that sets every submodule to one mode)
    return root


def user_model(root: nn.Module) -> nn.Module:
    """The user's model inside a root made here (`as_traceable`), or `root` itself."""
    return root.model if isinstance(root, (KeywordRoot, StructuredRoot)) else root


def as_traceable(model: nn.Module, example_inputs: Any) -> tuple[nn.Module, tuple]:
    """(module to trace, its positional inputs). A mapping of example inputs (keyword -> tensor,
    or keyword -> constant: a dict, or a tokenizer's BatchEncoding) gives a `KeywordRoot`; a
    tensor or a sequence passes through as a tuple (a `KeywordRoot` handed in again, with its
    tuple, unchanged)."""
    if isinstance(example_inputs, torch.Tensor):
        return model, (example_inputs,)
    if not isinstance(example_inputs, Mapping):  # (a dict, or a tokenizer's BatchEncoding)
        plain = all(isinstance(x, torch.Tensor) for x in example_inputs)
        holds_tensors = any(isinstance(v, torch.Tensor) for v in tree_flatten(tuple(example_inputs))[0])
        if isinstance(model, StructuredRoot) or plain or not holds_tensors:
            return model, tuple(example_inputs)  # (no tensor at all: trace names the problem)
        # containers of tensors among the positional inputs (a batch dict): a `StructuredRoot`
        root = structured_root(model, tuple(example_inputs))
        return root, root.flat_inputs(tuple(example_inputs))
    if not example_inputs:
        raise ValueError("example_inputs is an empty mapping: give the model's inputs by keyword")
    names = [k for k, v in example_inputs.items() if isinstance(v, torch.Tensor)]
    if not names:
        raise ValueError("example_inputs by keyword hold no tensor: give at least one input tensor")
    constants = {k: v for k, v in example_inputs.items() if not isinstance(v, torch.Tensor)}
    for k, v in constants.items():
        if not isinstance(v, (bool, int, float, str, type(None))):
            raise TypeError(
                f"example input {k!r} is a {type(v).__name__}: by keyword give tensors, or constants "
                "(bool, int, float, str, None) that every step passes as they are"
            )
    return keyword_root(model, names, constants), tuple(example_inputs[k] for k in names)


def loss_positions(out_spec: Any) -> list[int] | None:
    """The flat output positions of the model output's `loss` entry (a Hugging Face ModelOutput,
    or a dict, with a 'loss' key holding one tensor); None if it has none."""
    context = getattr(out_spec, "context", None)
    children = out_spec.children() if hasattr(out_spec, "children") else None
    if not isinstance(context, (list, tuple)) or children is None or "loss" not in context:
        return None
    k = list(context).index("loss")
    if children[k].num_leaves != 1:
        return None
    return [sum(c.num_leaves for c in children[:k])]


def grad_output_positions(root: nn.Module, grad_outputs: str = "auto") -> list[int] | None:
    """The flat output positions a training loss reads, None for every output: with "auto", a
    `KeywordRoot` whose model returned a loss (`loss_positions`) is trained on it alone."""
    if grad_outputs == "all" or not isinstance(root, (KeywordRoot, StructuredRoot)):
        return None
    return root.grad_outputs
