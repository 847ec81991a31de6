"""timm and Hugging Face model families through the whole pipeline: trace, profile, solve, one
wrapped training step.

    python benchmarks/model_sweep.py [--family timm|hf|hf-loss|torchvision] [--out DIR] [--only NAME ...]

Each model (random weights; timm: batch 2, 64x64 unless the model fixes its input size; Hugging
Face: a tiny configuration, 2 layers of width 64, token ids of batch 8 x 64, logits out) runs in a
process of its own (a crash or a hang is one row, not the sweep): traced, profiled, solved for
10 s at 0.4 of the way from the lowest feasible peak to plain PyTorch's
(`tests.test_runtime.budget_at`), then one wrapped step is checked against plain PyTorch the
way the tests check (`tests.test_transformers_timm._check`): the same gradients (rtol 1e-5,
atol 1e-5 of the largest gradient, at least 1e-6), twice (recorded, then replayed), the measured
peak inside the budget and within 5 % of the prediction (an image model failing on a gradient is
run plainly again, at 1 thread: its row shows how far plain PyTorch differs from itself on that
gradient, float32 summation order alone). `bitwise` rows offer only implementations
whose gradients are torch's bit for bit. torchvision: one or two classification models per family,
batch 2, 64x64 where the model takes it, three segmentation and two video models, 0.4 of the way. Writes DIR/model_sweep.md (timm),
DIR/model_sweep_hf.md or DIR/model_sweep_tv.md. hf-loss: the same Hugging Face models themselves,
given `{'input_ids': x, 'labels': x}` (and `use_cache=False` where the forward takes it) and
trained on the loss they return (`tests.test_transformers_timm.check_own_loss`), to
DIR/model_sweep_hf_loss.md; with `--outputs-held loss`, solved for and run by a loop that drops
the output before the backward, to DIR/model_sweep_hf_loss_dropped.md. `--channels-last` (timm, torchvision): models and inputs
channels_last, as a user training them so would (`monet_opt.input_layout`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from solver.jsonio import atomic_write_text

# (timm name, image size, create_model keyword arguments, bitwise)
MODELS = [
    ("resnet18", 64, {}, False),
    ("efficientnet_b0", 64, {}, False),
    ("efficientnet_b0", 64, {}, True),
    ("mobilenetv3_small_100", 64, {}, False),
    ("regnetx_002", 64, {}, False),
    ("densenet121", 64, {}, False),
    ("ghostnet_100", 64, {}, False),
    ("poolformer_s12", 64, {}, False),
    ("levit_128s", 224, {}, False),
    ("mobilevit_xxs", 64, {}, False),
    ("edgenext_xx_small", 64, {}, False),
    ("repvit_m1", 64, {}, False),
    ("fastvit_t8", 64, {}, False),
    ("res2net50_14w_8s", 64, {}, False),
    ("resnest14d", 64, {}, False),
    ("dla34", 64, {}, False),
    ("cspresnet50", 64, {}, False),
    ("rexnet_100", 64, {}, False),
    ("rexnet_100", 64, {}, True),
    ("tinynet_e", 64, {}, False),
    ("dm_nfnet_f0", 64, {}, False),
    ("inception_v3", 96, {}, False),
    ("xception41", 64, {}, False),
    ("hrnet_w18_small", 64, {}, False),
    ("coatnet_0_rw_224", 224, {}, False),
    ("maxvit_nano_rw_256", 256, {}, False),
    ("efficientvit_b0", 64, {}, False),
    ("swin_tiny_patch4_window7_224", 224, {}, False),  # stochastic depth on by default
    ("deit_tiny_patch16_224", 224, {"drop_path_rate": 0.1}, False),
    ("mixer_s32_224", 224, {}, False),
    ("efficientformer_l1", 224, {}, False),
    ("resmlp_12_224", 224, {}, False),
    ("convnext_atto", 64, {"drop_path_rate": 0.2}, False),
    ("vit_tiny_patch16_224", 32, {"drop_path_rate": 0.2, "img_size": 32, "patch_size": 8}, False),
]

# torchvision classification models, one or two per family: (name, image size, keyword arguments)
TV_MODELS = [
    ("alexnet", (2, 3, 64, 64), {}),
    ("vgg11_bn", (2, 3, 64, 64), {}),
    ("resnext50_32x4d", (2, 3, 64, 64), {}),
    ("wide_resnet50_2", (2, 3, 64, 64), {}),
    ("densenet121", (2, 3, 64, 64), {}),
    ("squeezenet1_1", (2, 3, 64, 64), {}),
    ("shufflenet_v2_x1_0", (2, 3, 64, 64), {}),
    ("mobilenet_v3_small", (2, 3, 64, 64), {}),
    ("mnasnet0_5", (2, 3, 64, 64), {}),
    ("efficientnet_b0", (2, 3, 64, 64), {}),
    ("efficientnet_v2_s", (2, 3, 64, 64), {}),
    ("regnet_y_400mf", (2, 3, 64, 64), {}),
    ("regnet_x_400mf", (2, 3, 64, 64), {}),
    ("convnext_tiny", (2, 3, 64, 64), {"stochastic_depth_prob": 0.2}),
    ("swin_t", (2, 3, 64, 64), {}),
    ("swin_v2_t", (2, 3, 64, 64), {}),
    ("maxvit_t", (2, 3, 224, 224), {}),
    ("vit_b_16", (2, 3, 32, 32), {"image_size": 32}),
    ("googlenet", (2, 3, 64, 64), {"aux_logits": True, "init_weights": False}),  # train(): a namedtuple out
    ("inception_v3", (2, 3, 96, 96), {"aux_logits": False, "init_weights": False}),
    # segmentation (a dict out) and video (5-d input)
    ("lraspp_mobilenet_v3_large", (2, 3, 64, 64), {"weights_backbone": None}),
    ("deeplabv3_mobilenet_v3_large", (2, 3, 64, 64), {"weights_backbone": None}),
    ("fcn_resnet50", (2, 3, 64, 64), {"weights_backbone": None}),
    ("r3d_18", (2, 3, 8, 32, 32), {}),
    ("r2plus1d_18", (2, 3, 8, 32, 32), {}),
]

# Hugging Face: (name, config class, model class, config keyword arguments); vocabulary 256
_LLAMA_LIKE = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    intermediate_size=128,
    max_position_embeddings=64,
)
_BERT_LIKE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128)
HF_MODELS = [
    ("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_layer=2, n_embd=64, n_head=4, n_positions=64)),
    ("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_BERT_LIKE, max_position_embeddings=64)),
    (
        "opt",
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=128,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
        ),
    ),
    ("llama", "LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    ("mistral", "MistralConfig", "MistralForCausalLM", _LLAMA_LIKE),
    ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE),
    ("gemma", "GemmaConfig", "GemmaForCausalLM", dict(_LLAMA_LIKE, head_dim=16)),
    ("phi", "PhiConfig", "PhiForCausalLM", dict(_BERT_LIKE, max_position_embeddings=64)),
    ("bloom", "BloomConfig", "BloomForCausalLM", dict(n_layer=2, hidden_size=64, n_head=4)),
    (
        "falcon",
        "FalconConfig",
        "FalconForCausalLM",
        dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4),
    ),
    ("bert", "BertConfig", "BertForMaskedLM", _BERT_LIKE),
    ("roberta", "RobertaConfig", "RobertaForMaskedLM", dict(_BERT_LIKE, max_position_embeddings=80)),
    (
        "distilbert",
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(n_layers=2, dim=64, n_heads=4, hidden_dim=128, max_position_embeddings=64),
    ),
    (
        "albert",
        "AlbertConfig",
        "AlbertForMaskedLM",
        dict(_BERT_LIKE, embedding_size=32, max_position_embeddings=64),
    ),
    (
        "electra",
        "ElectraConfig",
        "ElectraForMaskedLM",
        dict(_BERT_LIKE, embedding_size=32, max_position_embeddings=64),
    ),
    ("deberta_v2", "DebertaV2Config", "DebertaV2ForMaskedLM", dict(_BERT_LIKE, max_position_embeddings=64)),
]

ONE_HF = """
import sys, torch, transformers
import tests.test_transformers_timm as T
from monet_opt.models import TokenLogits
name, config, cls, kw = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
torch.manual_seed(0)
model = TokenLogits(getattr(transformers, cls)(getattr(transformers, config)(vocab_size=256, **kw))).train()
x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
T._check(model, x, 0.5, name, input_shape=tuple(x.shape))
"""

ONE_HF_LOSS = """
import inspect, sys, torch, transformers
import tests.test_transformers_timm as T
name, config, cls, kw, held = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
model = getattr(transformers, cls)(getattr(transformers, config)(vocab_size=256, **kw)).train()
x = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
inputs = {"input_ids": x, "labels": x}
if "use_cache" in inspect.signature(model.forward).parameters:
    inputs["use_cache"] = False
T.check_own_loss(model, inputs, 0.5, name, outputs_held=held)
"""

# The end of the image families' scripts: the pipeline's check; or, with MONET_SWEEP_PLAIN_NOISE set
# to a parameter's name, plain PyTorch's own float32 noise on its gradient (1 thread against the
# default count: another summation order, as an implementation within float rounding has;
# `plain_gradient_noise.grads_at_one_thread`).
CHECK_OR_PLAIN_NOISE = """
import os
param = os.environ.get("MONET_SWEEP_PLAIN_NOISE")
if param:
    from benchmarks.plain_gradient_noise import grads_at_one_thread
    threads, at_default, at_one = grads_at_one_thread(model, x)
    print(f"{threads} {float((at_default[param] - at_one[param]).abs().max()):.3g}")
else:
    T._check(model, x, 0.4, name, example_inputs=(x,))
"""

ONE_TV = (
    """
import sys, torch, torchvision
import tests.test_transformers_timm as T
name, shape, kw = sys.argv[1], eval(sys.argv[2]), eval(sys.argv[3])
torch.manual_seed(0)
model = torchvision.models.get_model(name, weights=None, num_classes=10, **kw).train()
x = torch.randn(*shape)
if sys.argv[-1] == "channels_last":  # (--channels-last: model and input, 3-d for video)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    model, x = model.to(memory_format=fmt), x.contiguous(memory_format=fmt)
"""
    + CHECK_OR_PLAIN_NOISE
)

ONE = (
    """
import functools, sys, torch, timm
import tests.test_transformers_timm as T
from monet_opt.profile import build_problem
name, size, kw, bitwise = sys.argv[1], int(sys.argv[2]), eval(sys.argv[3]), sys.argv[4] == "1"
if bitwise:
    T.build_problem = functools.partial(build_problem, bitwise=True)
torch.manual_seed(0)
model = timm.create_model(name, pretrained=False, num_classes=10, **kw).train()
x = torch.randn(2, 3, size, size)
if sys.argv[-1] == "channels_last":  # (--channels-last: model and input, 3-d for video)
    fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    model, x = model.to(memory_format=fmt), x.contiguous(memory_format=fmt)
"""
    + CHECK_OR_PLAIN_NOISE
)


def run_one(argv: list[str], timeout: float) -> tuple[str, float, str]:
    t0 = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", *argv], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, f"over {timeout:.0f} s"
    seconds = time.perf_counter() - t0
    if done.returncode == 0:
        return "ok", seconds, ""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return "FAIL", seconds, (lines[-1] if lines else f"exit {done.returncode}")[:300]


# a row's failure on a gradient (`tests.test_runtime.assert_grads_close`): the parameter, the difference
GRAD_FAILURE = re.compile(r"grad of (\S+): max abs diff ([0-9.e+-]+)")


def plain_noise(argv: list[str], param: str, timeout: float) -> tuple[int, float] | None:
    """(the default thread count, plain PyTorch's own largest difference on `param`'s gradient
    between it and 1 thread), run as the row's own script; None if that run failed."""
    env = {**os.environ, "MONET_SWEEP_PLAIN_NOISE": param}
    try:
        done = subprocess.run(
            [sys.executable, "-c", *argv], capture_output=True, text=True, timeout=timeout, env=env
        )
        threads, diff = done.stdout.split()[-2:]
        return int(threads), float(diff)
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["timm", "hf", "hf-loss", "torchvision"], default="timm")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--only", nargs="*", help="timm names to run (default: all)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per model")
    ap.add_argument(
        "--channels-last",
        action="store_true",
        help="timm, torchvision: model and input channels_last (channels_last_3d for video), "
        "to DIR/model_sweep[_tv]_channels_last.md",
    )
    ap.add_argument(
        "--outputs-held",
        choices=("all", "loss"),
        default="all",
        help="hf-loss: 'loss' solves for, and runs, a loop that drops the output before the backward",
    )
    args = ap.parse_args(argv)
    if args.channels_last and args.family not in ("timm", "torchvision"):
        ap.error("--channels-last is for the image families (timm, torchvision)")
    layout = ["channels_last" if args.channels_last else "contiguous"]
    if args.family == "timm":
        runs = [
            (name, str(size), [ONE, name, str(size), repr(kw), "1" if bitwise else "0", *layout], kw, bitwise)
            for name, size, kw, bitwise in MODELS
        ]
    elif args.family == "torchvision":
        runs = [
            (name, "x".join(map(str, shape)), [ONE_TV, name, repr(shape), repr(kw), *layout], kw, False)
            for name, shape, kw in TV_MODELS
        ]
    else:  # hf: token ids in, logits out; hf-loss: the model itself, by keyword, on its own loss
        script, held = (ONE_HF, []) if args.family == "hf" else (ONE_HF_LOSS, [args.outputs_held])
        runs = [
            (name, "8x64", [script, name, config, cls, repr(kw), *held], {}, False)
            for name, config, cls, kw in HF_MODELS
        ]
    runs = [r for r in runs if not args.only or r[0] in args.only]
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    rows = []
    images = not args.family.startswith("hf")
    within_noise = 0
    for name, size, argv, kw, bitwise in runs:
        status, seconds, detail = run_one(argv, args.timeout)
        found = GRAD_FAILURE.search(detail) if status == "FAIL" and images else None
        noise = plain_noise(argv, found.group(1), args.timeout) if found else None
        if noise is not None:
            threads, diff = noise
            within_noise += float(found.group(2)) <= diff
            detail += f" (plain PyTorch itself, 1 thread against {threads}: {diff:.3g})"
        options = ", ".join([f"{k}={v}" for k, v in kw.items()] + (["bitwise"] if bitwise else []))
        print(f"{status:7s} {name} {size} {options} {seconds:.0f} s {detail}", flush=True)
        rows.append(
            f"| {name} | {size} | {options} | {status} | {seconds:.0f} | {detail.replace('|', '/')} |"
        )
    passed = sum(1 for r in rows if "| ok |" in r)
    noise_note = (
        f" {within_noise} of the failing rows differ from plain PyTorch by no more than plain PyTorch"
        " differs from itself on 1 thread (the same gradient; float32 summation order)."
        if within_noise
        else ""
    )
    title = {
        "timm": "timm",
        "hf": "Hugging Face",
        "hf-loss": "Hugging Face (by keyword, own loss)",
        "torchvision": "torchvision",
    }[args.family]
    column = {"timm": "image", "hf": "tokens", "hf-loss": "tokens", "torchvision": "input"}[args.family]
    text = "\n".join(
        [
            f"### {title} models through the pipeline ({started})",
            "",
            f"`python benchmarks/model_sweep.py --family {args.family}"
            f"{' --outputs-held loss' if args.outputs_held == 'loss' else ''}"
            f"{' --channels-last' if args.channels_last else ''}"
            f"{' --only ' + ' '.join(args.only) if args.only else ''}`: {passed} of {len(rows)} rows pass "
            f"(10-s solves at {0.4 if images else 0.5} of the way from the lowest feasible "
            "peak to plain's; gradients, budget and prediction checked as the tests do)." + noise_note,
            "",
            f"| model | {column} | options | result | s | what failed |",
            "|---|---:|---|---|---:|---|",
            *rows,
            "",
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = (
        out
        / {
            "timm": "model_sweep.md",
            "hf": "model_sweep_hf.md",
            "hf-loss": "model_sweep_hf_loss.md"
            if args.outputs_held == "all"
            else "model_sweep_hf_loss_dropped.md",
            "torchvision": "model_sweep_tv.md",
        }[args.family]
    )
    if args.channels_last:
        path = path.with_name(path.stem + "_channels_last.md")
    atomic_write_text(path, text)
    print(f"wrote {path}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
