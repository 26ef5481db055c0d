"""``flashinfer``: FlashInfer's kernels (VENDOR kind, vendor ``flashinfer``; ships with vLLM 0.24
on the GPU machine), adapted to fltune's op contracts. Checked against FlashInfer 0.6.12.

| fltune op | FlashInfer 0.6.12 call |
| --- | --- |
| ``rms_norm`` | ``flashinfer.norm.rmsnorm(input, weight, eps)`` |
| ``fused_add_rms_norm`` | ``flashinfer.norm.fused_add_rmsnorm(input, residual, weight, eps)`` (in place) |
| ``gemma_rms_norm`` | ``flashinfer.norm.gemma_rmsnorm(input, weight, eps)`` |
| ``gemma_fused_add_rms_norm`` | ``flashinfer.norm.gemma_fused_add_rmsnorm`` (in place) on packed copies |
| ``silu_and_mul`` / ``gelu_and_mul`` / ``gelu_tanh_and_mul`` | ``flashinfer.activation.*_and_mul(input)`` |
| ``rotary_embedding`` | ``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox)`` with the cache in float32 |
| ``gdn_chunk_prefill`` | ``flashinfer.gdn_prefill.chunk_gated_delta_rule``, called as vLLM's ``fi_chunk_gated_delta_rule`` calls it |
| ``gdn_decode`` | ``flashinfer.gdn_decode.gated_delta_rule_decode_pretranspose`` on the state pool |

What each declares (``OpImpl.supports``), from the 0.6.12 source:
- norms: the row's channels adjacent (``CHECK_LAST_DIM_CONTIGUOUS``; a row stride is taken),
  the weight in the input's dtype (kernels templated on one type), bf16/fp16. ``rmsnorm``
  takes 2-D or 3-D (per-head) input; the Gemma and fused-add kernels 2-D only. The in-place
  fused-add kernel is declared packed-only, like vLLM's and FlagGems' (their in-place
  kernels were wrong on padded rows on the H200) until ``benchmarks/layout_check.py`` has
  run it on the H200.
- gated activations: ``act_and_mul_kernel`` indexes rows as ``token * 2d`` (strides
  ignored) with 16-byte vector loads of both halves: packed rows, each half a multiple of
  16 bytes, a 16-byte-aligned start (the Python wrapper only checks the full width and
  raises ``ValueError`` otherwise).
- rope: the cache must be float32 (``ValueError`` otherwise): the adapter converts the
  model-dtype cache once per cache tensor (memoised by identity and version, so an
  unchanged cache is not converted per call); q/k may be column slices (it views them
  ``[N, heads, head_size]`` and takes strides), unit last stride.
- GDN prefill: SM90 (the JIT-compiled C++ kernel; compiled on first use, minutes) or SM10.x
  with head size 128 on CUDA >= 13; ``head_k_dim == head_v_dim``; float32 g/beta/state
  (the adapter converts, as vLLM does). GDN decode: SM90+, a bf16 state with K = V = 128
  (the bf16 pool kernel, a CuTe DSL kernel: only where ``nvidia-cutlass-dsl`` imports) or a
  float32 state (legacy kernel, K, V >= 128).

FlashInfer needs CUDA: on CPU every candidate is unqualified with that reason, and where the
package is missing, with the import error.
"""
from __future__ import annotations

import functools
import importlib

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ._util import (contiguous, import_reason, requires, same_dtype, two_dims,
                    unit_last_stride)

VENDOR = "flashinfer"
IMPL_ID = "vendor.flashinfer"
PRIORITY = 95         # VENDOR kind, just below vLLM's own kernels in the fixed order
HALF = (torch.bfloat16, torch.float16)


def _fi(sub: str):
    """``flashinfer.<sub>``, imported on first use (importing flashinfer is slow and needs
    CUDA; the CPU machine never gets here)."""
    return importlib.import_module(f"flashinfer.{sub}")


# ---- norms ----------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    return _fi("norm").rmsnorm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    _fi("norm").fused_add_rmsnorm(x, residual, weight, eps)
    return x, residual


def gemma_rms_norm(x, weight, eps):
    return _fi("norm").gemma_rmsnorm(x, weight, eps)


def gemma_fused_add_rms_norm(x, residual, weight, eps):
    # the contract is out of place; FlashInfer's kernel is in place: packed copies
    out = x.clone(memory_format=torch.contiguous_format)
    res = residual.clone(memory_format=torch.contiguous_format)
    _fi("norm").gemma_fused_add_rmsnorm(out, res, weight, eps)
    return out, res


# ---- gated activations ----------------------------------------------------------------

def silu_and_mul(x):
    return _fi("activation").silu_and_mul(x)


def gelu_and_mul(x):
    return _fi("activation").gelu_and_mul(x)


def gelu_tanh_and_mul(x):
    return _fi("activation").gelu_tanh_and_mul(x)


# ---- rope -----------------------------------------------------------------------------

_fp32_cache: dict = {}


def fp32_cache(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """The cache in float32, converted once per (tensor, version): FlashInfer raises on any
    other dtype, and vLLM's caches are in the model dtype. Keyed by the tensor's identity
    and its version counter, so an in-place update of the cache is seen."""
    if cos_sin_cache.dtype == torch.float32:
        return cos_sin_cache
    key = (id(cos_sin_cache), cos_sin_cache._version, cos_sin_cache.data_ptr())
    hit = _fp32_cache.get(key)
    if hit is None or hit[0] is not cos_sin_cache:
        _fp32_cache.clear()                  # one model, one cache: keep only the latest
        hit = (cos_sin_cache, cos_sin_cache.float())
        _fp32_cache[key] = hit
    return hit[1]


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
    _fi("rope").apply_rope_with_cos_sin_cache_inplace(
        positions=positions, query=query, key=key, head_size=head_size,
        cos_sin_cache=fp32_cache(cos_sin_cache), is_neox=is_neox)
    return query, key


# ---- gated delta net ------------------------------------------------------------------

def gdn_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens):
    """vLLM 0.24's ``fi_chunk_gated_delta_rule`` with ``use_qk_l2norm_in_kernel=False``
    (q/k arrive normalised): float32 state, ``g`` passed as ``exp(g)`` (FlashInfer takes
    the decay itself, not its log), float32 beta."""
    o, final = _fi("gdn_prefill").chunk_gated_delta_rule(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
        g=torch.exp(g.to(torch.float32)), beta=beta.to(torch.float32),
        initial_state=initial_state.to(torch.float32), output_final_state=True,
        cu_seqlens=cu_seqlens)
    return o, final.to(initial_state.dtype)


def gdn_decode(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out):
    B = mixed_qkv.shape[0]
    _, HV, V, K = ssm_state.shape
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    q = mixed_qkv[:, :H * K].reshape(B, 1, H, K).contiguous()
    k = mixed_qkv[:, H * K:2 * H * K].reshape(B, 1, H, K).contiguous()
    v = mixed_qkv[:, 2 * H * K:].reshape(B, 1, HV, V).contiguous()
    _fi("gdn_decode").gated_delta_rule_decode_pretranspose(
        q=q, k=k, v=v, state=None, A_log=A_log, a=a.reshape(B, 1, HV),
        dt_bias=dt_bias, b=b.reshape(B, 1, HV), scale=K ** -0.5, output=out,
        use_qk_l2norm=True, initial_state=ssm_state, initial_state_indices=state_indices)
    return out


# ---- what each takes ------------------------------------------------------------------

def half_width_bytes(i, k=16):
    """Each half of the ``[..., 2d]`` input a multiple of ``k`` bytes: the kernel loads both
    halves with ``k``-byte vectors."""
    def check(args):
        t = args[i]
        d = t.shape[-1] // 2
        if (d * t.element_size()) % k:
            return (f"half width {d} x {t.element_size()} bytes is not a multiple of {k} "
                    f"bytes (FlashInfer's vector loads)")
        return None
    return check


def aligned(i, k=16):
    """The data pointer ``k``-byte aligned (a view at an odd storage offset is not)."""
    def check(args):
        t = args[i]
        if t.data_ptr() % k:
            return f"argument {i} does not start on a {k}-byte boundary"
        return None
    return check


def dims_in(i, allowed):
    def check(args):
        if args[i].dim() not in allowed:
            return f"argument {i} is {args[i].dim()}-D; this kernel takes {sorted(allowed)}-D"
        return None
    return check


def _gdn_prefill_supports(*args):
    q, v = args[0], args[2]
    if q.shape[-1] != v.shape[-1]:
        return (f"head_k_dim {q.shape[-1]} != head_v_dim {v.shape[-1]}: FlashInfer's GDN "
                f"prefill takes one head size")
    return None


def bf16_state_decode_missing() -> str | None:
    """Why FlashInfer's bf16-state decode kernel cannot run here, or None. In 0.6.12 it is a
    CuTe DSL kernel (``flashinfer.gdn_kernels.gdn_decode_bf16_state`` imports ``cutlass``,
    the ``nvidia-cutlass-dsl`` package); where that import fails, ``gdn_decode`` silently
    takes its float32 legacy path, which asserts on a bf16 state. On the H200 (session 12)
    the image had no CuTe DSL, so every band was refused by that assertion: this check
    makes it an unqualified candidate with the reason instead."""
    try:
        mod = _fi("gdn_decode")
    except Exception as e:                                 # noqa: BLE001
        return f"flashinfer.gdn_decode does not import: {type(e).__name__}: {e}"
    if not getattr(mod, "_GDN_DECODE_BF16_STATE_AVAILABLE", True):
        return ("FlashInfer's bf16-state GDN decode kernel needs CuTe DSL "
                "(nvidia-cutlass-dsl), which is not installed; its float32 legacy path "
                "does not take vLLM's bf16 state")
    return None


def _gdn_decode_supports(*args):
    state = args[5]
    _, _, V, K = state.shape
    if state.dtype == torch.bfloat16:
        if K != 128 or V != 128:
            return f"bf16 state with K={K}, V={V}: FlashInfer's bf16 pool kernel needs 128"
        return bf16_state_decode_missing()
    if state.dtype == torch.float32:
        if K < 128 or V < 128 or V % 8:
            return f"float32 state with K={K}, V={V}: the legacy kernel needs K, V >= 128"
        return None
    return f"state dtype {state.dtype}: FlashInfer's decode takes a bf16 or float32 state"


_NORM = requires(unit_last_stride(0), dims_in(0, {2, 3}), same_dtype(1, 0))
_NORM_2D = requires(unit_last_stride(0), two_dims(0), same_dtype(1, 0))
_ADD_NORM = requires(contiguous(0, 1), two_dims(0, 1), same_dtype(1, 0), same_dtype(2, 0))
_GEMMA_ADD_NORM = requires(two_dims(0, 1), same_dtype(1, 0), same_dtype(2, 0))
_GATED = requires(contiguous(0), half_width_bytes(0), aligned(0))
_ROPE = requires(unit_last_stride(1, 2), two_dims(1, 2))

#: op -> (adapter, FlashInfer module it needs, what it supports, minimum capability)
FNS = {
    "rms_norm": (rms_norm, "norm", _NORM, (8, 0)),
    "fused_add_rms_norm": (fused_add_rms_norm, "norm", _ADD_NORM, (8, 0)),
    "gemma_rms_norm": (gemma_rms_norm, "norm", _NORM_2D, (8, 0)),
    "gemma_fused_add_rms_norm": (gemma_fused_add_rms_norm, "norm", _GEMMA_ADD_NORM, (8, 0)),
    "silu_and_mul": (silu_and_mul, "activation", _GATED, (8, 0)),
    "gelu_and_mul": (gelu_and_mul, "activation", _GATED, (8, 0)),
    "gelu_tanh_and_mul": (gelu_tanh_and_mul, "activation", _GATED, (8, 0)),
    "rotary_embedding": (rotary_embedding, "rope", _ROPE, (8, 0)),
    "gdn_chunk_prefill": (gdn_chunk_prefill, "gdn_prefill", _gdn_prefill_supports, (9, 0)),
    "gdn_decode": (gdn_decode, "gdn_decode", _gdn_decode_supports, (9, 0)),
}

#: FlashInfer's own function each op calls, for the tests' signature check
FLASHINFER_CALLS = {
    "rms_norm": ("norm", "rmsnorm"), "fused_add_rms_norm": ("norm", "fused_add_rmsnorm"),
    "gemma_rms_norm": ("norm", "gemma_rmsnorm"),
    "gemma_fused_add_rms_norm": ("norm", "gemma_fused_add_rmsnorm"),
    "silu_and_mul": ("activation", "silu_and_mul"),
    "gelu_and_mul": ("activation", "gelu_and_mul"),
    "gelu_tanh_and_mul": ("activation", "gelu_tanh_and_mul"),
    "rotary_embedding": ("rope", "apply_rope_with_cos_sin_cache_inplace"),
    "gdn_chunk_prefill": ("gdn_prefill", "chunk_gated_delta_rule"),
    "gdn_decode": ("gdn_decode", "gated_delta_rule_decode_pretranspose"),
}


def _gdn_prefill_capability(cap):
    """SM90, or SM10.x (FlashInfer's CuTe DSL Blackwell kernel, CUDA >= 13)."""
    if cap[0] == 9:
        return None
    if cap[0] == 10:
        cuda = int((torch.version.cuda or "0").split(".")[0])
        return None if cuda >= 13 else "FlashInfer's Blackwell GDN prefill needs CUDA >= 13"
    return f"FlashInfer's GDN prefill runs on SM90 or SM10.x, not SM{cap[0]}{cap[1]}"


def _qualifier(op, module, min_cap):
    @functools.lru_cache(maxsize=None)
    def importable():
        return import_reason(f"flashinfer.{module}")

    def qualify(ctx):
        if ctx.device_type != "cuda":
            return f"FlashInfer needs CUDA; this device is {ctx.device_type}"
        cap = tuple(ctx.capability or (0, 0))
        if cap < min_cap:
            return (f"FlashInfer's {op} kernel needs compute capability >= "
                    f"{min_cap[0]}.{min_cap[1]}, this device has {cap[0]}.{cap[1]}")
        if op == "gdn_chunk_prefill":
            why = _gdn_prefill_capability(cap)
            if why:
                return why
        r = importable()
        if r:
            return f"flashinfer not installed or broken: {r}"
        if ctx.dtype not in HALF:
            return f"FlashInfer's {op} kernel runs bf16/fp16 only, not {ctx.dtype}"
        return None
    return qualify


#: FlashInfer JIT-compiles each module on first use where no prebuilt one is installed
#: (the H200 image has none): ~30 s for norm or rope, and the SM90 GDN prefill (64 CUTLASS
#: instantiations) over 5 minutes on 16 cores (``h200-2026-12-01-s10``); that first call
#: is given this long (``OpImpl.first_call_s``), untimed, instead of the hang timeout
FIRST_CALL_S = {"gdn_chunk_prefill": 1800.0}
FIRST_CALL_DEFAULT_S = 600.0


def implementations():
    return [OpImpl(op_name=op, impl_id=IMPL_ID, kind=BackendImplKind.VENDOR, fn=fn,
                   vendor=VENDOR, priority=PRIORITY, backend="flashinfer",
                   qualify=_qualifier(op, module, cap), precision_rank=1, supports=supports,
                   first_call_s=FIRST_CALL_S.get(op, FIRST_CALL_DEFAULT_S))
            for op, (fn, module, supports, cap) in FNS.items()]
