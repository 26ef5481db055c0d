"""``flaggems``: FlagGems' Triton kernels (FL's DEFAULT kind, priority 150).

FlagGems' signatures differ from vLLM's, so each op is adapted here:
- norms take ``normalized_shape``; ``fused_add_rms_norm`` is in place like vLLM's;
- Gemma's ``(1 + w)`` scale is passed as a shifted weight (one tiny add per call);
- gated activations take the two halves ``(a, b)`` as strided views of the ``[..., 2d]``
  input (no copy: the H200 probe showed the strided read is where FlagGems loses);
- rope takes ``(q, k, cos, sin, position_ids)`` with ``[tokens, heads, rot]`` views of the
  rotated channels, in place.

FlagGems needs a GPU (Triton), so on CPU every candidate is unqualified with that reason.
"""
from __future__ import annotations

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ._util import (contiguous, dtype_reason, import_reason, requires, two_dims,
                    unit_last_stride)


def _fg():
    import flag_gems
    return flag_gems


def rms_norm(x, weight, eps):
    return _fg().rms_norm(x, [x.shape[-1]], weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    _fg().fused_add_rms_norm(x, residual, [x.shape[-1]], weight, eps)
    return x, residual


def gemma_rms_norm(x, weight, eps):
    return _fg().rms_norm(x, [x.shape[-1]], weight + 1.0, eps)


def gemma_fused_add_rms_norm(x, residual, weight, eps):
    # packed copies: the in-place kernel never sees the caller's (maybe strided) layout
    out = x.clone(memory_format=torch.contiguous_format)
    res = residual.clone(memory_format=torch.contiguous_format)
    _fg().fused_add_rms_norm(out, res, [x.shape[-1]], weight + 1.0, eps)
    return out, res


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return _fg().silu_and_mul(x[..., :d], x[..., d:])


def gelu_and_mul(x):
    d = x.shape[-1] // 2
    return _fg().gelu_and_mul(x[..., :d], x[..., d:], approximate="none")


def gelu_tanh_and_mul(x):
    d = x.shape[-1] // 2
    return _fg().gelu_and_mul(x[..., :d], x[..., d:], approximate="tanh")


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    rot = cos_sin_cache.shape[-1]
    n = query.shape[0]
    q = query.view(n, -1, head_size)[..., :rot]
    k = key.view(n, -1, head_size)[..., :rot]
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    # strided views of the rotated channels: FlagGems' in-place kernel takes every stride
    _fg().apply_rotary_pos_emb(q, k, cos, sin, positions, rotary_interleaved=not is_neox,
                               inplace=True)
    return query, key


# What FlagGems' kernels take (``OpImpl.supports``), measured on the H200 by
# benchmarks/layout_check.py (benchmarks/results/layouts-h200/): the in-place fused norm is
# wrong on column slices and padded rows, so it needs packed rows; the plain norm takes a row
# stride, per-head views and an fp32 weight; the gated activations and rope take any strides
# (pointwise kernels over strided halves and views); the Gemma fused-add adapter packs its
# copies before the in-place kernel.
_SUPPORTS = {"rms_norm": requires(unit_last_stride(0)),
             "gemma_rms_norm": requires(unit_last_stride(0)),
             "fused_add_rms_norm": requires(contiguous(0, 1)),
             "rotary_embedding": requires(unit_last_stride(1, 2), two_dims(1, 2))}

_FNS = {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm,
        "gemma_rms_norm": gemma_rms_norm, "gemma_fused_add_rms_norm": gemma_fused_add_rms_norm,
        "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul, "rotary_embedding": rotary_embedding}


def _qualify(ctx):
    if ctx.device_type != "cuda":
        return f"FlagGems needs a GPU (Triton kernels); this device is {ctx.device_type}"
    r = import_reason("flag_gems")
    if r:
        return f"{r} (pip install 'fltune[gpu]')"
    return dtype_reason(ctx)


def implementations():
    return [OpImpl(op_name=op, impl_id="default.flagos", kind=BackendImplKind.DEFAULT, fn=fn,
                   backend="flaggems", qualify=_qualify, precision_rank=1,
                   supports=_SUPPORTS.get(op))
            for op, fn in _FNS.items()]
