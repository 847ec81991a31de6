"""Session 59 probe: ResNet-50 b8 224's 1x1 convolutions, torch's conv2d (oneDNN on NCHW) against
"gemm_backward" (`monet_opt.ops.conv.Conv2dGemm`), forward and forward + backward, one layer each
(2 threads, freed memory kept; median of 11 calls, ms).

python benchmarks/results/session59/conv1x1_micro.py
python benchmarks/results/session59/conv1x1_micro.py --strided   (session 60: layer2-4's stride-2
    downsamples, "gemm_backward" with a stride; output in results/session60/)
"""

import sys
import time

import torch
from torch import nn

from monet_opt.malloc import keep_freed_memory
from monet_opt.ops import implementations_for

# (in channels, out channels, side): layer1 .. layer4's 1x1 convolutions, batch 8
SHAPES = [(256, 64, 56), (64, 256, 56), (512, 128, 28), (128, 512, 28), (1024, 256, 14), (256, 1024, 14)]
SHAPES += [(2048, 512, 7), (512, 2048, 7)]
STRIDED = [(256, 512, 56), (512, 1024, 28), (1024, 2048, 14)]  # (input side; stride 2)


def median_ms(f, reps: int = 11) -> float:
    f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2] * 1e3


def row(cin: int, cout: int, side: int, stride: int) -> list[float]:
    conv = nn.Conv2d(cin, cout, 1, stride=stride, bias=False)
    x = torch.relu(torch.randn(8, cin, side, side)).requires_grad_()
    found = {i.name: i for i in implementations_for("call_module", conv, (x,), {})}
    out = []
    for name in ("default", "gemm_backward"):
        run = found[name].run
        g = torch.randn(8, cout, side // stride, side // stride)
        out.append(median_ms(lambda run=run: run(conv, (x,), {}, False)))
        out.append(
            median_ms(
                lambda run=run, g=g: torch.autograd.grad(run(conv, (x,), {}, False), [x, conv.weight], g)
            )
        )
    return out


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    stride = 2 if "--strided" in sys.argv else 1
    for cin, cout, side in STRIDED if stride == 2 else SHAPES:
        t = row(cin, cout, side, stride)
        print(
            f"8x{cin}x{side}x{side} -> {cout}, stride {stride}: forward torch {t[0]:.2f} gemm {t[2]:.2f}; "
            f"forward+backward torch {t[1]:.2f} gemm {t[3]:.2f}"
        )


if __name__ == "__main__":
    main()
