"""benchmarks/resettle_split.py on a copy of the shipped H200 DB (real rows, real SQLite:
Qwen3.5-0.8B's `linear` split, the one the DB still holds since session 19 undid Qwen3-0.6B's):
a later as-served run judged by rule model-step/5 keeps or undoes a per-range split, the
A/A's wall reach decides what "measurably slower" means, and bad input changes nothing."""
from __future__ import annotations

import importlib.util
import json
import shutil
import sqlite3
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "db" / "NVIDIA-H200_driver-580.159.04.db"
MODEL = "Qwen3.5-0.8B"


def _script():
    spec = importlib.util.spec_from_file_location("resettle_split",
                                                  ROOT / "benchmarks" / "resettle_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(db, model=MODEL, op="linear"):
    con = sqlite3.connect(db)
    try:
        return con.execute("select decision, min_tokens, max_tokens, rule, evidence from "
                           "route_decisions where model_name=? and op=? order by min_tokens",
                           [model, op]).fetchall()
    finally:
        con.close()


def _summary(path, served, aa):
    """An e2e summary as the instrument writes it: arm ``calibrated`` and the A/A ``aa``,
    (scenario, ci_low, ci_high) each, kernel CIs inside 1 % (a kernel tie)."""
    def pt(arm, s, lo, hi):
        return {"scenario": s, "arm": arm, "n": 10, "ratio_median": (lo + hi) / 2,
                "ci_low": lo, "ci_high": hi, "kernel_n": 5, "kernel_ratio_median": 1.0,
                "kernel_ci_low": 0.998, "kernel_ci_high": 1.002}
    doc = {"command": "fltune bench --e2e (test)", "date": "2026-12-02",
           "points": [pt("calibrated", *p) for p in served] + [pt("aa", *p) for p in aa]}
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture()
def db(tmp_path):
    assert SHIPPED.exists()
    d = tmp_path / "h200.db"
    shutil.copy(SHIPPED, d)
    assert [r[:3] for r in _rows(d)] == [("route", 1, 512), ("native", 513, None)]
    return d


def test_a_slowdown_beyond_the_aa_reach_undoes_the_split_inside_it_keeps_it(db, tmp_path):
    mod = _script()
    aa = [("decode_b1", 0.95, 1.05), ("prefill_2048", 0.97, 1.10)]          # reach 5 %, 10 %
    inside = _summary(tmp_path / "in.json", [("decode_b1", 0.97, 1.03),
                                             ("prefill_2048", 0.85, 0.95)], aa)
    beyond = _summary(tmp_path / "out.json", [("decode_b1", 0.97, 1.03),
                                              ("prefill_2048", 0.80, 0.88)], aa)
    args = ["--db", str(db), "--rows-from", str(db), "--model", MODEL, "--op", "linear"]
    assert mod.main(args + ["--served", inside]) == 0
    kept = _rows(db)
    assert [r[:3] for r in kept] == [("route", 1, 512), ("native", 513, None)]
    ev = json.loads(kept[0][4])["as_served"]
    assert kept[0][3] == "model-step/5" and ev["verdict"] == "not slower"
    assert ev["wall_floors"] == {"decode_b1": pytest.approx(0.05),
                                 "prefill_2048": pytest.approx(0.10)}
    # the same DB re-settled from a run whose prefill sits beyond the A/A's 10 %: undone,
    # one native row over every size, the split kept in the evidence
    src = tmp_path / "rows.db"
    shutil.copy(db, src)
    assert mod.main(["--db", str(db), "--rows-from", str(src), "--model", MODEL,
                     "--op", "linear", "--served", beyond, "--earlier", inside]) == 0
    (row,) = _rows(db)
    assert row[:3] == ("native", 1, None)
    ev = json.loads(row[4])
    assert ev["as_served"]["slower_at"] == ["prefill_2048"]
    assert [r["decision"] for r in ev["split_rows"]] == ["route", "native"]
    assert [e["verdict"] for e in ev["as_served"]["earlier"]] == ["not slower"]


def test_bad_input_writes_nothing(db, tmp_path):
    mod = _script()
    before = db.read_bytes()
    base = ["--db", str(db), "--rows-from", str(db), "--model", MODEL, "--op", "linear"]
    no_aa = _summary(tmp_path / "noaa.json", [("decode_b1", 0.97, 1.03)], [])
    with pytest.raises(SystemExit, match="no point of the A/A arm 'aa'"):
        mod.main(base + ["--served", no_aa])
    ok = _summary(tmp_path / "ok.json", [("decode_b1", 0.97, 1.03)],
                  [("decode_b1", 0.95, 1.05)])
    with pytest.raises(SystemExit, match="no point of arm 'served'"):
        mod.main(base + ["--served", ok, "--arm", "served"])
    with pytest.raises(SystemExit, match="not a split by token range"):
        mod.main(["--db", str(db), "--rows-from", str(db), "--model", MODEL,
                  "--op", "silu_and_mul", "--served", ok])
    assert mod.main(base + ["--served", ok, "--dry-run"]) == 0
    assert db.read_bytes() == before
