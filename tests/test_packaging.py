"""The wheel is complete: built from this tree, installed into a fresh virtual environment
(fltune from the wheel only, never from the source tree), it calibrates a built-in profile
(the profiles are package data) from a directory outside the checkout.

The venv is made without pip and reuses the heavy dependencies (torch, sqlite-utils, rich)
of the environment running the tests through a .pth line naming that environment's
site-packages; a .pth line only appends a path, so the editable fltune installed there (its
own .pth finder) is not activated. The test asserts where fltune was imported from.
"""
from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

PROFILE = "Qwen3.5-0.8B"


def run(cmd, **kw):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    assert p.returncode == 0, (f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Build the wheel from a copy of the package sources (so a stale build/ in the checkout
    cannot leak files into it), offline, with the setuptools already installed."""
    root = tmp_path_factory.mktemp("pkg")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "fltune", src / "fltune",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    p = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--no-index", "-v", "-w", root / "dist", src], timeout=300)
    # the build is warning-free (project.license as a table warned three times)
    warnings = [ln for ln in (p.stdout + p.stderr).splitlines()
                if "Warning" in ln or "deprecat" in ln.lower()]
    assert not warnings, "\n".join(warnings)
    (whl,) = (root / "dist").glob("fltune-*.whl")
    return whl


def test_wheel_carries_every_profile(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(Path(n).stem for n in names
                     if n.startswith("fltune/profiles/") and n.endswith(".json"))
    assert shipped == sorted(p.stem for p in (REPO / "fltune" / "profiles").glob("*.json"))
    assert PROFILE in shipped
    assert not [n for n in names if n.startswith(("calibrate/", "tests/", "benchmarks/"))]


def test_wheel_in_fresh_venv_calibrates_builtin_profile(wheel, tmp_path):
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
    vpy = venv / "bin" / "python"
    vsite = Path(run([vpy, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
                     ).stdout.strip())
    # the running environment's packages, after the venv's own (torch and friends)
    (vsite / "zz_outer_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run([sys.executable, "-m", "pip", "--python", vpy, "install", "--no-deps", "--no-index",
         wheel], timeout=300)

    work = tmp_path / "elsewhere"                 # not the checkout: no ./fltune to import
    work.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FLTUNE_PROFILES", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = run([vpy, "-c", "import fltune; print(fltune.__file__)"], cwd=work, env=env
                ).stdout.strip()
    assert Path(where).resolve().is_relative_to(vsite.resolve()), where
    assert not Path(where).resolve().is_relative_to(REPO.resolve()), where

    db = work / "X.db"
    p = run([venv / "bin" / "fltune", "calibrate", "--model", PROFILE, "--max-tokens", "64",
             "--db", db], cwd=work, env=env, timeout=600)
    con = sqlite3.connect(db)
    n_winners, n_ops = con.execute(
        "select count(*), count(distinct op) from winners").fetchone()
    # Qwen3.5-0.8B: 7 (op, shape) tables x 7 bands up to 64 tokens, a winner in every band
    assert n_winners == 49 and n_ops >= 5, (n_winners, n_ops)
    assert con.execute("select count(*) from winners where impl_id is null or not median_us > 0"
                       ).fetchone()[0] == 0
