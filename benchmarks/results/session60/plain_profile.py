"""Session 60 probe: where a plain ResNet-50 b8 224 training step (Adam) goes on this CPU:
torch.profiler over two steps (self CPU time by operator, then convolution forward and backward
by shape: per call and per step).

python benchmarks/results/session60/plain_profile.py > benchmarks/results/session60/plain_profile.txt
"""

import time

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile

from monet_opt.malloc import keep_freed_memory


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    x = torch.randn(8, 3, 224, 224)
    y = torch.randint(0, 1000, (8,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(2):
        step()
    t0 = time.perf_counter()
    step()
    print("step", time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(2):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    print("===== convolutions by (input, weight) shape: ms per call, calls per step")
    fwd, bwd = {}, {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::convolution_backward":
            s = e.input_shapes
            bwd[(tuple(s[1]), tuple(s[2]))] = (e.self_cpu_time_total / e.count / 1e3, e.count // 2)
        if e.key == "aten::mkldnn_convolution":
            s = e.input_shapes
            fwd[(tuple(s[0]), tuple(s[1]))] = (e.self_cpu_time_total / e.count / 1e3, e.count // 2)
    total_f = total_b = 0.0
    for k in sorted(bwd, key=lambda k: -bwd[k][0] * bwd[k][1]):
        b, c = bwd[k]
        f = fwd.get(k, (0.0, 0))[0]
        total_f, total_b = total_f + f * c, total_b + b * c
        print(k, c, f"fwd {f:.2f} bwd {b:.2f} ratio {b / f:.2f} per-step bwd {b * c:.1f}")
    print("per step: forward", round(total_f, 1), "backward", round(total_b, 1))


if __name__ == "__main__":
    main()
