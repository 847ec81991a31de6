"""Session 61 probe: what deferring weight gradients to the end of the backward would buy with
gradients kept, on the solver's side only (no runtime runs it yet).

With gradients kept (no optimizer step in the backward), every parameter gradient is made by its
node's backward and held to the end of the step: layer4's convolutions and the fc layer of
ResNet-50 make theirs first, so at every later backward stage they are live. A node whose
weight gradient is bigger than what computing it later needs -- its input's storage and its
output's gradient -- could keep those instead and make the weight gradient after the last
backward stage, when every activation is gone (Zero Bubble pipelining's split of B and W).

This probe models that conservatively in the problem as it is: such a node's
`param_grad_bytes` become its input storage's bytes plus its output gradient's (what its
backward would leave held to the end), and solves the problem both ways with the same time
limit. The end of the step (all parameter gradients, made one node at a time) is checked
beside: it must fit the budget too.

python benchmarks/results/session61/deferred_wgrad_probe.py PROBLEM.json BUDGET_FRACTION[,...] [--time-limit 60]
"""

import argparse
import dataclasses

from solver import Problem, baselines, solve

MiB = 2**20


def storage_bytes(by: dict, name: str) -> int:
    node = by[name]
    while node.alias_of is not None:
        node = by[node.inputs[node.alias_of]]
    return node.output_bytes


def deferred(problem: Problem) -> tuple[Problem, int, int]:
    """The problem with weight gradients deferred where that holds fewer bytes; the bytes saved
    during the backward, and the end-of-step live bytes (every parameter gradient plus the
    largest still-held deferred inputs, bounded by all of them)."""
    by = {n.name: n for n in problem.nodes}
    nodes, saved, held = [], 0, 0
    for n in problem.nodes:
        if n.op in ("conv2d", "linear") and n.param_grad_bytes and n.inputs:
            d = storage_bytes(by, n.inputs[0]) + n.grad_bytes
            if n.param_grad_bytes > d:
                print(
                    f"  defer {n.name:24} weight gradient {n.param_grad_bytes / MiB:6.2f} MiB -> holds {d / MiB:6.2f}"
                )
                saved += n.param_grad_bytes - d
                held += d
                n = dataclasses.replace(n, param_grad_bytes=d)
        nodes.append(n)
    all_grads = sum(n.param_grad_bytes for n in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes), saved, problem.fixed_bytes + all_grads + held


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("problem")
    ap.add_argument("budgets")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args()
    problem = Problem.from_json(args.problem)
    plain = baselines.no_recompute(problem)  # the CLI's "plain": peak and time
    q, saved, end = deferred(problem)
    print(f"saved during the backward: {saved / MiB:.1f} MiB; end of step at most {end / MiB:.1f} MiB")
    print(f"no-recompute peak {plain.predicted_peak_bytes / MiB:.1f} MiB")
    base = plain.predicted_time_s
    print(f"no-recompute step {base * 1e3:.1f} ms")
    for frac in (float(b) for b in args.budgets.split(",")):
        budget = int(frac * plain.predicted_peak_bytes) if frac <= 1 else int(frac)
        for label, p in (("as is", problem), ("weight gradients deferred", q)):
            try:
                s = solve(p, budget, time_limit=args.time_limit, verbose=False)
                print(
                    f"budget {frac} ({budget / MiB:.1f} MiB) {label}: {s.predicted_time_s * 1e3:.1f} ms "
                    f"({s.predicted_time_s / base - 1:+.1%} over no-recompute), peak {s.predicted_peak_bytes / MiB:.1f}, "
                    f"{s.solver.status}, gap {s.solver.gap:.1%}"
                )
            except Exception as e:  # infeasible: say the minimum
                print(
                    f"budget {frac} ({budget / MiB:.1f} MiB) {label}: {type(e).__name__}: {str(e).splitlines()[0]}"
                )


if __name__ == "__main__":
    main()
