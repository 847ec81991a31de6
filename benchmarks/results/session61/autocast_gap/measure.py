"""Session 61: a bfloat16-autocast schedule whose measured peak exceeds its budget (a gap in the
memory model, found by a CI run of tests/test_autocast_training.py::
test_a_schedule_solved_under_autocast, whose profile was measured on a busy CPU and led the
solver to this schedule; on a quiet CPU the test picks another one and passes).

    PYTHONPATH=. python benchmarks/results/session61/autocast_gap/measure.py

resnet18 b4 64 (tests.models), bf16 autocast, budget 49319696 B (the lowest known peak),
predicted 49315472 B; measured 49355476 B in the first step, 49347476 B after (27780 B over the
budget), with this session's code and with session 60's (77350b1) alike. By stage
(`monet_opt.bench.measure_stage_peaks` under the same autocast): the binding stage,
backward:layer1_0_bn2, measures 32004 B over its prediction while the stages around it run
103932 B under: ~136 KB in that batch norm's backward under bfloat16 autocast that the profile
does not see (one bfloat16 layer1 activation is 131 KB: a cast of its gradient?).
"""

from pathlib import Path

from monet_opt import measure_peak
from monet_opt.runtime import MonetWrapper
from solver import Schedule
from tests import models
from tests.test_autocast_training import _autocast_step

HERE = Path(__file__).parent


def main() -> None:
    model, x = models.resnet18(batch=4, size=64)
    schedule = Schedule.from_json(HERE / "resnet18_bf16_schedule.json")
    wrapped = MonetWrapper(model, schedule, input_shape=tuple(x.shape))
    for step in range(2):
        peak = measure_peak(_autocast_step, wrapped, x).peak_bytes
        print(
            f"step {step}: measured {peak} B, budget {schedule.budget_bytes}, predicted "
            f"{schedule.predicted_peak_bytes}, over the budget by {peak - schedule.budget_bytes}"
        )


if __name__ == "__main__":
    main()
