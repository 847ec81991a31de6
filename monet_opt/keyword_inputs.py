"""Example inputs given by keyword.

A model whose forward takes its inputs by keyword (a Hugging Face model: `input_ids=`, `labels=`,
`use_cache=`, and `**kwargs`) is traced through a `KeywordRoot`: a module whose forward takes the
tensors positionally, under the keywords' names, calls the model with them, and returns its
output's tensors as a flat tuple (the output's structure, a `ModelOutput` or a dict, is kept in
`out_spec` to rebuild it). Values in the dict that are not tensors (`use_cache=False`) are
constants of the trace: every traced step passes them as they were.

`as_traceable(model, example_inputs)` is the one entry: a mapping (a dict, a tokenizer's
BatchEncoding) gives a `KeywordRoot` and its tensors in order; anything else passes through as
a tuple.
"""

from __future__ import annotations

import keyword
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten


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
                f"{type(self.model).__name__}'s output holds a {odd[0]}, not a tensor{hint}; "
                "a traced model returns tensors (in tuples, lists, dicts or ModelOutputs)"
            )
        self.out_spec = spec
        return tuple(leaves)

    @property
    def grad_outputs(self) -> list[int] | None:
        """The flat output positions a training loss reads by default (`grad_output_positions`)."""
        return loss_positions(self.out_spec)


def keyword_root(model: nn.Module, names: list[str], constants: dict[str, Any]) -> KeywordRoot:
    """A `KeywordRoot` for `model` whose forward takes `names` positionally."""
    for name in [*names, *constants]:
        if not name.isidentifier() or keyword.iskeyword(name) or name == "self":
            raise ValueError(f"example input name {name!r} is not a Python argument name")
    call = ", ".join([f"{n}={n}" for n in names] + [f"{k}=self.constants[{k!r}]" for k in constants])
    source = f"def forward(self, {', '.join(names)}):\n    return self._flat(self.model({call}))\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<monet_opt keyword root of {type(model).__name__}>", "exec"), namespace)  # noqa: S102
    cls = type(f"KeywordRoot_{type(model).__name__}", (KeywordRoot,), {"forward": namespace["forward"]})
    root = cls(model, tuple(names), constants)
    root.training = model.training  # (not root.train(): that sets every submodule to one mode)
    return root


def as_traceable(model: nn.Module, example_inputs: Any) -> tuple[nn.Module, tuple]:
    """(module to trace, its positional inputs). A mapping of example inputs (keyword -> tensor,
    or keyword -> constant: a dict, or a tokenizer's BatchEncoding) gives a `KeywordRoot`; a
    tensor or a sequence passes through as a tuple (a `KeywordRoot` handed in again, with its
    tuple, unchanged)."""
    if isinstance(example_inputs, torch.Tensor):
        return model, (example_inputs,)
    if not isinstance(example_inputs, Mapping):  # (a dict, or a tokenizer's BatchEncoding)
        return model, tuple(example_inputs)
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
    if grad_outputs == "all" or not isinstance(root, KeywordRoot):
        return None
    return root.grad_outputs
