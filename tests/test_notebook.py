"""The calibration-report notebook runs (nbclient, a real kernel) and writes its figures,
so it cannot rot: executed against a copy of the shipped H200 DB, figures into a temp dir —
once over every model calibrated in the DB, once restricted to one model's workload."""
from __future__ import annotations

import re
import shutil
import sqlite3

import pytest

from conftest import REPO

NOTEBOOK = REPO / "notebooks" / "calibration_report.ipynb"
H200_DB = REPO / "db" / "NVIDIA-H200_driver-580.159.04.db"
FIGURES = ("winner_map.png", "speedup_vs_fl.png", "roofline_share.png")

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


def run_notebook(tmp_path, monkeypatch, **env) -> tuple[str, list, object]:
    db = tmp_path / "h200.db"
    shutil.copy(H200_DB, db)
    figs = tmp_path / "figures"
    for k in ("DEVICE", "COPY_GBPS", "MODEL"):
        monkeypatch.delenv(f"FLTUNE_NOTEBOOK_{k}", raising=False)
    monkeypatch.setenv("FLTUNE_NOTEBOOK_DB", str(db))
    monkeypatch.setenv("FLTUNE_NOTEBOOK_FIGURES", str(figs))
    for k, v in env.items():
        monkeypatch.setenv(f"FLTUNE_NOTEBOOK_{k}", v)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")
    for name in FIGURES:
        png = figs / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size > 20_000
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == len(FIGURES)            # shown inline too
    return text, images, db


def test_notebook_over_the_shipped_h200_db(tmp_path, monkeypatch):
    text, _, db = run_notebook(tmp_path, monkeypatch)
    con = sqlite3.connect(db)
    n = con.execute("select count(*) from winners").fetchone()[0]
    models = {m for (m,) in con.execute("select distinct model from runs")}
    assert f"{db}: NVIDIA H200 [1fd699198d379787] driver 580.159.04; {n} bands" in text
    for m in models:          # one workload-weighted summary per calibrated model
        hit = re.search(rf"^{re.escape(m)}: (\d+) bands, .* fixed FL order (\d+\.\d+)x$", text,
                        re.M)
        assert hit and int(hit.group(1)) > 0 and float(hit.group(2)) >= 1.0, (m, text)
    assert f"shown: {n} bands" in text


def test_notebook_one_model(tmp_path, monkeypatch):
    text, _, _ = run_notebook(tmp_path, monkeypatch, MODEL="Qwen3.5-0.8B",
                              COPY_GBPS="4000")
    shown = int(re.search(r"showing Qwen3.5-0.8B's workload only: (\d+) bands", text).group(1))
    summary = int(re.search(r"^Qwen3.5-0.8B: (\d+) bands", text, re.M).group(1))
    assert shown == summary > 0 and f"shown: {shown} bands" in text
    assert "of 4000 GB/s" in text
