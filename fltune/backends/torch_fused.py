"""``torch``: PyTorch's own fused/native kernels where the op has one.

Kind REFERENCE with priority 45: it is PyTorch (no vendor code), and ranking it below
FL's reference keeps the fixed FL order's pick exactly what vllm-plugin-FL picks.

These run in the input dtype (no fp32 upcast around the whole op), so they are a real
precision trade-off that the precision tiebreak sees: e.g. ``F.silu(a) * b`` in bf16
rounds twice where the reference rounds once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dispatch.types import BackendImplKind, OpImpl
from ._util import dtype_reason

PRIORITY = 45


def rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    residual.add_(x)
    x.copy_(F.rms_norm(residual, (x.shape[-1],), weight, eps))
    return x, residual


def gemma_rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight + 1.0, eps)


def gemma_fused_add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return F.rms_norm(s, (x.shape[-1],), weight + 1.0, eps), s


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


_FNS = {"rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm,
        "gemma_rms_norm": gemma_rms_norm, "gemma_fused_add_rms_norm": gemma_fused_add_rms_norm,
        "silu_and_mul": silu_and_mul, "gelu_and_mul": gelu_and_mul,
        "gelu_tanh_and_mul": gelu_tanh_and_mul}


def _qualify(ctx):
    if not hasattr(F, "rms_norm"):
        return f"torch {torch.__version__} has no torch.nn.functional.rms_norm (needs >= 2.4)"
    return dtype_reason(ctx)


def implementations():
    return [OpImpl(op_name=op, impl_id="reference.torch_fused", kind=BackendImplKind.REFERENCE,
                   fn=fn, priority=PRIORITY, backend="torch", qualify=_qualify,
                   precision_rank=2)
            for op, fn in _FNS.items()]
