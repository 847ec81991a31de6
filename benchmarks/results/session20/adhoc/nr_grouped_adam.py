"""Session 20: wrapped no-recompute schedule with Adam in the backward, shared graphs (the
parameters stepped inside the engine call) vs fused plain: peak vs predicted, paired time."""

import copy
import statistics
import sys
from pathlib import Path

import torch

import solver
from monet_opt.bench import interleaved_samples, measure_step_peak, paired_ratio
from monet_opt.malloc import keep_freed_memory
from monet_opt.runtime import MonetWrapper
from monet_opt.step_in_backward import fuse_into_backward, optimizer_factory
from monet_opt.zoo import ModelSpec
from solver.baselines import no_recompute

keep_freed_memory()
RESULTS = Path(__file__).resolve().parents[2]
P = solver.Problem.from_json(
    RESULTS / "session19/frontier_refine/schedules/resnet50_adam_0.3333_refined_problem.json"
)
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
spec = ModelSpec("resnet50", batch=8, image=224)
torch.manual_seed(0)
model = spec.build().train()
inputs = spec.example_inputs()
fused = copy.deepcopy(model)
fuse_into_backward(fused, optimizer_factory("adam"))
schedule = no_recompute(P)
grp = MonetWrapper(copy.deepcopy(model), schedule, example_inputs=inputs, optimizer="adam")
print("groups:", len(grp.executor.groups))
peaks = [measure_step_peak(w, inputs) / 2**20 for w in (fused, grp)]
print(
    f"peaks MiB: fused {peaks[0]:.1f} wrapped {peaks[1]:.1f} "
    f"(predicted {schedule.predicted_peak_bytes / 2**20:.1f})"
)
a, b = interleaved_samples(fused, grp, inputs, rounds)
print(f"fused {statistics.median(a):.3f} s wrapped {statistics.median(b):.3f} s paired {paired_ratio(a, b)}")
