import copy
import statistics
from pathlib import Path

import torch

import solver
from monet_opt.bench import interleaved_samples, measure_step_peak, paired_ratio
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from monet_opt.runtime.executor import ScheduleExecutor
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory
from monet_opt.zoo import ModelSpec
from solver.baselines import no_recompute

keep_freed_memory()
D = str(Path(__file__).resolve().parents[1] / "frontier_refine" / "schedules") + "/"
P = solver.Problem.from_json(D + "resnet50_adam_0.3333_refined_problem.json")
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
fused = copy.deepcopy(model)
fuse_into_backward(fused, optimizer_factory("adam"))
sep = MonetWrapper(copy.deepcopy(model), no_recompute(P), example_inputs=inputs, optimizer="adam")
ScheduleExecutor.separate_graphs = lambda self: None  # experiment: keep shared graphs under the step
grp = MonetWrapper(copy.deepcopy(model), no_recompute(P), example_inputs=inputs, optimizer="adam")
print("groups kept:", len(grp.executor.groups), "separate:", len(sep.executor.groups))
print(
    "peaks MiB: fused {:.1f} separate {:.1f} grouped {:.1f} (predicted {:.1f})".format(
        *tuple(
            x / 2**20
            for x in (
                measure_step_peak(fused, inputs),
                measure_step_peak(sep, inputs),
                measure_step_peak(grp, inputs),
                no_recompute(P).predicted_peak_bytes,
            )
        )
    )
)
for name, w in (("separate", sep), ("grouped", grp)):
    a, b = interleaved_samples(fused, w, inputs, 7)
    print(
        name,
        f"fused {statistics.median(a):.3f} wrapped {statistics.median(b):.3f} paired {paired_ratio(a, b)}",
    )
