"""Small matplotlib helpers for budget sweeps, benchmarks and notebooks.

Every function draws on `ax` if given (else on a new figure) and returns the Axes.
Nothing here selects a backend: scripts that run headless call
``matplotlib.use("Agg")`` before importing pyplot (matplotlib also falls back to
Agg by itself when there is no display); notebooks use their inline backend.

    from monet_opt import plots
    plots.frontier([{"method": "plain PyTorch", "mem_ratio": 1.0, "overhead": 0.0}, ...])
    plots.recompute_heatmap(problem, {"0.75": s75, "0.5": s50})
    plots.memory_timeline(problem, schedule)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MiB = 2**20

# one marker and colour per method family; unknown methods cycle through the rest
METHOD_STYLE: dict[str, tuple[str, str]] = {
    "plain PyTorch": ("o", "black"),
    "checkpoint_sequential": ("s", "tab:orange"),
    "torch.compile": ("^", "tab:green"),
    "monet-opt + ": ("d", "tab:purple"),  # (the optimizer step in the backward: before "monet-opt")
    "monet-opt": ("D", "tab:blue"),
}
_EXTRA_MARKERS = ["v", "P", "X", "*", "<", ">", "h"]
_EXTRA_COLORS = ["tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]


def _axes(ax, figsize=(6.4, 4.4)):
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=figsize)
    return ax


def _get(point: Any, key: str, default=None):
    if isinstance(point, Mapping):
        return point.get(key, default)
    return getattr(point, key, default)


def method_style(method: str) -> tuple[str, str]:
    """(marker, colour) of a method; a method name starting with a known family shares its style."""
    for family, style in METHOD_STYLE.items():
        if method.startswith(family):
            return style
    k = sum(map(ord, method))
    return _EXTRA_MARKERS[k % len(_EXTRA_MARKERS)], _EXTRA_COLORS[k % len(_EXTRA_COLORS)]


def frontier(
    points: Iterable[Any],
    ax=None,
    title: str | None = None,
    annotate: bool = True,
    connect: bool = True,
):
    """Memory ratio (x) vs step-time overhead (y), one marker style per method.

    points: dicts or objects with `method`, `mem_ratio` (measured peak / plain peak),
    `overhead` (step time / plain step time - 1) and optionally `label` (e.g. the
    budget) to annotate. Points with a missing ratio or overhead are skipped.
    Points of one method are joined in order of memory ratio when `connect`.
    """
    ax = _axes(ax)
    by_method: dict[str, list[tuple[float, float, str]]] = {}
    for p in points:
        r, o = _get(p, "mem_ratio"), _get(p, "overhead")
        if r is None or o is None:
            continue
        by_method.setdefault(str(_get(p, "method")), []).append((float(r), float(o), _get(p, "label") or ""))
    for method, pts in by_method.items():
        marker, color = method_style(method)
        pts.sort()
        xs = [p[0] for p in pts]
        ys = [100.0 * p[1] for p in pts]
        ax.plot(
            xs,
            ys,
            linestyle="-" if connect and len(pts) > 1 else "none",
            linewidth=0.8,
            alpha=0.9,
            marker=marker,
            markersize=8,
            color=color,
            label=method,
        )
        if annotate:
            for x, y, lab in zip(xs, ys, (p[2] for p in pts)):
                if lab:
                    ax.annotate(
                        str(lab), (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7, color=color
                    )
    ax.axhline(0.0, color="0.7", linewidth=0.8, zorder=0)
    ax.axvline(1.0, color="0.7", linewidth=0.8, zorder=0)
    ax.set_xlabel("measured peak / plain PyTorch peak")
    ax.set_ylabel("step-time overhead vs plain (%)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def schedule_marks(problem, schedule) -> dict[str, int]:
    """Per node: 0 kept with its default implementation, 1 recomputed, 2 non-default
    implementation, 3 both (recomputed and non-default)."""
    recomputed = schedule.recomputed()
    impl = schedule.impl_choice()
    out = {}
    for n in problem.nodes:
        default = n.impls[0].name if n.impls else None
        code = 1 if recomputed.get(n.name) else 0
        if impl.get(n.name) not in (None, default):
            code += 2
        out[n.name] = code
    return out


def recompute_heatmap(
    problem,
    schedules: Mapping[str, Any],
    ax=None,
    only_changed: bool = True,
    title: str | None = None,
    max_labels: int = 70,
):
    """Nodes (rows, topological order) x budgets (columns): which nodes each schedule
    recomputes and which run with a non-default implementation.

    schedules: {column label (e.g. "0.5" or "120 MiB"): Schedule}; a value of None
    (infeasible budget) gives an empty grey column. With `only_changed`, rows of
    nodes that every schedule keeps with the default implementation are hidden.
    """
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    labels = list(schedules)
    names = [n.name for n in problem.nodes]
    grid = np.full((len(names), max(1, len(labels))), -1, dtype=float)
    for j, lab in enumerate(labels):
        sch = schedules[lab]
        if sch is None:
            continue
        marks = schedule_marks(problem, sch)
        for i, name in enumerate(names):
            grid[i, j] = marks[name]
    rows = list(range(len(names)))
    if only_changed:
        rows = [i for i in rows if (grid[i] > 0).any()] or rows[:1]
    grid = grid[rows]
    shown = [names[i] for i in rows]
    if ax is None:
        import matplotlib.pyplot as plt

        height = min(14.0, max(3.0, 0.16 * len(rows) + 1.5))
        _, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.9 * len(labels)), height))
    colors = ["0.85", "white", "tab:red", "tab:blue", "tab:purple"]  # n/a, kept, recomputed, impl, both
    cmap = ListedColormap(colors)
    ax.imshow(grid + 1, aspect="auto", cmap=cmap, vmin=-0.5, vmax=4.5, interpolation="nearest")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([str(x) for x in labels], rotation=45 if len(labels) > 6 else 0, fontsize=8)
    ax.set_xlabel("budget")
    if len(rows) <= max_labels:
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(shown, fontsize=6)
    else:
        step = -(-len(rows) // max_labels)
        ax.set_yticks(range(0, len(rows), step))
        ax.set_yticklabels(shown[::step], fontsize=6)
    ax.set_ylabel(f"node ({len(rows)} of {len(names)} shown)" if only_changed else "node")
    legend = [
        Patch(facecolor="tab:red", label="recomputed"),
        Patch(facecolor="tab:blue", label="other implementation"),
        Patch(facecolor="tab:purple", label="both"),
        Patch(facecolor="white", edgecolor="0.5", label="kept, default"),
    ]
    if (grid < 0).any():
        legend.append(Patch(facecolor="0.85", label="no schedule"))
    ax.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def impl_summary(problem, schedule) -> dict[str, int]:
    """{implementation name: number of nodes} for the non-default choices of a schedule."""
    default = {n.name: n.impls[0].name for n in problem.nodes if n.impls}
    out: dict[str, int] = {}
    for node, impl in schedule.impl_choice().items():
        if impl != default.get(node):
            out[impl] = out.get(impl, 0) + 1
    return dict(sorted(out.items()))


def memory_timeline(
    problem,
    schedule,
    ax=None,
    budget: int | None = None,
    compare=None,
    title: str | None = None,
    label: str = "schedule",
    compare_label: str = "no recompute",
):
    """Simulated live bytes after each step of `schedule` (solver.simulate's timeline).

    A dashed vertical line marks the end of the forward stage, shaded spans the
    recomputation inside backward stages, ticks on the x axis every stage boundary,
    and a horizontal line the budget (default: the schedule's own). `compare`: another
    schedule (e.g. solver.no_recompute(problem)) drawn in grey for reference.
    """
    import solver

    ax = _axes(ax, figsize=(8.0, 4.0))
    sim = solver.simulate(problem, schedule)
    ys = [t[2] / MiB for t in sim.timeline]
    xs = range(len(ys))
    if compare is not None:
        ref = solver.simulate(problem, compare)
        ax.plot(
            range(len(ref.timeline)),
            [t[2] / MiB for t in ref.timeline],
            color="0.6",
            linewidth=1.0,
            label=f"{compare_label} (peak {ref.peak_bytes / MiB:.1f} MiB)",
        )
    ax.plot(xs, ys, color="tab:blue", linewidth=1.2, label=f"{label} (peak {sim.peak_bytes / MiB:.1f} MiB)")
    # stage boundaries and recompute spans, walking the steps in the timeline's order
    k = 0
    bounds = []
    spans: list[list[int]] = []
    for s_idx, stage in enumerate(schedule.stages):
        for step in stage.steps:
            if s_idx > 0 and step.op == "compute":
                if spans and spans[-1][1] == k - 1:
                    spans[-1][1] = k
                else:
                    spans.append([k, k])
            k += 1
        bounds.append(k - 0.5)
    for a, b in spans:
        ax.axvspan(a - 0.5, b + 0.5, color="tab:red", alpha=0.15, linewidth=0)
    if bounds:
        ax.axvline(bounds[0], color="black", linestyle="--", linewidth=0.9, label="end of forward")
        ax.plot(
            bounds[1:-1],
            [0.0] * len(bounds[1:-1]),
            "|",
            color="0.5",
            markersize=5,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
            label="stage boundary",
        )
    handles, labels_ = ax.get_legend_handles_labels()
    if spans:
        from matplotlib.patches import Patch

        handles.append(Patch(color="tab:red", alpha=0.15))
        labels_.append("recomputation")
    b = budget if budget is not None else schedule.budget_bytes
    if b:
        line = ax.axhline(b / MiB, color="tab:red", linestyle=":", linewidth=1.2)
        handles.append(line)
        labels_.append(f"budget {b / MiB:.1f} MiB")
    ax.set_xlabel("step of the schedule (forward, then one stage per backward node)")
    ax.set_ylabel("live MiB (simulated)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(handles, labels_, fontsize=8, loc="upper left")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def predicted_vs_measured(
    budgets: Sequence[float],
    predicted: Sequence[float | None],
    measured: Sequence[float | None],
    ax=None,
    budget_bytes: Sequence[float | None] | None = None,
    plain: float | None = None,
    xlabel: str = "budget (fraction)",
    title: str | None = None,
):
    """Predicted and measured peak (bytes) per budget, with the budget itself as a line."""
    ax = _axes(ax)

    def pts(vals):
        return [(b, v / MiB) for b, v in zip(budgets, vals) if v is not None]

    for vals, style, lab in (
        (predicted, dict(marker="o", color="tab:blue"), "predicted (simulator)"),
        (measured, dict(marker="x", color="tab:orange", markersize=9), "measured"),
    ):
        p = pts(vals)
        if p:
            ax.plot([a for a, _ in p], [b for _, b in p], linestyle="-", linewidth=0.8, label=lab, **style)
    if budget_bytes is not None:
        p = pts(budget_bytes)
        if p:
            ax.plot([a for a, _ in p], [b for _, b in p], ":", color="tab:red", label="budget")
    if plain:
        ax.axhline(plain / MiB, color="0.5", linestyle="--", linewidth=0.8, label="plain PyTorch")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("peak MiB")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax


def solve_stats(
    budgets: Sequence[float],
    solve_times: Sequence[float | None],
    gaps: Sequence[float | None],
    ax=None,
    statuses: Sequence[str] | None = None,
    xlabel: str = "budget (fraction)",
    title: str | None = None,
):
    """Solve wall time (bars, left axis) and MILP optimality gap (line, right axis) per budget.

    A missing gap (baseline fallback, infeasible budget) is shown as an empty marker at 0
    and the status, if given, is written above the bar.
    """
    ax = _axes(ax)
    xs = list(range(len(budgets)))
    ax.bar(xs, [t or 0.0 for t in solve_times], color="tab:blue", alpha=0.6, label="solve time (s)")
    ax.set_xticks(xs)
    ax.set_xticklabels([str(b) for b in budgets], fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("solve time (s)")
    ax2 = ax.twinx()
    g = [(x, 100.0 * v) for x, v in zip(xs, gaps) if v is not None]
    if g:
        ax2.plot([a for a, _ in g], [b for _, b in g], "o-", color="tab:red", label="gap (%)")
    missing = [x for x, v in zip(xs, gaps) if v is None]
    if missing:
        ax2.plot(missing, [0.0] * len(missing), "o", mfc="none", color="tab:red", label="no MILP gap")
    ax2.set_ylabel("MILP gap (%)")
    ax2.set_ylim(bottom=0, top=max([b for _, b in g] + [1.0]) * 1.25)
    if statuses:
        for x, t, s in zip(xs, solve_times, statuses):
            ax.annotate(
                str(s), (x, t or 0.0), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=6
            )
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3, axis="y")
    if title:
        ax.set_title(title, fontsize=10)
    return ax


PARTS = ("forward", "recompute", "backward", "other")
_PART_COLORS = {"forward": "tab:blue", "recompute": "tab:red", "backward": "tab:green", "other": "0.6"}


def step_parts(bars: Sequence[tuple[str, Any]], ax=None, title: str | None = None):
    """Stacked bars of a step's parts in ms, one bar per (label, parts); parts are
    `monet_opt.bench.StepParts` or mappings with forward_s, recompute_s, backward_s, step_s
    (e.g. measured beside predicted, for a schedule and the no-recompute schedule)."""
    ax = _axes(ax)
    xs = range(len(bars))
    bottoms = [0.0] * len(bars)
    for part in PARTS:
        if part == "other":
            vals = [
                1e3 * max(0.0, _get(p, "step_s", 0.0) - sum(_get(p, f"{q}_s", 0.0) for q in PARTS[:3]))
                for _, p in bars
            ]
        else:
            vals = [1e3 * _get(p, f"{part}_s", 0.0) for _, p in bars]
        ax.bar(xs, vals, bottom=bottoms, color=_PART_COLORS[part], label=part, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, total in zip(xs, bottoms):
        ax.text(x, total, f"{total:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([label for label, _ in bars], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return ax
