"""Scaled dot-product attention: backend choices and query-chunked execution.

- "default": F.scaled_dot_product_attention as written (torch picks the backend).
- "math": the MATH backend (materializes and keeps the L x S attention matrix for backward).
- "flash" / "efficient" / "cudnn": fused backends, offered only when a trial run (forward and
  backward, on small tensors of the node's dtype/device/head size, with its mask/causality) works
  and torch would not pick that backend by default anyway (then it would duplicate "default").
- "query_chunked": queries are split into 4 chunks; forward runs each chunk; backward recomputes one
  chunk at a time (so only one chunk's attention matrix is live). Keeps only q, k, v (+ mask).
  is_causal is turned into an explicit per-chunk mask with the correct offset.
Only "default" is offered (and used at run time) when dropout_p > 0 or the mask requires grad.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .base import Implementation

_SDPA = F.scaled_dot_product_attention
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
QUERY_CHUNKS = 4


def sdpa_params(args: tuple, kwargs: dict) -> dict:
    p = dict(_DEFAULTS)
    p.update(dict(zip(_NAMES, args)))
    p.update(kwargs)
    return p


def _sdpa(p: dict) -> torch.Tensor:
    kw = {k: v for k, v in p.items() if k not in ("query", "key", "value")}
    if not kw.get("enable_gqa"):
        kw.pop("enable_gqa", None)
    return _SDPA(p["query"], p["key"], p["value"], **kw)


def _chunk_mask(attn_mask, is_causal, q0, q1, S, device):
    """Mask for query rows [q0, q1): slice of attn_mask, or the causal (top-left aligned) band."""
    if is_causal:
        return torch.ones(q1 - q0, S, dtype=torch.bool, device=device).tril(q0)
    if attn_mask is None:
        return None
    if attn_mask.dim() >= 2 and attn_mask.size(-2) != 1:
        return attn_mask[..., q0:q1, :]
    return attn_mask


def _empty_in_order_of(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """An empty tensor of `shape` whose dimensions lie in memory in the order of `like`'s: torch's
    attention returns its output in the query's layout (a (B, S, H, D) projection's transposed
    view gives a (B, H, S, D) output whose transpose back is contiguous, so a model's
    `.transpose(1, 2).contiguous()` after it copies nothing); a contiguous output there made the
    runtime copy where the profile saw none (measured: a Llama-style model 196 KB over budget)."""
    order = _dim_order(like)
    base = like.new_empty([shape[d] for d in order])
    return base.permute([order.index(d) for d in range(like.dim())])


def _dim_order(t: torch.Tensor) -> list[int]:
    return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))


def _in_layout_of(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`y` with its dimensions in memory in `like`'s order (a differentiable copy if they are not;
    `y` itself if they are). The math backend returns a contiguous output whatever the query's
    layout, where torch's default returns the query's (`_empty_in_order_of`)."""
    if y.dim() != like.dim() or _dim_order(y) == _dim_order(like):
        return y
    order = _dim_order(like)
    return y.permute(order).contiguous().permute([order.index(d) for d in range(y.dim())])


class QueryChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, enable_gqa, chunks):
        L, S = q.size(-2), k.size(-2)
        size = -(-L // max(1, min(chunks, L)))
        out = None
        for q0 in range(0, L, size):
            q1 = min(q0 + size, L)
            m = _chunk_mask(attn_mask, is_causal, q0, q1, S, q.device)
            o = _sdpa(
                dict(query=q[..., q0:q1, :], key=k, value=v, attn_mask=m, scale=scale, enable_gqa=enable_gqa)
            )
            if out is None:
                out = _empty_in_order_of(o, o.shape[:-2] + (L, o.size(-1)))
            out[..., q0:q1, :].copy_(o)
            del o
        ctx.params = (is_causal, scale, enable_gqa, size)
        ctx.has_mask = attn_mask is not None
        ctx.save_for_backward(q, k, v, attn_mask)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, attn_mask = ctx.saved_tensors
        is_causal, scale, enable_gqa, size = ctx.params
        L, S = q.size(-2), k.size(-2)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        gq = torch.empty_like(q) if need_q else None
        gk = gv = None
        kd = k.detach().requires_grad_(need_k)
        vd = v.detach().requires_grad_(need_v)
        for q0 in range(0, L, size):
            q1 = min(q0 + size, L)
            m = _chunk_mask(attn_mask, is_causal, q0, q1, S, q.device)
            qc = q[..., q0:q1, :].detach().requires_grad_(need_q)
            with torch.enable_grad():
                o = _sdpa(dict(query=qc, key=kd, value=vd, attn_mask=m, scale=scale, enable_gqa=enable_gqa))
            inputs = [t for t, need in ((qc, need_q), (kd, need_k), (vd, need_v)) if need]
            grads = list(torch.autograd.grad(o, inputs, g[..., q0:q1, :]))
            del o
            if need_q:
                gq[..., q0:q1, :].copy_(grads.pop(0))
            if need_k:
                c = grads.pop(0)
                gk = c if gk is None else gk.add_(c)
            if need_v:
                c = grads.pop(0)
                gv = c if gv is None else gv.add_(c)
        return gq, gk, gv, None, None, None, None, None


def query_chunked_attention(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, chunks=QUERY_CHUNKS
):
    if dropout_p > 0 or (attn_mask is not None and attn_mask.requires_grad):
        raise ValueError("query_chunked attention supports neither dropout nor a mask requiring grad")
    if is_causal and attn_mask is not None:
        raise RuntimeError("attn_mask and is_causal cannot both be set")
    return QueryChunkedAttention.apply(q, k, v, attn_mask, bool(is_causal), scale, bool(enable_gqa), chunks)


def _run_default(target, args, kwargs, recompute):
    return target(*args, **kwargs)


def _chunkable(p: dict) -> bool:
    m = p["attn_mask"]
    return not (p["dropout_p"] and p["dropout_p"] > 0) and not (m is not None and m.requires_grad)


def _run_chunked(target, args, kwargs, recompute):
    p = sdpa_params(args, kwargs)
    if not _chunkable(p):
        return target(*args, **kwargs)
    return query_chunked_attention(
        p["query"], p["key"], p["value"], p["attn_mask"], 0.0, p["is_causal"], p["scale"], p["enable_gqa"]
    )


def _make_backend(backend):
    def run(target, args, kwargs, recompute):
        p = sdpa_params(args, kwargs)
        if p["dropout_p"] and p["dropout_p"] > 0:
            return target(*args, **kwargs)
        with sdpa_kernel(backend):
            return _in_layout_of(target(*args, **kwargs), p["query"])

    return run


_FUSED = (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION"))


def _noise(shape: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """Random trial values from a generator of their own: building an executor (a wrapper, or
    one for a new input shape inside a training step) must not move the caller's RNG, or the
    step's dropout masks would differ from plain PyTorch's."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=generator).to(dtype=dtype, device=device)


def _trial_params(p: dict | None) -> dict:
    """Small real tensors with the node's dtype, device, head size, GQA layout, mask kind and causality."""
    if p is None or not isinstance(p.get("query"), torch.Tensor):
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        q = _noise([1, 2, 8, 16], torch.float32, dev)
        return dict(
            query=q,
            key=q.clone(),
            value=q.clone(),
            attn_mask=None,
            dropout_p=0.0,
            is_causal=False,
            scale=None,
            enable_gqa=False,
        )
    q, k, v = p["query"], p["key"], p["value"]
    L, S = 8, 8

    def small(t, length):
        shape = list(t.shape)
        shape[-2] = length
        shape = [min(s, 2) for s in shape[:-3]] + shape[-3:]
        return _noise(shape, t.dtype, t.device if not t.is_meta else "cpu")

    out = dict(p)
    out.update(query=small(q, L), key=small(k, S), value=small(v, S))
    m = p["attn_mask"]
    if isinstance(m, torch.Tensor):
        shape = list(m.shape)
        if len(shape) >= 2:
            shape[-2] = L if shape[-2] != 1 else 1
            shape[-1] = S if shape[-1] != 1 else 1
        shape = [min(s, 2) for s in shape]
        dev = m.device if not m.is_meta else "cpu"
        out["attn_mask"] = (
            torch.ones(shape, dtype=torch.bool, device=dev)
            if m.dtype == torch.bool
            else torch.zeros(shape, dtype=m.dtype, device=dev)
        )
    for name in ("query", "key", "value"):
        out[name].requires_grad_(True)
    return out


def _works(backend, p: dict) -> bool:
    try:
        with sdpa_kernel(backend):
            o = _sdpa(p)
            o.sum().backward()
        return True
    except Exception:
        return False


def _default_choice(p: dict) -> int | None:
    kw = {"scale": p["scale"]}
    if p["enable_gqa"]:
        kw["enable_gqa"] = True
    try:
        return int(
            torch._fused_sdp_choice(
                p["query"], p["key"], p["value"], p["attn_mask"], p["dropout_p"], p["is_causal"], **kw
            )
        )
    except Exception:
        return None


# ------------------------------------------------------------------ nn.MultiheadAttention (an fx leaf)
#
# In training, nn.MultiheadAttention called with need_weights=False computes its attention with
# F.scaled_dot_product_attention (looked up in torch.nn.functional at call time). "math" runs the
# module under the MATH backend; "query_chunked" swaps in the chunked attention for the duration
# of the call. With need_weights=True the module uses its own explicit softmax path and these
# behave like default.


def _sdpa_chunked_or_plain(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    p = dict(
        query=query,
        key=key,
        value=value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    if not _chunkable(p):
        return _sdpa(p)
    return query_chunked_attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa)


@contextmanager
def _sdpa_swapped(fn) -> Iterator[None]:
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _mha_math(target, args, kwargs, recompute):
    with sdpa_kernel(SDPBackend.MATH):
        return target(*args, **kwargs)


def _mha_chunked(target, args, kwargs, recompute):
    with _sdpa_swapped(_sdpa_chunked_or_plain):
        return target(*args, **kwargs)


def _mha_implementations(target: nn.MultiheadAttention) -> list[Implementation]:
    default = Implementation("default", _run_default, "nn.MultiheadAttention as written")
    if target.training and target.dropout > 0:
        return [default]
    return [
        default,
        Implementation(
            "math",
            _mha_math,
            "MultiheadAttention with the MATH SDPA backend (keeps attention matrix)",
            bitwise=False,  # another kernel than torch's own choice
        ),
        Implementation(
            "query_chunked",
            _mha_chunked,
            f"MultiheadAttention with query-chunked attention ({QUERY_CHUNKS} chunks, recomputed in backward)",
            bitwise=False,
        ),
    ]


def matches(op: str, target: Any) -> bool:
    if op == "call_module":
        return isinstance(target, nn.MultiheadAttention)
    return op == "call_function" and target is _SDPA


def implementations(op: str, target: Any, example_args=None, example_kwargs=None) -> list[Implementation]:
    if op == "call_module":
        return _mha_implementations(target)
    default = Implementation(
        "default", _run_default, "scaled_dot_product_attention with torch's backend choice"
    )
    p = None
    if example_args is not None:
        try:
            p = sdpa_params(tuple(example_args), dict(example_kwargs or {}))
        except Exception:
            p = None
    if p is not None and not _chunkable(p):
        return [default]
    impls = [
        default,
        Implementation(
            "math",
            _make_backend(SDPBackend.MATH),
            "MATH backend: materializes the attention matrix and keeps it for backward",
            bitwise=False,
        ),
    ]
    trial = _trial_params(p)
    choice = _default_choice(trial)
    for name, attr in _FUSED:
        backend = getattr(SDPBackend, attr, None)
        if backend is None or int(backend) == choice:
            continue
        if _works(backend, trial):
            impls.append(
                Implementation(name, _make_backend(backend), f"{attr} backend (fused kernel)", bitwise=False)
            )
    impls.append(
        Implementation(
            "query_chunked",
            _run_chunked,
            f"queries in {QUERY_CHUNKS} chunks, recomputed chunk by chunk in backward; keeps only q, k, v",
            bitwise=False,
        )
    )
    return impls


IMPLEMENTATION_NAMES = {
    "scaled_dot_product_attention": ["default", "math", "flash*", "efficient*", "cudnn*", "query_chunked"],
    "nn.MultiheadAttention (need_weights=False, no dropout)": ["default", "math", "query_chunked"],
}
