"""RMSNorm family, with vLLM's semantics.

- ``rms_norm(x, weight, eps) -> out`` — vLLM ``RMSNorm`` / ``_C.rms_norm``.
- ``fused_add_rms_norm(x, residual, weight, eps) -> (x, residual)`` — **in place**, like
  ``_C.fused_add_rms_norm``: ``residual`` becomes ``x + residual`` and ``x`` its norm.
- ``gemma_rms_norm(x, weight, eps)`` and ``gemma_fused_add_rms_norm(x, residual, weight,
  eps) -> (out, residual)`` — ``GemmaRMSNorm``: scale by ``(1 + w)``, out of place; what
  Qwen3.5 uses for every layer norm and for q/k norms.
- ``rms_norm_gated(x, z, weight, eps, group_size, norm_before_gate)`` — ``RMSNormGated``
  in Qwen3.5's gated-delta-net: ``rmsnorm(x) * w * silu(z)`` (or the norm of ``x*silu(z)``
  when ``norm_before_gate`` is false), normalised per group of ``group_size`` channels
  (0 = the whole row).

Every reference computes in fp32 (fp64 when given fp64 inputs) and casts back once at the
end, which is what vLLM's ``forward_native`` does and what makes it the precise yardstick.
Norm inputs are ``[rows, hidden]`` with ``rows = tokens * rows_per_token`` (q/k norms run
per head, so one token is several rows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import OpSpec, normal
from .layouts import column_slice, fp32_arg, padded_rows, per_head, split_of_one_buffer


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(var + eps)


def rms_norm_ref(x, weight, eps):
    a = _acc(x)
    return (_normalize(x.to(a), eps) * weight.to(a)).to(x.dtype)


def fused_add_rms_norm_functional(x, residual, weight, eps):
    a = _acc(x)
    s = x.to(a) + residual.to(a)
    return (_normalize(s, eps) * weight.to(a)).to(x.dtype), s.to(residual.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps):
    out, s = fused_add_rms_norm_functional(x, residual, weight, eps)
    residual.copy_(s)
    x.copy_(out)
    return x, residual


def gemma_rms_norm_ref(x, weight, eps):
    a = _acc(x)
    return (_normalize(x.to(a), eps) * (1.0 + weight.to(a))).to(x.dtype)


def gemma_fused_add_rms_norm_ref(x, residual, weight, eps):
    a = _acc(x)
    s = x.to(a) + residual.to(a)
    return (_normalize(s, eps) * (1.0 + weight.to(a))).to(x.dtype), s.to(x.dtype)


def rms_norm_gated_ref(x, z, weight, eps, group_size, norm_before_gate):
    a = _acc(x)
    xf, zf = x.to(a), z.to(a)
    if not norm_before_gate:
        xf = xf * F.silu(zf)
    hidden = xf.shape[-1]
    g = group_size or hidden
    xg = xf.reshape(*xf.shape[:-1], hidden // g, g)
    y = _normalize(xg, eps).reshape(xf.shape) * weight.to(a)
    if norm_before_gate:
        y = y * F.silu(zf)
    return y.to(x.dtype)


# ---- inputs ---------------------------------------------------------------------------

def _rows(n, dims):
    return n * int(dims.get("rows_per_token", 1))


def _x_and_weight(n, dims, dtype, device, gen, gemma=False):
    h = int(dims["hidden"])
    x = normal((_rows(n, dims), h), dtype, device, gen, scale=1.0)
    # trained norm weights sit around 1 (around 0 for Gemma's 1+w form), not at init
    w = normal((h,), dtype, device, gen, scale=0.1, mean=0.0 if gemma else 1.0)
    return x, w


def _norm_inputs(n, dims, dtype, device, gen):
    x, w = _x_and_weight(n, dims, dtype, device, gen)
    return [x, w, float(dims.get("eps", 1e-6))]


def _gemma_inputs(n, dims, dtype, device, gen):
    x, w = _x_and_weight(n, dims, dtype, device, gen, gemma=True)
    return [x, w, float(dims.get("eps", 1e-6))]


def _add_inputs(n, dims, dtype, device, gen, gemma=False):
    x, w = _x_and_weight(n, dims, dtype, device, gen, gemma=gemma)
    r = normal(x.shape, dtype, device, gen, scale=2.0)
    return [x, r, w, float(dims.get("eps", 1e-6))]


def _gated_inputs(n, dims, dtype, device, gen):
    x, w = _x_and_weight(n, dims, dtype, device, gen)
    z = normal(x.shape, dtype, device, gen)
    return [x, z, w, float(dims.get("eps", 1e-6)), int(dims.get("group_size", 0)),
            bool(dims.get("norm_before_gate", True))]


def _bytes(tensors_per_row):
    def f(n, dims, dtype):
        e = torch.empty((), dtype=dtype).element_size()
        h = int(dims["hidden"])
        return (tensors_per_row * _rows(n, dims) * h + h) * e
    return f


_QWEN35_HIDDEN = {"hidden": 1024, "eps": 1e-6}

#: q/k norms get per-head views of the qkv buffer, other norms column slices or padded rows
_NORM_LAYOUTS = (padded_rows(0), column_slice(0), per_head(0, heads=2),
                 fp32_arg(1))
_ADD_NORM_LAYOUTS = (padded_rows(0, 1), column_slice(0), fp32_arg(2))
#: Qwen3.5's GDN norm: x and z are slices of one projection output
_GATED_NORM_LAYOUTS = (split_of_one_buffer(0, 1), padded_rows(0, 1), fp32_arg(2))

RMS_NORM = OpSpec(
    name="rms_norm", reference=rms_norm_ref, make_inputs=_norm_inputs,
    outputs=lambda args, ret: [ret], bytes_moved=_bytes(2),
    default_dims=dict(_QWEN35_HIDDEN), layouts=_NORM_LAYOUTS,
    doc="RMSNorm: x * rsqrt(mean(x^2)+eps) * w")

FUSED_ADD_RMS_NORM = OpSpec(
    name="fused_add_rms_norm", reference=fused_add_rms_norm_ref, make_inputs=_add_inputs,
    outputs=lambda args, ret: [args[0], args[1]], bytes_moved=_bytes(4), mutates=(0, 1),
    functional=fused_add_rms_norm_functional,
    default_dims=dict(_QWEN35_HIDDEN), layouts=_ADD_NORM_LAYOUTS,
    doc="in place: residual += x; x = rms_norm(residual)")

GEMMA_RMS_NORM = OpSpec(
    name="gemma_rms_norm", reference=gemma_rms_norm_ref, make_inputs=_gemma_inputs,
    outputs=lambda args, ret: [ret], bytes_moved=_bytes(2),
    default_dims=dict(_QWEN35_HIDDEN), layouts=_NORM_LAYOUTS,
    doc="Gemma/Qwen3.5 RMSNorm: scale by (1 + w)")

GEMMA_FUSED_ADD_RMS_NORM = OpSpec(
    name="gemma_fused_add_rms_norm", reference=gemma_fused_add_rms_norm_ref,
    make_inputs=lambda n, d, t, dev, g: _add_inputs(n, d, t, dev, g, gemma=True),
    outputs=lambda args, ret: list(ret), bytes_moved=_bytes(4),
    default_dims=dict(_QWEN35_HIDDEN), layouts=_ADD_NORM_LAYOUTS,
    doc="Gemma RMSNorm with residual add, out of place")

RMS_NORM_GATED = OpSpec(
    name="rms_norm_gated", reference=rms_norm_gated_ref, make_inputs=_gated_inputs,
    outputs=lambda args, ret: [ret], bytes_moved=_bytes(3),
    default_dims={"hidden": 128, "rows_per_token": 16, "eps": 1e-6, "group_size": 0,
                  "norm_before_gate": True},
    layouts=_GATED_NORM_LAYOUTS,
    doc="gated-delta-net output norm: rmsnorm(x) * w * silu(z)")

SPECS = [RMS_NORM, FUSED_ADD_RMS_NORM, GEMMA_RMS_NORM, GEMMA_FUSED_ADD_RMS_NORM,
         RMS_NORM_GATED]
