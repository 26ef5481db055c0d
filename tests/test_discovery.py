"""Backend discovery: built-ins, a REAL entry point of a package installed during the test
(tests/fixtures/fake_backend_pkg), modules named in FLTUNE_PLUGIN_MODULES, and broken
backends reported without taking the built-ins down."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import FIXTURES, PYTHON, child_env
from fltune.backends import BUILTIN_BACKENDS
from fltune.dispatch.discovery import DiscoveryReport, discover, plugin_module_names
from fltune.dispatch.registry import OpRegistry
from fltune.backends.native_vllm import LAYER_OF
from fltune.ops import NOT_COMPILED, OPS

FAKE_PKG = FIXTURES / "fake_backend_pkg"
FAKE_MODULES = ["fltune_fake_backend", "fltune_fake_backend.env_backend",
                "fltune_fake_backend.broken", "fltune_fake_backend.bad_type"]


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory):
    """pip-install the fixture package into a private target dir (offline, no deps).
    Built from a copy, so the build's egg-info/build dirs never land in the repo."""
    root = tmp_path_factory.mktemp("fakepkg")
    src = root / "src"
    shutil.copytree(FAKE_PKG, src, ignore=shutil.ignore_patterns("__pycache__", "build",
                                                                 "*.egg-info"))
    site = root / "site"
    proc = subprocess.run(
        [PYTHON, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install of the fixture failed:\n{proc.stdout}\n{proc.stderr}"
    eps = list(site.glob("fltune_fake_backend-*.dist-info/entry_points.txt"))
    assert eps and "[fltune.backends]" in eps[0].read_text()
    return site


PROBE = textwrap.dedent("""
    import json, os, torch
    from fltune.dispatch.discovery import discover
    from fltune.dispatch.registry import OpRegistry
    from fltune.ops import OPS
    from fltune.tune import parity

    reg = OpRegistry()
    rep = discover(reg)
    out = {"loaded": rep.loaded, "failed": rep.failed,
           "builtin_ref_ops": sorted(op for op in OPS
                                     if any(i.impl_id == "reference.torch"
                                            for i in reg.get_implementations(op)))}
    try:
        impl = reg.get("silu_and_mul", "vendor.fake")
    except KeyError:
        out["fake"] = None
    else:
        import fltune_fake_backend as fk
        spec = OPS["silu_and_mul"]
        args = spec.make_inputs(7, spec.default_dims, torch.bfloat16, "cpu",
                                torch.Generator().manual_seed(0))
        res = parity.check(spec, impl.fn, args, torch.bfloat16)
        # the fixed FL order ranks the new vendor like any VENDOR; a per-op order picks it
        from fltune.dispatch import call_op, get_default_manager
        pick = get_default_manager().policy.order(
            "silu_and_mul", get_default_manager().registry.get_implementations("silu_and_mul"))
        before = fk.CALLS
        call_op("silu_and_mul", args[0])
        out["fake"] = {"kind": impl.kind.value, "vendor": impl.vendor,
                       "module_file": fk.__file__, "parity_passed": res.passed,
                       "order": [i.impl_id for i in pick], "calls": fk.CALLS - before}
    print("RESULT " + json.dumps(out))
""")


def _probe(**env):
    proc = subprocess.run([PYTHON, "-c", PROBE], capture_output=True, text=True,
                          env=child_env(**env), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_entry_point_backend_is_discovered(fake_site):
    out = _probe(PYTHONPATH=str(fake_site), FLTUNE_PER_OP="silu_and_mul=vendor:fake")
    assert ["entry_point", "fake", 1] in out["loaded"]
    assert out["failed"] == []
    # the built-ins are all still there
    assert [x[1] for x in out["loaded"] if x[0] == "builtin"] == list(BUILTIN_BACKENDS)
    assert out["builtin_ref_ops"] == sorted(OPS)
    fake = out["fake"]
    assert fake is not None, "the entry point's OpImpl was not registered"
    assert fake["kind"] == "vendor" and fake["vendor"] == "fake"
    # it came from the installed copy, not from the repo's fixture sources
    assert fake["module_file"].startswith(str(fake_site))
    assert fake["parity_passed"] is True
    # the policy in the child (FLTUNE_PER_OP) put it first, and call_op really ran it
    assert fake["order"][0] == "vendor.fake" and fake["calls"] == 1


def test_without_the_package_there_is_no_fake_backend():
    """Control: the same probe without the installed package on the path."""
    out = _probe()
    assert out["fake"] is None
    assert not any(x[0] == "entry_point" and x[1] == "fake" for x in out["loaded"])


@pytest.fixture
def fake_on_path(fake_site, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_site))
    yield fake_site
    for name in FAKE_MODULES:
        sys.modules.pop(name, None)


def test_plugin_modules_env_and_broken_backends(fake_on_path):
    reg = OpRegistry()
    env = {"FLTUNE_PLUGIN_MODULES": " fltune_fake_backend.env_backend, fltune_fake_backend."
                                    "broken,,fltune_fake_backend.bad_type , no_such_module_xyz"}
    rep = discover(reg, entry_point_group=None, environ=env)
    assert ("env", "fltune_fake_backend.env_backend", 1) in rep.loaded
    failed = {name: err for src, name, err in rep.failed}
    assert all(src == "env" for src, _, _ in rep.failed)
    assert set(failed) == {"fltune_fake_backend.broken", "fltune_fake_backend.bad_type",
                           "no_such_module_xyz"}
    assert failed["fltune_fake_backend.broken"].startswith("ImportError")
    assert "unobtainium" in failed["fltune_fake_backend.broken"]
    assert failed["fltune_fake_backend.bad_type"].startswith("TypeError")
    assert "OpImpl" in failed["fltune_fake_backend.bad_type"]
    assert failed["no_such_module_xyz"].startswith("ModuleNotFoundError")
    # the broken ones did not take the built-ins down
    assert [name for src, name, _ in rep.loaded if src == "builtin"] == list(BUILTIN_BACKENDS)
    for op in OPS:
        assert "reference.torch" in {i.impl_id for i in reg.get_implementations(op)}
    assert reg.get("rms_norm", "reference.fake_env").backend == "fake_env"


def test_vllm_fl_plugin_modules_spelling(fake_on_path, monkeypatch):
    monkeypatch.setenv("VLLM_FL_PLUGIN_MODULES", "fltune_fake_backend.env_backend")
    reg = OpRegistry()
    rep = discover(reg, builtin=False, entry_point_group=None)      # reads os.environ
    assert rep.loaded == [("env", "fltune_fake_backend.env_backend", 1)] and not rep.failed
    assert reg.ops() == ["rms_norm"]


def test_plugin_module_names_parsing():
    assert plugin_module_names({}) == []
    assert plugin_module_names({"FLTUNE_PLUGIN_MODULES": " a , b,,c "}) == ["a", "b", "c"]
    assert plugin_module_names({"VLLM_FL_PLUGIN_MODULES": "x"}) == ["x"]
    assert plugin_module_names({"FLTUNE_PLUGIN_MODULES": "a",
                                "VLLM_FL_PLUGIN_MODULES": "x"}) == ["a"]


def test_builtin_discovery_report():
    reg = OpRegistry()
    rep = discover(reg, entry_point_group=None, environ={})
    assert isinstance(rep, DiscoveryReport) and rep.failed == []
    counts = {name: n for _, name, n in rep.loaded}
    # (backends.gemm's count is left to its own tests: linear's candidates vary by device)
    assert {k: v for k, v in counts.items() if k != "fltune.backends.gemm"} == {
        "fltune.backends.reference": len(OPS),
        "fltune.backends.torch_fused": 7,
        "fltune.backends.inductor": len(OPS) - len(NOT_COMPILED),
        "fltune.backends.native_vllm": len(LAYER_OF),
        "fltune.backends.flaggems": 8, "fltune.backends.vllm_c": 8,
        # GDN: 5 prefill + 4 decode candidates; FlashInfer: 8 existing ops + 2 GDN
        "fltune.backends.fla_vllm": 9, "fltune.backends.flashinfer": 10}
    assert sorted(reg.ops()) == sorted(OPS)
    # discovering again replaces, never duplicates
    discover(reg, entry_point_group=None, environ={})
    assert len(reg.get_implementations("rms_norm")) == 7


def test_plugin_can_replace_a_builtin(tmp_path, monkeypatch):
    """A later source (env module) registering an existing impl_id replaces it."""
    (tmp_path / "fltune_override_backend.py").write_text(textwrap.dedent("""
        from fltune.dispatch.types import OpImpl
        def implementations():
            return [OpImpl(op_name="rms_norm", impl_id="reference.torch", kind="reference",
                           fn=lambda *a: "override", backend="override")]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        reg = OpRegistry()
        discover(reg, entry_point_group=None,
                 environ={"FLTUNE_PLUGIN_MODULES": "fltune_override_backend"})
        assert reg.get("rms_norm", "reference.torch").backend == "override"
        assert reg.get("silu_and_mul", "reference.torch").backend == "reference"
    finally:
        sys.modules.pop("fltune_override_backend", None)


def test_registry_refuses_silent_duplicates():
    from conftest import make_impl
    reg = OpRegistry()
    reg.register(make_impl("toy", "a", "reference"))
    with pytest.raises(ValueError, match="already registered"):
        reg.register(make_impl("toy", "a", "default"))
    reg.register(make_impl("toy", "a", "default"), replace=True)
    assert reg.get("toy", "a").kind.value == "default"
    with pytest.raises(KeyError, match="registered: a"):
        reg.get("toy", "b")
