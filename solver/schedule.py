"""The schedule: an explicit program of compute / backward / free steps. Versioned JSON.

A schedule is a list of stages. The first is "forward"; each following stage is
"backward:<node>", one per node with a backward, in reverse topological order. A node's
backward step is normally its own stage's last step; `solver.gather` may move it earlier, next
to other backward steps (so the runtime runs them in one autograd call), leaving its stage
without one. A stage is a list of steps, executed in order:

  compute      node, impl, grad  run the node with that implementation; with grad=True
                                 it also creates the node's backward state
  make_state   node, impl        make the node's backward state from its inputs, without running
                                 its forward (an implementation with `Impl.bwd_from_inputs`): no
                                 output, no value handle
  backward     node              run the node's backward (needs its state and gradient)
  free_value   node              drop the schedule's handle on the node's output
  free_state   node              drop the node's backward state

After the last stage, the runtime makes the weight gradients of the nodes that
`meta["deferred_param_grads"]` names (`Node.deferred_param_grad_bytes`: the problem's), in that
order.

The set of step ops is open: later storage classes (swap to host, compression)
add ops such as swap_out / swap_in, and readers reject ops they do not know with
a message naming it. `monet_opt.runtime` executes the steps; `solver.simulate`
replays them to predict peak memory and time.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from solver.jsonio import atomic_write_text, read_json_object

SCHEDULE_FORMAT_VERSION = 1
STEP_OPS = ("compute", "make_state", "backward", "free_value", "free_state")
# meta key: the nodes whose weight gradients are made after the last stage (deferred)
DEFERRED_META = "deferred_param_grads"


class ScheduleError(ValueError):
    """A schedule file or object is malformed."""


class FingerprintMismatch(ValueError):
    """A schedule was made for another model or input shape."""


@dataclass(frozen=True)
class Step:
    op: str
    node: str
    impl: str | None = None
    grad: bool = False

    def to_dict(self) -> dict:
        d: dict = {"op": self.op, "node": self.node}
        if self.op == "compute":
            d["impl"] = self.impl
            d["grad"] = self.grad
        elif self.op == "make_state":
            d["impl"] = self.impl
        return d


@dataclass(frozen=True)
class Stage:
    name: str
    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(s if isinstance(s, Step) else Step(**s) for s in self.steps))


@dataclass(frozen=True)
class SolverInfo:
    name: str
    status: str = "ok"
    gap: float | None = None
    solve_time_s: float = 0.0


@dataclass(frozen=True)
class Schedule:
    fingerprint: str
    budget_bytes: int | None
    predicted_peak_bytes: int
    predicted_time_s: float
    solver: SolverInfo
    strategy: str
    stages: tuple[Stage, ...]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "stages", tuple(s if isinstance(s, Stage) else Stage(**s) for s in self.stages)
        )
        if not isinstance(self.solver, SolverInfo):
            object.__setattr__(self, "solver", SolverInfo(**self.solver))
        for stage in self.stages:
            for step in stage.steps:
                if step.op not in STEP_OPS:
                    raise ScheduleError(
                        f"stage {stage.name!r}: unknown step op {step.op!r} (known: {', '.join(STEP_OPS)})"
                    )

    # -- derived views ---------------------------------------------------------
    def recomputed(self) -> dict[str, int]:
        """How many times each node is computed again after the forward stage."""
        counts: dict[str, int] = {}
        for stage in self.stages[1:]:
            for step in stage.steps:
                if step.op == "compute":
                    counts[step.node] = counts.get(step.node, 0) + 1
        return counts

    def impl_choice(self) -> dict[str, str]:
        """The implementation each node runs with in the forward stage."""
        return {s.node: s.impl for s in self.stages[0].steps if s.op == "compute"}

    def check_fingerprint(self, fingerprint: str, what: str = "model") -> None:
        if fingerprint != self.fingerprint:
            made_for = (
                self.meta.get("model_summary") or self.meta.get("model") or "another model or input shape"
            )
            raise FingerprintMismatch(
                f"this schedule was made for {made_for} (fingerprint {self.fingerprint[:12]}), "
                f"not for this {what} (fingerprint {fingerprint[:12]}); solve again for this model and input shape"
            )

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format_version": SCHEDULE_FORMAT_VERSION,
            "kind": "monet-opt schedule",
            "fingerprint": self.fingerprint,
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_time_s": self.predicted_time_s,
            "solver": asdict(self.solver),
            "strategy": self.strategy,
            "meta": self.meta,
            "stages": [{"name": st.name, "steps": [s.to_dict() for s in st.steps]} for st in self.stages],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        if data.get("kind") != "monet-opt schedule":
            raise ScheduleError("not a monet-opt schedule (field 'kind' missing or different)")
        version = data.get("format_version")
        if version != SCHEDULE_FORMAT_VERSION:
            raise ScheduleError(
                f"schedule format_version {version!r} is not supported (expected {SCHEDULE_FORMAT_VERSION})"
            )
        try:
            return cls(
                fingerprint=data["fingerprint"],
                budget_bytes=data["budget_bytes"],
                predicted_peak_bytes=int(data["predicted_peak_bytes"]),
                predicted_time_s=float(data["predicted_time_s"]),
                solver=SolverInfo(**data["solver"]),
                strategy=data["strategy"],
                stages=tuple(data["stages"]),
                meta=dict(data.get("meta", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ScheduleError(f"malformed schedule: missing or bad field {exc}") from exc

    def to_json(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> Schedule:
        try:
            return cls.from_dict(read_json_object(path, what="schedule"))
        except ScheduleError as exc:
            raise ScheduleError(f"schedule file {path}: {exc}") from exc
