"""FlashInfer as a backend (``fltune/backends/flashinfer.py``): every candidate exists for the
right op, its support rules run on every serving layout, it is unqualified on CPU with a
reason; the adapters' keyword arguments are checked against FlashInfer 0.6.12's own source
(parsed from the staged wheel, no import), and their argument conversions are run against a
**fake** ``flashinfer`` package (``FAKE_FLASHINFER``: FlashInfer needs CUDA, so the real one
cannot run on this machine) whose functions compute the op with fltune's references."""
from __future__ import annotations

import ast
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import build_builtin_registry
from fltune.backends import flashinfer as fib
from fltune.dispatch.types import QualifyContext
from fltune.ops import OPS, activation, clone_args, gdn, get_op, norm, rotary
from fltune.tune import parity

_REG = build_builtin_registry()
WHEEL = Path(__file__).resolve().parents[1] / ".vstage" / "flashinfer_python-0.6.12-py3-none-any.whl"
OPS_WITH_FI = ["rms_norm", "fused_add_rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm",
               "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul", "rotary_embedding",
               "gdn_chunk_prefill", "gdn_decode"]


def test_every_candidate_exists_for_its_op():
    assert sorted(fib.FNS) == sorted(OPS_WITH_FI) == sorted(fib.FLASHINFER_CALLS)
    for op in OPS_WITH_FI:
        assert op in OPS
        impl = _REG.get(op, "vendor.flashinfer")
        assert impl.vendor == "flashinfer" and impl.kind.value == "vendor"
        assert impl.fn is fib.FNS[op][0]
    assert "vendor.flashinfer" not in {i.impl_id for i in _REG.get_implementations("mrope")}


@pytest.mark.parametrize("op", OPS_WITH_FI)
def test_support_rules_run_on_every_layout(op):
    """The declaration answers (None or a reason) on the tidy inputs and on every serving
    layout of the op, in every dtype, without raising."""
    spec = get_op(op)
    impl = _REG.get(op, "vendor.flashinfer")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        tidy = spec.make_inputs(6, dict(spec.default_dims), dtype, "cpu",
                                torch.Generator().manual_seed(0))
        assert impl.unsupported(tidy) is None or isinstance(impl.unsupported(tidy), str)
        for layout in spec.layouts:
            if layout.applies(tidy):
                why = impl.unsupported(layout.build(tidy))
                assert why is None or isinstance(why, str)


def test_support_rules_decline_what_the_kernels_cannot_take():
    spec = get_op("silu_and_mul")
    x = spec.make_inputs(4, {"intermediate": 3584}, torch.bfloat16, "cpu",
                         torch.Generator().manual_seed(0))
    gated = _REG.get("silu_and_mul", "vendor.flashinfer")
    assert gated.unsupported(x) is None
    assert "16 bytes" in gated.unsupported([torch.zeros(4, 2 * 12, dtype=torch.bfloat16)])
    padded = torch.zeros(4, 8192, dtype=torch.bfloat16)[:, :7168]
    assert "strided" in gated.unsupported([padded])
    nrm = _REG.get("rms_norm", "vendor.flashinfer")
    xs = torch.zeros(4, 1024, dtype=torch.bfloat16)
    assert nrm.unsupported([xs, torch.zeros(1024, dtype=torch.float32), 1e-6]) is not None
    assert nrm.unsupported([xs.view(4, 4, 256), torch.zeros(256, dtype=torch.bfloat16),
                            1e-6]) is None                    # per-head 3-D views
    assert _REG.get("gemma_rms_norm", "vendor.flashinfer").unsupported(
        [xs.view(4, 4, 256), torch.zeros(256, dtype=torch.bfloat16), 1e-6]) is not None
    dec = _REG.get("gdn_decode", "vendor.flashinfer")
    args = get_op("gdn_decode").make_inputs(2, dict(gdn.QWEN35_GDN), torch.float16, "cpu",
                                            torch.Generator().manual_seed(0))
    assert "state dtype" in dec.unsupported(args)           # fp16 state: no kernel
    args[5] = args[5].to(torch.bfloat16)     # bf16 needs the CuTe DSL kernel (next test)
    why = dec.unsupported(args)
    assert why is None or "flashinfer.gdn_decode" in why or "CuTe DSL" in why


def test_gdn_decode_bf16_state_needs_cute_dsl(monkeypatch):
    """FlashInfer 0.6.12 runs a bf16 state only through its CuTe DSL kernel; without it the
    call falls to the float32 legacy path and asserts (every band refused on the H200, s12).
    The candidate declares that instead, from the installed module's own flag."""
    import types
    from fltune.backends import flashinfer as fib
    dec = _REG.get("gdn_decode", "vendor.flashinfer")
    args = get_op("gdn_decode").make_inputs(2, dict(gdn.QWEN35_GDN), torch.bfloat16, "cpu",
                                            torch.Generator().manual_seed(0))
    fake = types.SimpleNamespace(_GDN_DECODE_BF16_STATE_AVAILABLE=False)
    monkeypatch.setattr(fib, "_fi", lambda sub: fake)
    assert "CuTe DSL" in dec.unsupported(args)
    fake._GDN_DECODE_BF16_STATE_AVAILABLE = True
    assert dec.unsupported(args) is None
    args[5] = args[5].to(torch.float32)                     # the legacy path needs no DSL
    fake._GDN_DECODE_BF16_STATE_AVAILABLE = False
    assert dec.unsupported(args) is None


@pytest.mark.parametrize("op", OPS_WITH_FI)
def test_unqualified_on_cpu_with_reason(op):
    impl = _REG.get(op, "vendor.flashinfer")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        why = impl.qualify(QualifyContext("cpu", dtype))
        assert why and "CUDA" in why
    # on a GPU that is too old, or with flashinfer missing, the reason says which
    assert "compute capability" in impl.qualify(QualifyContext("cuda", torch.bfloat16, (7, 5)))
    why = impl.qualify(QualifyContext("cuda", torch.bfloat16, (9, 0)))
    try:
        import flashinfer  # noqa: F401
    except Exception:
        assert why and "flashinfer" in why


def test_gdn_prefill_capability_rule():
    impl = _REG.get("gdn_chunk_prefill", "vendor.flashinfer")
    assert "9.0" in impl.qualify(QualifyContext("cuda", torch.bfloat16, (8, 9)))
    why = impl.qualify(QualifyContext("cuda", torch.bfloat16, (12, 0)))   # consumer Blackwell
    assert why and "SM90 or SM10.x" in why


# ---- signatures against FlashInfer 0.6.12's source ----------------------------------------

def _wheel_functions():
    if not WHEEL.is_file():
        pytest.skip(f"FlashInfer 0.6.12 wheel not staged at {WHEEL}")
    files = {"norm": "flashinfer/norm/__init__.py", "activation": "flashinfer/activation.py",
             "rope": "flashinfer/rope.py", "gdn_prefill": "flashinfer/gdn_prefill.py",
             "gdn_decode": "flashinfer/gdn_decode.py"}
    out = {}
    with zipfile.ZipFile(WHEEL) as z:
        for mod, path in files.items():
            tree = ast.parse(z.read(path).decode())
            out[mod] = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    return out


class _Recorder(types.ModuleType):
    """FAKE_FLASHINFER submodule: records each call's (positional, keyword) arguments."""

    def __init__(self, name, impls):
        super().__init__(name)
        self.calls = []
        for fn_name, impl in impls.items():
            setattr(self, fn_name, self._wrap(fn_name, impl))

    def _wrap(self, fn_name, impl):
        def fn(*args, **kwargs):
            self.calls.append((fn_name, args, kwargs))
            return impl(*args, **kwargs)
        return fn


def _fake_impls():
    """The ops' references under FlashInfer's names and argument conventions."""
    def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        return norm.rms_norm_ref(input, weight, eps)

    def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        norm.fused_add_rms_norm_ref(input, residual, weight, eps)

    def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
        return norm.gemma_rms_norm_ref(input, weight, eps)

    def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
        o, s = norm.gemma_fused_add_rms_norm_ref(input, residual, weight, eps)
        residual.copy_(s)
        input.copy_(o)

    def act(ref):
        def f(input, out=None, enable_pdl=None):
            if input.shape[-1] * input.dtype.itemsize % 16:
                raise ValueError("The pointers must be multiple of 16 bytes.")
            return ref(input)
        return f

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
                                              is_neox=True):
        if cos_sin_cache.dtype != torch.float32:
            raise ValueError("cos_sin_cache should be float32")
        rotary.rotary_embedding_ref(positions, query, key, head_size, cos_sin_cache, is_neox)

    def chunk_gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False, output=None, output_state=None,
                               **_):
        assert g.dtype == beta.dtype == initial_state.dtype == torch.float32
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert (g > 0).all() and (g <= 1).all()            # FlashInfer takes exp(g)
        o, final = gdn.chunk_prefill_ref(q, k, v, torch.log(g), beta, initial_state,
                                         cu_seqlens)
        return (o, final.float()) if output_final_state else o

    def gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b, scale=None,
                                             output=None, use_qk_l2norm=True,
                                             initial_state=None, initial_state_indices=None,
                                             output_state_indices=None):
        B, T, H, K = q.shape
        HV = v.shape[2]
        assert T == 1 and a.shape == b.shape == (B, 1, HV) and state is None
        assert use_qk_l2norm and abs(scale - K ** -0.5) < 1e-12
        mixed = torch.cat([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], dim=-1)
        gdn.decode_ref(mixed, a.reshape(B, HV), b.reshape(B, HV), A_log, dt_bias,
                       initial_state, initial_state_indices, output)
        return output, initial_state

    return {
        "norm": dict(rmsnorm=rmsnorm, fused_add_rmsnorm=fused_add_rmsnorm,
                     gemma_rmsnorm=gemma_rmsnorm, gemma_fused_add_rmsnorm=gemma_fused_add_rmsnorm),
        "activation": dict(silu_and_mul=act(activation.silu_and_mul_ref),
                           gelu_and_mul=act(activation.gelu_and_mul_ref),
                           gelu_tanh_and_mul=act(activation.gelu_tanh_and_mul_ref)),
        "rope": dict(apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace),
        "gdn_prefill": dict(chunk_gated_delta_rule=chunk_gated_delta_rule),
        "gdn_decode": dict(gated_delta_rule_decode_pretranspose=gated_delta_rule_decode_pretranspose),
    }


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """FAKE_FLASHINFER: a stand-in package in ``sys.modules`` (only for the adapters'
    argument handling, which cannot run against the real CUDA-only package here)."""
    pkg = types.ModuleType("flashinfer")
    subs = {}
    for sub, impls in _fake_impls().items():
        m = _Recorder(f"flashinfer.{sub}", impls)
        subs[sub] = m
        setattr(pkg, sub, m)
        monkeypatch.setitem(sys.modules, f"flashinfer.{sub}", m)
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    fib._fp32_cache.clear()
    return subs


@pytest.mark.parametrize("op", OPS_WITH_FI)
def test_adapter_keywords_exist_in_flashinfer_0_6_12(op, fake_flashinfer):
    """Every keyword an adapter passes is a parameter of the real 0.6.12 function, and
    every positional argument fits its parameter list."""
    real = _wheel_functions()
    module, fn_name = fib.FLASHINFER_CALLS[op]
    node = real[module].get(fn_name)
    assert node is not None, f"flashinfer.{module}.{fn_name} not in 0.6.12"
    params = [a.arg for a in node.args.args] + [a.arg for a in node.args.kwonlyargs]
    spec = get_op(op)
    dims = dict(spec.default_dims) if op != "gdn_chunk_prefill" else \
        {"num_k_heads": 2, "num_v_heads": 2, "head_k_dim": 16, "head_v_dim": 16, "seqs": 2}
    if op == "gdn_decode":
        dims = {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16}
    args = spec.make_inputs(5, dims, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    fib.FNS[op][0](*clone_args(args))
    calls = [c for c in fake_flashinfer[module].calls if c[0] == fn_name]
    assert calls, f"adapter for {op} did not call flashinfer.{module}.{fn_name}"
    for _, pos, kw in calls:
        assert len(pos) <= len(node.args.args)
        assert set(kw) <= set(params), (op, set(kw) - set(params))


@pytest.mark.parametrize("op", OPS_WITH_FI)
@pytest.mark.parametrize("dname", ["bf16", "fp16"])
def test_adapters_compute_the_op_through_the_fake(op, dname, fake_flashinfer):
    """With FlashInfer's functions replaced by the references, each adapter passes parity:
    argument order, in-place vs returned results, the cache and gate conversions are right."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname]
    spec = get_op(op)
    dims = dict(spec.default_dims)
    if op == "gdn_chunk_prefill":
        dims = {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16,
                "seqs": 2}
    elif op == "gdn_decode":
        dims = {"num_k_heads": 2, "num_v_heads": 4, "head_k_dim": 16, "head_v_dim": 16}
    args = spec.make_inputs(7, dims, dtype, "cpu", torch.Generator().manual_seed(4))
    res = parity.check(spec, fib.FNS[op][0], args, dtype)
    assert res.passed, (op, res)


def test_rope_cache_converted_once_per_cache(fake_flashinfer):
    spec = get_op("rotary_embedding")
    args = spec.make_inputs(3, dict(spec.default_dims), torch.bfloat16, "cpu",
                            torch.Generator().manual_seed(0))
    cache = args[4]
    a = fib.fp32_cache(cache)
    assert a.dtype == torch.float32 and torch.equal(a, cache.float())
    assert fib.fp32_cache(cache) is a                       # memoised
    cache.mul_(2)                                           # an in-place update is seen
    b = fib.fp32_cache(cache)
    assert b is not a and torch.equal(b, cache.float())
    f32 = cache.float()
    assert fib.fp32_cache(f32) is f32
