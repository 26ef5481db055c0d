"""Gated delta net (GDN): Qwen3.5 / Qwen3-Next linear attention, with vLLM 0.24's semantics.

Per value head the state ``h`` is a ``[V, K]`` matrix (vLLM's layout: ``[..., HV, V, K]``,
K contiguous). One token with ``q, k`` (l2-normalised), ``v``, decay ``g`` (log space, < 0)
and write strength ``beta`` in (0, 1) does::

    h = exp(g) * h
    v' = beta * (v - h @ k)
    h = h + outer(v', k)
    o = h @ (q * scale)                 scale = K ** -0.5

Grouped heads: value head ``i`` reads key/query head ``i // (HV // H)``.

Two ops, the two places vLLM runs this recurrence:

``gdn_chunk_prefill(q, k, v, g, beta, initial_state, cu_seqlens) -> (o, final_state)``
    What ``ChunkGatedDeltaRule`` (``layers/mamba/gdn/qwen_gdn_linear_attn.py``) is called
    with in ``_forward_core`` for the prefill part of a batch:
    ``chunk_gated_delta_rule(q, k, v, g, beta, initial_state=ssm_state[idx],
    output_final_state=True, cu_seqlens=prefill_query_start_loc,
    use_qk_l2norm_in_kernel=False)``, scale left to the kernel's default ``K ** -0.5``.
    q/k/v come from ``fused_post_conv_prep(apply_l2norm=True, output_g_exp=False)``: q and k
    **already l2-normalised** (eps 1e-6) in the model dtype, ``[T, H, K]``; v ``[T, HV, V]``;
    g (log space) and beta (sigmoid already applied) **float32** ``[T, HV]``; the initial
    state ``[N, HV, V, K]`` in the SSM cache dtype (the model dtype under vLLM's default
    ``mamba_ssm_cache_dtype="auto"``); ``cu_seqlens`` int32 ``[N + 1]``. vLLM then
    ``unsqueeze(0)``s every tensor to ``[1, T, ...]`` for the kernel; the contract keeps them
    ``[T, ...]`` (the same memory: a view both ways) so that the token count is the leading
    dimension, which is what band lookup and frozen dispatch key on (``OpSpec.key_arg``).
    Outputs: ``o [T, HV, V]`` in q's dtype and ``final_state [N, HV, V, K]`` in the initial
    state's dtype — the kernels return it in float32 and vLLM casts it right after the call
    (``ssm_state[idx] = last_recurrent_state.to(ssm_state.dtype)``); the adapters do that cast.
    Pure: nothing is written in place.

``gdn_decode(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out) -> out``
    vLLM 0.24's decode path for a decode-only batch without speculative tokens (the
    default, ``VLLM_ENABLE_FLA_PACKED_RECURRENT_DECODE=1``):
    ``fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias,
    scale=K**-0.5, initial_state=ssm_state, out=out, ssm_state_indices=idx,
    use_qk_l2norm_in_kernel=True)``. One token per sequence: ``mixed_qkv [B, 2*H*K + HV*V]``
    is the causal conv's output (q | k | v, **not** normalised), ``a, b [B, HV]`` the raw
    gate projections, ``A_log [HV]`` float32, ``dt_bias [HV]`` (model dtype); the kernel
    computes ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus linear above 20) and
    ``beta = sigmoid(b)``, l2-normalises q and k, reads the state of slot ``idx[i]`` of the
    pool ``ssm_state [slots, HV, V, K]`` and writes it back there. **In place**: ``out
    [B, 1, HV, V]`` and ``ssm_state`` are written (exactly vLLM's ``out=`` and in-place
    state); every other pool slot is left alone. (Mixed prefill + decode batches use
    ``fused_sigmoid_gating_delta_rule_update`` instead: the same math, per-token q/k/v
    tensors; it is a candidate of this op through an adapter.)

How vLLM 0.24 picks the prefill kernel (``_resolve_gdn_prefill_backend``), for the serving
side that will apply a measured winner: ``additional_config["gdn_prefill_backend"]``
(``--gdn-prefill-backend``; ``auto`` by default) — on CUDA, FlashInfer when the request is
``flashinfer`` or ``auto`` and the device is SM90, or SM10.x with ``linear_key_head_dim ==
128``, CUDA runtime >= 13 and an intact ``nvidia-cutlass-dsl-libs-cu13``; the in-tree CuteDSL
kernel only when ``cutedsl`` is requested on SM10.x with head_k_dim 128; Triton/FLA
otherwise (and always off CUDA). So on the H200 vLLM's default is FlashInfer.
:func:`gdn_prefill_backend_for` maps a winning candidate of ``gdn_chunk_prefill`` to that
setting. The decode kernel has no such setting in vLLM 0.24.

The references compute in float32 (float64 when given float64, which is how parity runs
them) and round once at the end. ``gdn_chunk_prefill``'s reference is the token-by-token
recurrence; ``chunk_reference`` is a second, independent formulation (the chunked WY form
the kernels use, in PyTorch), offered as the ``reference.torch_chunk`` candidate.

**Parity tolerance.** The ops use the standard rule (the dtype's relative tolerance, an
absolute floor scaled by the output's mean magnitude, 99 % of elements). It holds over a long
recurrence because the update is contractive: with ``|k| = 1``, ``0 < beta < 1`` and
``g < 0`` the state map ``h -> exp(g) h (I - beta k k^T)`` has norm <= 1, so a rounding error
made at one token decays instead of growing; a candidate's error stays at its per-token
rounding level (bf16 intermediates: ~1e-3 relative) however long the sequence, which
``tests/test_gdn.py`` measures on sequences of up to 300 tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import OpSpec, normal

#: FLA's and vLLM's chunk length; the chunked reference uses the same
CHUNK = 64
#: l2norm's epsilon in vLLM's kernels (``fused_post_conv_prep``, the recurrent kernels)
L2_EPS = 1e-6
#: softplus switches to the identity above this, as in vLLM's gating kernels
SOFTPLUS_THRESHOLD = 20.0


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """vLLM's ``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gating(a, b, A_log, dt_bias):
    """``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``: vLLM's
    ``fused_gdn_gating`` / the gating inside the decode kernels, in ``a``'s accumulation
    dtype."""
    acc = _acc(a)
    x = a.to(acc) + dt_bias.to(acc)
    sp = torch.where(x <= SOFTPLUS_THRESHOLD, F.softplus(x, threshold=1e9), x)
    return -torch.exp(A_log.to(acc)) * sp, torch.sigmoid(b.to(acc))


def _heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[T, H, D] -> [T, HV, D]: value head i reads head i // (HV // H)."""
    h = x.shape[-2]
    return x if h == hv else x.repeat_interleave(hv // h, dim=-2)


def _recurrence(q, k, v, g, beta, h, scale):
    """One sequence, token by token. q, k [T, HV, K], v [T, HV, V], g/beta [T, HV],
    h [HV, V, K], all in the accumulation dtype. Returns (o [T, HV, V], h)."""
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        h = h * torch.exp(g[t])[:, None, None]
        kt = k[t].unsqueeze(-1)                                  # [HV, K, 1]
        vt = (v[t] - torch.bmm(h, kt).squeeze(-1)) * beta[t][:, None]
        h = h + vt.unsqueeze(-1) * k[t].unsqueeze(-2)
        out[t] = torch.bmm(h, (q[t] * scale).unsqueeze(-1)).squeeze(-1)
    return out, h


def _bounds(cu_seqlens: torch.Tensor) -> list[int]:
    return [int(x) for x in cu_seqlens.tolist()]


def chunk_prefill_ref(q, k, v, g, beta, initial_state, cu_seqlens):
    """The token-by-token recurrence per sequence of ``cu_seqlens``."""
    acc = _acc(q)
    hv, kd = v.shape[1], q.shape[-1]
    qa, ka = _heads(q.to(acc), hv), _heads(k.to(acc), hv)
    va, ga, ba = v.to(acc), g.to(acc), beta.to(acc)
    o = torch.empty(v.shape, dtype=acc, device=v.device)
    final = torch.empty(initial_state.shape, dtype=acc, device=v.device)
    cu = _bounds(cu_seqlens)
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        o[s:e], final[n] = _recurrence(qa[s:e], ka[s:e], va[s:e], ga[s:e], ba[s:e],
                                       initial_state[n].to(acc), kd ** -0.5)
    return o.to(q.dtype), final.to(initial_state.dtype)


def _chunk_one(q, k, v, g, beta, h, scale, C):
    """One sequence in the chunked (WY) form. Shapes as in ``_recurrence``; the sequence is
    zero-padded to whole chunks (a padded token has g = 0, beta = 0, k = 0: it leaves the
    state exactly as it was)."""
    T, HV, K = k.shape
    V = v.shape[-1]
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (T + pad) // C
    # [nc, HV, C, D]
    q, k, v = (x.reshape(nc, C, HV, -1).transpose(1, 2) for x in (q, k, v))
    g, beta = (x.reshape(nc, C, HV).transpose(1, 2) for x in (g, beta))
    G = g.cumsum(-1)                                             # decay from chunk start
    decay = (G.unsqueeze(-1) - G.unsqueeze(-2))                  # G_i - G_j
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(causal, decay, torch.full_like(decay, float("-inf"))).exp()
    kb = k * beta.unsqueeze(-1)
    # A_ij = beta_i (k_i . k_j) exp(G_i - G_j), i > j; T = (I + A)^-1
    A = (kb @ k.transpose(-1, -2) * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False,
                                       unitriangular=True)
    w = Tm @ (kb * G.exp().unsqueeze(-1))                        # [nc, HV, C, K]
    u = Tm @ (v * beta.unsqueeze(-1))                            # [nc, HV, C, V]
    attn = (q @ k.transpose(-1, -2)) * decay                     # i >= j, decayed
    qs = q * scale
    out = torch.empty(nc, HV, C, V, dtype=q.dtype, device=q.device)
    for c in range(nc):
        hT = h.transpose(-1, -2)                                 # [HV, K, V]
        vn = u[c] - w[c] @ hT                                    # the chunk's new values
        out[c] = (qs[c] * G[c].exp().unsqueeze(-1)) @ hT + (attn[c] * scale) @ vn
        tail = (G[c, :, -1:] - G[c]).exp().unsqueeze(-1)         # decay to chunk end
        h = h * G[c, :, -1].exp()[:, None, None] + (vn.transpose(-1, -2) @ (k[c] * tail))
    return out.transpose(1, 2).reshape(nc * C, HV, V)[:T], h


def chunk_reference(q, k, v, g, beta, initial_state, cu_seqlens):
    """``gdn_chunk_prefill`` in the chunked WY form (the kernels' algorithm) in PyTorch:
    an independent second formulation, and much faster than the token loop on CPU."""
    acc = _acc(q)
    hv, kd = v.shape[1], q.shape[-1]
    qa, ka = _heads(q.to(acc), hv), _heads(k.to(acc), hv)
    va, ga, ba = v.to(acc), g.to(acc), beta.to(acc)
    o = torch.empty(v.shape, dtype=acc, device=v.device)
    final = torch.empty(initial_state.shape, dtype=acc, device=v.device)
    cu = _bounds(cu_seqlens)
    for n in range(len(cu) - 1):
        s, e = cu[n], cu[n + 1]
        if e == s:
            final[n] = initial_state[n].to(acc)
            continue
        o[s:e], final[n] = _chunk_one(qa[s:e], ka[s:e], va[s:e], ga[s:e], ba[s:e],
                                      initial_state[n].to(acc), kd ** -0.5, CHUNK)
    return o.to(q.dtype), final.to(initial_state.dtype)


def decode_ref(mixed_qkv, a, b, A_log, dt_bias, ssm_state, state_indices, out):
    """One token per sequence from its slot of the state pool, written back in place."""
    acc = _acc(mixed_qkv)
    B = mixed_qkv.shape[0]
    _, HV, V, K = ssm_state.shape
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    x = mixed_qkv.to(acc)
    q = l2norm(x[:, :H * K].reshape(B, H, K))
    k = l2norm(x[:, H * K:2 * H * K].reshape(B, H, K))
    v = x[:, 2 * H * K:].reshape(B, HV, V)
    q, k = _heads(q, HV), _heads(k, HV)
    g, beta = gating(a, b, A_log, dt_bias)                        # [B, HV]
    idx = state_indices.long()
    h = ssm_state[idx].to(acc) * torch.exp(g)[..., None, None]  # [B, HV, V, K]
    vt = (v - (h @ k.unsqueeze(-1)).squeeze(-1)) * beta[..., None]
    h = h + vt.unsqueeze(-1) * k.unsqueeze(-2)
    o = (h @ (q * K ** -0.5).unsqueeze(-1)).squeeze(-1)          # [B, HV, V]
    ssm_state[idx] = h.to(ssm_state.dtype)
    out.copy_(o.unsqueeze(1).to(out.dtype))
    return out


# ---- inputs ---------------------------------------------------------------------------

def _dims(dims):
    return (int(dims["num_k_heads"]), int(dims["num_v_heads"]), int(dims["head_k_dim"]),
            int(dims["head_v_dim"]))


def seq_lengths(n: int, seqs: int) -> list[int]:
    """``n`` tokens as ``min(seqs, n)`` sequences of unequal length (the first ones one
    token longer when ``n`` does not divide), so that sequence boundaries fall inside
    chunks."""
    s = max(1, min(int(seqs), n))
    base, extra = divmod(n, s)
    return [base + (1 if i < extra else 0) for i in range(s)]


def _state(shape, dtype, device, gen):
    """A carried state of realistic size (entries ~0.1: a state built from unit keys and
    O(1) values, decayed), so that getting the initial state wrong shows."""
    return normal(shape, dtype, device, gen, scale=0.1)


def prefill_inputs(n, dims, dtype, device, gen):
    H, HV, K, V = _dims(dims)
    lens = seq_lengths(n, dims.get("seqs", 1))
    q = l2norm(torch.randn((n, H, K), generator=gen)).to(device=device, dtype=dtype)
    k = l2norm(torch.randn((n, H, K), generator=gen)).to(device=device, dtype=dtype)
    v = normal((n, HV, V), dtype, device, gen)
    # decay ~ exp(-0.02) per token, spread: memory spans several chunks, so the chunked
    # forms' inter-chunk state passing is exercised
    g = F.logsigmoid(torch.randn((n, HV), generator=gen) + 4.0).to(device)
    beta = torch.sigmoid(torch.randn((n, HV), generator=gen)).to(device)
    h0 = _state((len(lens), HV, V, K), dtype, device, gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    return [q, k, v, g, beta, h0, cu]


def decode_inputs(n, dims, dtype, device, gen):
    H, HV, K, V = _dims(dims)
    mixed = normal((n, 2 * H * K + HV * V), dtype, device, gen)
    a = normal((n, HV), dtype, device, gen)
    b = normal((n, HV), dtype, device, gen)
    # trained A = exp(A_log) spreads over ~(0, 16) at init; decays of a few percent to most
    # of the state per token
    A_log = torch.log(torch.rand((HV,), generator=gen) * 0.5 + 0.02).to(device)
    dt_bias = normal((HV,), dtype, device, gen, scale=0.5)
    # slot 0 is vLLM's null block; the sequences' slots are shuffled, so a kernel that
    # ignores the indices fails
    slots = torch.randperm(n, generator=gen) + 1
    pool = _state((n + 1, HV, V, K), dtype, device, gen)
    out = torch.zeros((n, 1, HV, V), dtype=dtype, device=device)
    return [mixed, a, b, A_log, dt_bias, pool, slots.to(device=device, dtype=torch.int32), out]


def _prefill_bytes(n, dims, dtype):
    H, HV, K, V = _dims(dims)
    e = torch.empty((), dtype=dtype).element_size()
    seqs = len(seq_lengths(n, dims.get("seqs", 1)))
    # read q, k, v, g, beta (fp32), the initial state; write o and the final state
    return (n * (2 * H * K + 2 * HV * V) * e + n * HV * 8
            + 2 * seqs * HV * V * K * e)


def _decode_bytes(n, dims, dtype):
    H, HV, K, V = _dims(dims)
    e = torch.empty((), dtype=dtype).element_size()
    # read q|k|v, a, b; read and write each sequence's state; write out
    return (n * (2 * H * K + 2 * HV * V + 2 * HV) * e + 2 * n * HV * V * K * e)


#: Qwen3.5-0.8B's linear-attention shape at tp=1
QWEN35_GDN = {"num_k_heads": 16, "num_v_heads": 16, "head_k_dim": 128, "head_v_dim": 128}

GDN_CHUNK_PREFILL = OpSpec(
    name="gdn_chunk_prefill", reference=chunk_prefill_ref, make_inputs=prefill_inputs,
    outputs=lambda args, ret: list(ret), bytes_moved=_prefill_bytes,
    default_dims={**QWEN35_GDN, "seqs": 1}, key_arg=0,
    doc="gated delta net chunked prefill: chunk_gated_delta_rule, q/k pre-normalised")

GDN_DECODE = OpSpec(
    name="gdn_decode", reference=decode_ref, make_inputs=decode_inputs,
    outputs=lambda args, ret: [args[5], args[7]], bytes_moved=_decode_bytes,
    mutates=(5, 7), default_dims=dict(QWEN35_GDN), key_arg=0,
    doc="gated delta net decode: packed recurrent step, state pool and out in place")

SPECS = [GDN_CHUNK_PREFILL, GDN_DECODE]

#: candidate id -> vLLM 0.24's ``gdn_prefill_backend`` value that makes vLLM run it
_PREFILL_BACKEND = {"vendor.fla_vllm": "triton", "vendor.flashinfer": "flashinfer",
                    "vendor.cutedsl_vllm": "cutedsl"}


def gdn_prefill_backend_for(impl_id: str) -> str | None:
    """The ``additional_config["gdn_prefill_backend"]`` value under which vLLM 0.24 runs
    the ``gdn_chunk_prefill`` candidate ``impl_id`` itself (``triton``, ``flashinfer``,
    ``cutedsl``), or None when no setting of vLLM runs it (PyTorch references, FlagGems'
    kernels): such a winner needs a seam of fltune's own to be served.

    Caveat for the serving side: vLLM honours ``flashinfer`` only where
    ``_resolve_gdn_prefill_backend`` allows it (SM90; SM10.x with head_k_dim 128), and
    ``cutedsl`` only on SM10.x; elsewhere it falls back to Triton/FLA with a warning."""
    return _PREFILL_BACKEND.get(impl_id)
