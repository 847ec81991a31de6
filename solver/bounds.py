"""Lower bounds on the peak memory of any valid schedule (no MILP needed).

Every valid schedule must, at some moment:

* run the backward of each node t with t's state live. At that moment these are
  live whatever the schedule: `fixed_bytes`, the storages the user holds (outputs),
  the gradients that exist at stage t (they depend only on the fixed stage order),
  the parameter gradients of earlier backwards, t's state (private bytes plus the
  storages it keeps, cheapest implementation), plus the backward transient
  (workspace, new input gradients less any written in place, t's parameter gradients);
* compute each node that an output or a backward depends on at least once: its
  inputs' storages, its new output storage (none if it may write into an input,
  `fwd_in_place`) and its workspace (plus its private
  state bytes if it needs a backward, since some compute of it must run with
  grad=True);
* end the step with every parameter gradient made (those an optimizer step inside the backward
  frees excepted, deferred ones included) beside the fixed bytes and the outputs the user holds.

The bound is the largest of these quantities; it is <= the simulated peak of any
valid schedule (tests check it against every strategy and random schedules).
"""

from __future__ import annotations

from solver.plan import Analysis, deferred_order
from solver.problem import Problem


def _backward_bound(an: Analysis, s: int) -> int:
    t = an.bw[s]
    user = set(an.user_bases)
    best = None
    for m, im in enumerate(an.impls[t]):
        kept = sum(an.a[b] for b in an.kept_bases[t][m] if b not in user)
        v = im.state_bytes + kept + im.bwd_workspace - an.grad_saving(t, m)
        best = v if best is None else min(best, v)
    # after t's backward: its input gradients summed into new buffers and an optimizer step's
    # temporaries, beside the stage's gradients, the fixed bytes and the outputs the user holds
    after = an.stage_const[s] + min(an.bwd_after[s]) if an.bwd_after[s] is not None else 0
    return max(an.stage_const[s] + (best or 0) + an.bwd_extra_base[s], after)


def _compute_bound(an: Analysis, i: int) -> int:
    ins = {an.base[j] for j in an.uinputs[i]}
    best = None
    for im in an.impls[i]:
        # a new storage (0 for a view, or for an output written into an input: fwd_in_place)
        written = im.fwd_in_place is not None and an.a[an.base[an.inputs[i][im.fwd_in_place]]] == an.a[i]
        own = 0 if written else an.a[i]
        v = own + im.forward_workspace(False)
        if an.rb[i]:  # computed with grad at least once, or else without
            v = min(v, own + im.fwd_workspace + im.state_bytes)
        best = v if best is None else min(best, v)
    return an.problem.fixed_bytes + sum(an.a[b] for b in ins) + (best or 0)


def needed_nodes(an: Analysis) -> set[int]:
    """Nodes that every valid schedule computes at least once: outputs, backwards, their ancestors."""
    roots = set(an.outputs) | {i for i in range(an.n) if an.rb[i]}
    out = set(roots)
    for r in roots:
        out |= an.ancestors[r]
    return out


def min_feasible_lower_bound(problem: Problem) -> int:
    """A lower bound on the simulated peak of every valid schedule of `problem` (bytes)."""
    an = Analysis(problem)
    lb = problem.fixed_bytes
    for s in range(an.T):
        lb = max(lb, _backward_bound(an, s))
    for i in needed_nodes(an):
        lb = max(lb, _compute_bound(an, i))
    # at the end of the forward every output storage is held
    lb = max(lb, problem.fixed_bytes + an.user_bytes)
    return int(max(lb, _end_bound(problem, an)))


def _end_bound(problem: Problem, an: Analysis) -> int:
    """The end of the step: every parameter gradient the backwards made (a deferred node's: what
    it holds for its weight gradient), then the deferred weight gradients made one by one in
    the least-peak order (most held plus workspace first), each beside its workspace."""
    live = problem.fixed_bytes + an.user_bytes
    live += sum(n.param_grad_bytes - n.param_grad_freed_bytes for n in problem.nodes if n.requires_backward)
    peak = live
    by_name = {n.name: n for n in problem.nodes}
    for n in (by_name[name] for name in deferred_order(problem)):
        peak = max(peak, live + n.deferred_param_grad_bytes + n.deferred_workspace_bytes)
        live += n.deferred_param_grad_bytes - n.param_grad_bytes
    return max(peak, live)


def explain_lower_bound(problem: Problem) -> str:
    """Which moment sets the lower bound (for error messages)."""
    an = Analysis(problem)
    best = (problem.fixed_bytes, "fixed bytes", None)
    for s in range(an.T):
        v = _backward_bound(an, s)
        if v > best[0]:
            best = (v, f"the backward of {an.names[an.bw[s]]!r}", s)
    for i in needed_nodes(an):
        v = _compute_bound(an, i)
        if v > best[0]:
            best = (v, f"computing {an.names[i]!r}", None)
    v = _end_bound(problem, an)
    if v > best[0]:
        best = (v, "the end of the step (every parameter gradient made, deferred ones too)", None)
    text = f"{best[0]} bytes, set by {best[1]}"
    if best[2] is not None:
        # parameter gradients the backwards up to that one made and hold (all of them, unless the
        # optimizer steps inside the backward): often most of the bound for small batches
        nodes = [problem.nodes[an.bw[s]] for s in range(best[2] + 1)]
        grads = sum(n.param_grad_bytes - n.param_grad_freed_bytes for n in nodes)
        if grads >= 0.25 * best[0]:
            text += f", {grads / 2**20:.1f} MiB of it parameter gradients"
            if not any(n.param_grad_freed_bytes for n in problem.nodes):
                text += (
                    " (the optimizer step inside the backward frees each as it is made: monet_opt's "
                    "optimizer=..., command line --step-in-backward adam)"
                )
    return text
