"""Session 60 probe: ResNet-50 b8 224's 3x3 convolutions (and the 7x7 stem): oneDNN's backward on
NCHW tensors against (a) the same on channels_last copies (with the copies, and without), (b) the
input and weight gradients in separate calls, (c) the input gradient as a forward convolution
(stride 1) or a transposed one (stride 2). Median of 9 calls, ms, 2 threads.

python benchmarks/results/session60/conv3x3_backward_micro.py
"""

import statistics
import timeit

import torch
import torch.nn.functional as F

from monet_opt.malloc import keep_freed_memory

BACKWARD = torch.ops.aten.convolution_backward
CL = torch.channels_last
# (in, out, input side, kernel, stride, padding)
SHAPES = [(3, 64, 224, 7, 2, 3), (64, 64, 56, 3, 1, 1), (128, 128, 56, 3, 2, 1), (128, 128, 28, 3, 1, 1)]
SHAPES += [(256, 256, 28, 3, 2, 1), (256, 256, 14, 3, 1, 1), (512, 512, 14, 3, 2, 1), (512, 512, 7, 3, 1, 1)]


def median_ms(f, reps: int = 9) -> float:
    f()  # (warm-up)
    return statistics.median(timeit.repeat(f, number=1, repeat=reps)) * 1e3


def row(cin: int, cout: int, side: int, k: int, s: int, p: int) -> str:
    x = torch.relu(torch.randn(8, cin, side, side))
    w = torch.randn(cout, cin, k, k) * 0.05
    g = torch.randn_like(F.conv2d(x, w, stride=s, padding=p))
    xc, gc, wc = (
        x.contiguous(memory_format=CL),
        g.contiguous(memory_format=CL),
        w.contiguous(memory_format=CL),
    )

    def nchw(mask):
        return lambda: BACKWARD(g, x, w, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, mask)

    def with_copies():
        a, b = x.contiguous(memory_format=CL), g.contiguous(memory_format=CL)
        gi, gw, _ = BACKWARD(
            b, a, wc, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [cin != 3, True, False]
        )
        return (gi.contiguous() if gi is not None else None), gw.contiguous()

    def cl_only():
        return BACKWARD(gc, xc, wc, None, [s, s], [p, p], [1, 1], False, [0, 0], 1, [cin != 3, True, False])

    out = f"{cin}->{cout} {side}x{side} k{k} s{s}: forward {median_ms(lambda: F.conv2d(x, w, stride=s, padding=p)):.1f}"
    out += f" backward {median_ms(nchw([cin != 3, True, False])):.1f}"
    out += f" | channels_last with copies {median_ms(with_copies):.1f}, tensors already so {median_ms(cl_only):.1f}"
    if k == 3:
        out += f" | input grad {median_ms(nchw([True, False, False])):.1f}"
        out += f" weight grad {median_ms(nchw([False, True, False])):.1f}"
        if s == 1:
            wt = w.transpose(0, 1).flip(2, 3).contiguous()
            out += f" input grad as a forward {median_ms(lambda: F.conv2d(g, wt, padding=1)):.1f}"
        else:
            extra = side - ((side + 2 - 3) // s * s + 3 - 2)
            t = median_ms(lambda: F.conv_transpose2d(g, w, stride=s, padding=1, output_padding=extra))
            out += f" input grad as a transposed convolution {t:.1f}"
    return out


def main() -> None:
    keep_freed_memory()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for shape in SHAPES:
        print(row(*shape))


if __name__ == "__main__":
    main()
