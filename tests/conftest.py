"""Shared fixtures for fltune's tests.

Every test leaves the process as it found it: dispatch thawed and the default manager
dropped (``reset_default_manager()`` / ``thaw_dispatch()``), and no policy or plugin
variable from the outer environment leaks into a test (each test sets what it needs).
"""
from __future__ import annotations

import hashlib
import os
import sqlite3
import sys
from pathlib import Path

import pytest
import torch

from fltune.dispatch.discovery import discover
from fltune.dispatch.frozen import thaw_dispatch
from fltune.dispatch.manager import OpManager, reset_default_manager
from fltune.dispatch.registry import OpRegistry
from fltune.dispatch.types import BackendImplKind, OpImpl

TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = TESTS_DIR / "fixtures"
REPO = TESTS_DIR.parent

def _session_dir(env: str, prefix: str) -> None:
    """``env`` names a fresh folder of this test session, removed at exit, unless the user
    set it already."""
    if not os.environ.get(env):
        import atexit
        import shutil
        import tempfile
        folder = tempfile.mkdtemp(prefix=prefix)
        os.environ[env] = folder
        atexit.register(shutil.rmtree, folder, ignore_errors=True)


# One vLLM cache root for the whole test session (a user's own VLLM_CACHE_ROOT is kept):
# every vLLM engine the tests start, in this process or a child, compiles into it, so an
# engine whose config another test already compiled loads that compile (on this 2-core
# machine a cold tiny-model start takes 40-50 s, a warm one ~20 s) and nothing is written
# to the user's ~/.cache/vllm. Engines that differ (a routed op, another route mode, an
# engine-wide setting) get their own hash inside it, as in vLLM; tests that need a cold or
# separate compile name a root of their own, and the compile A/A arm makes its own.
_session_dir("VLLM_CACHE_ROOT", "fltune-tests-vllm-cache-")
# profiles' config folders for vLLM (fltune.evaluate.model_dir.stable_model_dir) likewise
# go to the session's own folder, never to the user's ~/.cache/fltune/models
_session_dir("FLTUNE_MODEL_CACHE", "fltune-tests-models-")

#: the environment variables the selection policy and discovery read, in both spellings
POLICY_ENV = [prefix + name for prefix in ("FLTUNE_", "VLLM_FL_")
              for name in ("PREFER", "STRICT", "PER_OP", "ALLOW_VENDORS", "DENY_VENDORS",
                           "CONFIG", "PLUGIN_MODULES")]


@pytest.fixture(autouse=True)
def _isolated_dispatch(monkeypatch):
    """No outer policy/plugin variables; dispatch thawed and default manager reset after."""
    for name in POLICY_ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    reset_default_manager()
    thaw_dispatch()


def build_builtin_registry() -> OpRegistry:
    """A registry with exactly the built-in backends (no entry points, no env modules)."""
    reg = OpRegistry()
    report = discover(reg, entry_point_group=None, environ={})
    assert not report.failed, f"a built-in backend failed to load: {report.failed}"
    return reg


@pytest.fixture(scope="session")
def builtin_registry() -> OpRegistry:
    """Built once per session; tests must not mutate it (use ``fresh_registry``)."""
    return build_builtin_registry()


@pytest.fixture
def fresh_registry(builtin_registry) -> OpRegistry:
    """A private copy of the built-in registry that a test may add to or clear."""
    reg = OpRegistry()
    for op in builtin_registry.ops():
        reg.register_many(builtin_registry.get_implementations(op))
    return reg


@pytest.fixture
def fresh_manager(fresh_registry) -> OpManager:
    """An OpManager over a private registry, with the default (fixed FL) policy."""
    from fltune.dispatch.policy import SelectionPolicy
    return OpManager(fresh_registry, SelectionPolicy())


@pytest.fixture
def concat_kernels(monkeypatch) -> list:
    """The input count of every ``ConcatKernel`` Inductor builds while the test runs (how a
    test sees which way a ``cat`` was lowered)."""
    from torch._inductor import ir

    made: list = []
    real = ir.ConcatKernel.create

    def counting(inputs, dim):
        made.append(len(inputs))
        return real(inputs, dim)
    monkeypatch.setattr(ir.ConcatKernel, "create", counting)
    return made


@pytest.fixture
def tmp_db_path(tmp_path) -> Path:
    return tmp_path / "calib" / "fltune.db"


# ---- toy candidates for policy / manager tests ---------------------------------------

def make_impl(op, impl_id, kind, fn=None, *, vendor=None, priority=None, qualify=None,
              precision_rank=0, backend="test"):
    kw = {}
    if qualify is not None:
        kw["qualify"] = qualify
    return OpImpl(op_name=op, impl_id=impl_id, kind=BackendImplKind(kind),
                  fn=fn or (lambda *a: impl_id), vendor=vendor, priority=priority,
                  backend=backend, precision_rank=precision_rank, **kw)


@pytest.fixture
def toy_impls():
    """One op's candidates shaped like the real CPU/GPU set: FlagGems, two vendors, and
    the three PyTorch candidates with their real priorities (50 / 45 / 40)."""
    op = "toy"
    return [
        make_impl(op, "inductor.standalone", "reference", priority=40),
        make_impl(op, "vendor.vllm", "vendor", vendor="vllm"),
        make_impl(op, "reference.torch", "reference"),
        make_impl(op, "default.flagos", "default"),
        make_impl(op, "vendor.acme", "vendor", vendor="acme"),
        make_impl(op, "reference.torch_fused", "reference", priority=45),
    ]


def ids(impls) -> list[str]:
    return [i.impl_id for i in impls]


def child_env(**extra) -> dict:
    """Environment for a subprocess: this one's, minus policy/plugin variables."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY_ENV}
    env.update({k: str(v) for k, v in extra.items()})
    return env


PYTHON = sys.executable
TORCH_THREADS = torch.get_num_threads()


# CI runs the property tests with a fixed example sequence, so a submission's result does
# not depend on the draw; locally they stay random and keep searching for new failures.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True)
    if os.environ.get("CI"):
        _hyp_settings.load_profile("ci")
except ImportError:  # hypothesis is a dev dependency
    pass


def copy_db(db, copy) -> sqlite3.Connection:
    """A consistent copy of a calibration DB to edit (SQLite's online backup), open."""
    src, dst = sqlite3.connect(db), sqlite3.connect(copy)
    src.backup(dst)
    src.close()
    return dst


def file_digest(path) -> str:
    """sha256 of a file's bytes: a DB opened for reading must come back byte for byte."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def old_schema_db(path, version: int, *, device_and_run: bool = True):
    """A DB as the fltune of schema ``version`` wrote it: the migrations 0..version-1 of
    this code (each release's are kept unchanged), WAL as fltune writes every DB, and (by
    default) one CPU device ``dk``/driver ``drv`` with a finished run 1 of stack ``s1``.
    Returns the open ``sqlite_utils.Database`` for the test to add its rows; close its
    ``conn`` when done. The migration tests of each schema start from here."""
    import sqlite_utils
    from fltune.store.db import MIGRATIONS

    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=wal")
    db = sqlite_utils.Database(con)
    db["meta"].create({"key": str, "value": str}, pk="key")
    for v in range(version):
        MIGRATIONS[v](db)
    db["meta"].insert({"key": "schema_version", "value": str(version)})
    if device_and_run:
        db["devices"].insert({"device_key": "dk", "device_type": "cpu", "name": "CPU X",
                              "capability": None, "sms": 2, "memory_bytes": 1,
                              "driver": "drv", "runtime": "r"})
        db["runs"].insert({"id": 1, "device_key": "dk", "driver": "drv", "model": "tiny",
                           "dtype": "bf16", "tp": 1, "settings": "{}", "stack": "{}",
                           "stack_key": "s1", "status": "done", "started": 1.0,
                           "finished": 2.0})
    return db


def stored_route_decisions(path) -> list:
    """The route decisions a DB holds for its (first) device, read as fltune reads them."""
    from fltune.store.db import CalibrationDB

    c = CalibrationDB(path, create=False)
    try:
        dev = c.devices()[0]
        return c.route_decisions(dev["device_key"], dev["driver"])
    finally:
        c.close()
