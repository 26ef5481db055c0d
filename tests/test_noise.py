"""Honest noise and the DB for people: the undecided rule on synthetic timings, the machine
probe's verdict, schema 3 (noise probes, the undecided flag, readable views) on a real
calibration and on a migrated copy of the shipped DB, and a real calibration beside a
process that keeps every core busy."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time

import pytest

from fltune.store.db import SCHEMA_VERSION, VIEWS, CalibrationDB
from fltune.tune import noise
from fltune.tune.parity import ParityResult
from fltune.tune.race import Outcome, Verdict, pick_winner
from fltune.tune.timing import Timing

from conftest import REPO, child_env, make_impl

H200_DB = REPO / "db" / "NVIDIA-H200_driver-580.159.04.db"
#: the H200 DB as shipped before schema 3 (2026-11-29): the migration's subject, kept as a
#: fixture since the shipped DB itself moved on (schema 4, issue 11's recalibration)
H200_DB_V2 = REPO / "tests" / "fixtures" / "h200-schema2-2026-11-29.db"
MARGIN = 0.03


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---- the rule, on synthetic timings --------------------------------------------------------

@pytest.mark.parametrize("fast,second,nz,expected", [
    (10.0, 10.5, 0.20, True),     # gap 5 % < noise 20 % (and noise > margin): undecided
    (10.0, 15.0, 0.20, False),    # gap 50 % > noise 20 %: decided by speed
    (10.0, 10.1, 0.02, False),    # noise under the win margin: the margin rule decides
    (10.0, None, 5.00, False),    # a lone candidate is never undecided
    (10.0, 12.5, 0.25, False),    # gap exactly the noise: not exceeded
])
def test_judge(fast, second, nz, expected):
    assert noise.judge(fast, second, nz, MARGIN) is expected


def _outcome(impl_id, median, spread, rel_error, kind="reference", priority=None):
    impl = make_impl("toy", impl_id, kind, priority=priority)
    t = Timing(median, median * (1 - spread / 2), median * (1 + spread / 2), 50, {})
    return Outcome(impl, "timed", None, ParityResult(1.0, rel_error, 0.0, True), t)


def _verdict(outcomes):
    w, ru, why = pick_winner(outcomes, MARGIN)
    return Verdict(list(outcomes), w, ru, why, 100)


def test_settle_leaves_a_decided_band_alone():
    outs = [_outcome("a", 10.0, 0.05, 1e-3), _outcome("b", 20.0, 0.05, 1e-6)]
    v = _verdict(outs)
    got, undecided, nz = noise.settle(v, MARGIN, ["b", "a"])
    assert not undecided and got is v and got.winner.impl.impl_id == "a"
    assert nz == pytest.approx(0.05)


def test_settle_undecided_picks_by_precision_then_fl_order():
    # a is fastest by 5 %, but every timing spreads 30 %: speed cannot tell a, b, c apart;
    # d is 2x slower, outside the noise
    outs = [_outcome("a", 10.0, 0.30, 1e-3), _outcome("b", 10.5, 0.30, 1e-5),
            _outcome("c", 10.8, 0.30, 1e-5), _outcome("d", 20.0, 0.30, 0.0)]
    v = _verdict(outs)
    assert v.winner.impl.impl_id == "a"                 # the race alone picks on speed
    got, undecided, nz = noise.settle(v, MARGIN, ["c", "b", "a", "d"])
    assert undecided and nz == pytest.approx(0.30)
    # b and c tie on precision; c comes first in the FL order; d is outside the noise
    assert got.winner.impl.impl_id == "c"
    assert got.runner_up.impl.impl_id == "a"
    assert got.reason.startswith("undecided") and "3 candidates" in got.reason
    got2, _, _ = noise.settle(v, MARGIN, ["b", "c", "a", "d"])
    assert got2.winner.impl.impl_id == "b"


def test_settle_noise_from_the_runner_up_counts_too():
    outs = [_outcome("a", 10.0, 0.01, 1e-3), _outcome("b", 10.5, 0.40, 1e-5)]
    _, undecided, nz = noise.settle(_verdict(outs), MARGIN, ["a", "b"])
    assert undecided and nz == pytest.approx(0.40)


def test_band_noise_reads_the_rule_back_from_rows():
    rows = [{"impl_id": "a", "outcome": "timed", "median_us": 10.0, "p10_us": 9.0,
             "p90_us": 12.0},
            {"impl_id": "b", "outcome": "timed", "median_us": 11.0, "p10_us": 10.9,
             "p90_us": 11.1},
            {"impl_id": "c", "outcome": "parity_failed", "median_us": 1.0, "p10_us": 0.1,
             "p90_us": 9.0}]
    nz, fast, second = noise.band_noise(rows, "b")
    assert (fast, second) == (10.0, 11.0) and nz == pytest.approx(0.3)
    assert noise.judge(fast, second, nz, MARGIN)          # gap 10 % < noise 30 %


def test_loaded_names_each_cause():
    quiet = noise.Probe("cpu", "cpu-perf_counter", 20.0, 0.05, 400, 0.2, 2, 0.05)
    assert noise.loaded(quiet) is None
    spread = noise.Probe("cpu", "cpu-perf_counter", 20.0, 3.0, 400, 0.2, 2, 0.05)
    assert "spread 300%" in noise.loaded(spread)
    busy = noise.Probe("cpu", "cpu-perf_counter", 20.0, 0.05, 400, 0.2, 2, 0.9)
    assert "other processes took 90%" in noise.loaded(busy)
    load = noise.Probe("cpu", "cpu-perf_counter", 20.0, 0.05, 400, 5.0, 2, None)
    assert "load average 5.0 on 2 cores" in noise.loaded(load)
    line = noise.warning(noise.loaded(busy), "/tmp/x.db", "tiny-qwen3", 16)
    assert line.startswith("warning: this machine is loaded (")
    assert "fltune calibrate --model tiny-qwen3 --db /tmp/x.db --max-tokens 16 --force" in line
    assert "fltune verify --db /tmp/x.db" in line and "\n" not in line
    assert noise.rerun_command("m", "/tmp/a b.db", max_tokens=64, ops=["rms_norm", "rope"],
                               tp=2) == ("fltune calibrate --model m --db '/tmp/a b.db' --tp 2 "
                                         "--max-tokens 64 --ops rms_norm,rope --force")


def test_probe_measures_with_the_race_timer():
    p = noise.probe("cpu", blocks=2, budget_s=0.002, pause_s=0.0)
    assert p.timer == "cpu-perf_counter" and p.median_us > 0 and p.spread >= 0
    assert p.n >= 10 and p.cores == (os.cpu_count() or 1)


# ---- schema 3 on a real calibration --------------------------------------------------------

@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A small real calibration (in process) and the warnings it printed."""
    from fltune.tune.calibrate import calibrate
    path = tmp_path_factory.mktemp("noise") / "cal.db"
    lines = []
    res = calibrate("tiny-qwen3", str(path), max_tokens=2, ops=["rms_norm", "silu_and_mul"],
                    warn=lines.append)
    return path, res, lines


def _rows(path, q, args=()):
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in con.execute(q, args)]
    finally:
        con.close()


def test_calibration_stores_probes_and_flags(calibrated):
    path, res, lines = calibrated
    probes = _rows(path, "select * from noise_probes order by id")
    # start, one before each later workload item, end
    items = len({(w["op"], w["signature"]) for w in res.winners})
    assert len(probes) == items + 1 and probes[0]["phase"] == "start"
    assert probes[-1]["phase"] == "end"
    assert all(p["run_id"] == res.run_id and p["timer"] == "cpu-perf_counter"
               and p["median_us"] > 0 and p["spread"] >= 0 for p in probes)
    # a warning was printed exactly when a probe found the machine loaded (first one, then
    # again only after a quiet probe)
    flags = [bool(p["loaded"]) for p in probes]
    turns = sum(1 for k, f in enumerate(flags) if f and (k == 0 or not flags[k - 1]))
    assert len(lines) == turns == len(res.noise["warnings"])
    winners = _rows(path, "select * from winners")
    assert winners and all(w["undecided"] in (0, 1) for w in winners)
    assert sum(w["undecided"] for w in winners) == res.noise["undecided"]
    # every stored flag follows the rule on the stored measurements
    for w in winners:
        ms = _rows(path, "select * from measurements where op=? and signature=? and band_hi=?",
                   (w["op"], w["signature"], w["band_hi"]))
        nz, fast, second = noise.band_noise(ms, w["impl_id"])
        assert bool(w["undecided"]) == noise.judge(fast, second, nz, MARGIN)
        assert w["undecided"] == 0 or w["reason"].startswith("undecided")


def test_views_exist_and_read_without_joins(calibrated):
    path, res, _ = calibrated
    con = sqlite3.connect(path)
    names = {r[0] for r in con.execute("select name from sqlite_master where type='view'")}
    con.close()
    assert set(VIEWS) <= names
    winners = {(w["op"], w["signature"], w["band_hi"]): w
               for w in _rows(path, "select * from winners")}
    readable = _rows(path, "select * from winners_readable")
    assert len(readable) == len(winners)
    for r in readable:
        w = winners[(r["op"], r["signature"], r["band_hi"])]
        assert r["model"] == "tiny-qwen3" and r["device"] == res.device["name"]
        assert r["winner"] == w["impl_id"] and r["winner_us"] == round(w["median_us"], 2)
        assert r["band"] == f"{w['band_lo']}-{w['band_hi']}"
        assert r["gap_pct"] == (None if w["gap"] is None else round(100 * w["gap"], 1))
        assert r["noise_pct"] == round(100 * w["noise"], 1)
        assert r["undecided"] == w["undecided"]
    ms = _rows(path, "select * from measurements")
    mr = _rows(path, "select * from measurements_readable")
    assert len(mr) == len(ms)
    assert sum(r["is_winner"] for r in mr) == len(winners)
    assert {r["timer"] for r in mr if r["outcome"] == "timed"} == {"cpu-perf_counter"}
    assert len(_rows(path, "select * from noise_readable")) == len(
        _rows(path, "select * from noise_probes"))
    db = CalibrationDB(path, create=False)
    try:
        assert db.integrity_check() == "ok" and db.schema_version() == SCHEMA_VERSION
    finally:
        db.close()


def test_views_with_the_commands_readme_names(calibrated):
    path, _, _ = calibrated
    exe = shutil.which("sqlite-utils", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("sqlite-utils command not installed")
    out = subprocess.run([exe, "rows", str(path), "winners_readable", "--limit", "5"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    assert 1 <= len(rows) <= 5 and {"model", "winner", "gap_pct", "undecided"} <= set(rows[0])


def test_report_shows_noise_and_names_undecided_bands(calibrated, tmp_path):
    from fltune.evaluate import report
    path, res, _ = calibrated
    copy = tmp_path / "flagged.db"
    shutil.copy(path, copy)
    con = sqlite3.connect(copy)          # make one band undecided, whatever this machine did
    con.execute("update winners set undecided=0")
    con.execute("update winners set undecided=1 where rowid=(select min(rowid) from winners)")
    (op, sig, lo, hi), = con.execute("select op, signature, band_lo, band_hi from winners "
                                     "where undecided=1")
    con.commit()
    con.close()
    doc = report.build(str(copy))
    assert doc["summary"]["bands_undecided"] == 1
    assert [(u["op"], u["signature"], u["band_hi"]) for u in doc["undecided"]] == [(op, sig, hi)]
    assert all("band_noise" in r and r["undecided_source"] == "stored" for r in doc["rows"])
    assert f"--db {copy}" in doc["way_out"] and "fltune verify" in doc["way_out"]
    env = child_env(COLUMNS="80")
    p = subprocess.run([sys.executable, "-m", "fltune", "report", "--db", str(copy)],
                       capture_output=True, text=True, env=env, check=True)
    text = p.stdout
    assert "noise" in text and "undecided (noise above the win margin): 1" in text
    tail = text[text.index("warning"):]
    assert op in tail and "fltune verify --db" in tail
    assert max(len(line) for line in text.splitlines()) <= 80
    js = json.loads(subprocess.run([sys.executable, "-m", "fltune", "report", "--db",
                                    str(copy), "--json"], capture_output=True, text=True,
                                   env=env, check=True).stdout)
    assert js["summary"]["bands_undecided"] == 1 and len(js["undecided"]) == 1


# ---- schema 2 -> 3 on the shipped DB ---------------------------------------------------------

def test_version_2_db_read_as_is_and_migrated_by_a_writer(tmp_path):
    from fltune.evaluate import diff, report
    from fltune.freeze import build_manifest
    copy = tmp_path / "h200.db"
    shipped = _digest(H200_DB_V2)
    shutil.copy(H200_DB_V2, copy)
    v2 = _digest(copy)
    db = CalibrationDB(copy, create=False)
    assert db.schema_version() == 2 and "noise_probes" not in db.db.table_names()
    db.close()
    rep = report.build(str(copy), device="H200")
    # the rule applied to the stored measurements of a DB older than the flag
    assert rep["rows"] and all(r["undecided_source"] == "derived" for r in rep["rows"])
    assert rep["summary"]["bands_undecided"] == sum(r["undecided"] for r in rep["rows"])
    m2, _ = build_manifest(str(copy), device="NVIDIA", check_stack=False)
    assert _digest(copy) == v2                       # readers never rewrite an older DB
    con = sqlite3.connect(copy)
    counts = {t: con.execute(f"select count(*) from {t}").fetchone()[0]
              for t in ("devices", "runs", "measurements", "winners", "crossovers")}
    con.close()
    db = CalibrationDB(copy, create=False, write=True)   # a writer migrates it
    try:
        assert db.schema_version() == SCHEMA_VERSION >= 3
        assert {"undecided", "machine_noise"} <= {c.name for c in db.db["winners"].columns}
        assert "noise_probes" in db.db.table_names() and set(VIEWS) <= set(db.db.view_names())
        assert db.integrity_check() == "ok"
    finally:
        db.close()
    con = sqlite3.connect(copy)
    assert {t: con.execute(f"select count(*) from {t}").fetchone()[0]
            for t in counts} == counts
    assert con.execute("select count(*) from winners_readable").fetchone()[0] == counts["winners"]
    assert con.execute("select count(*) from winners_readable where model is null or device "
                       "is null").fetchone()[0] == 0
    con.close()
    m3, _ = build_manifest(str(copy), device="NVIDIA", check_stack=False)
    assert m3["ops"] == m2["ops"]
    d = diff.run_diff(str(H200_DB_V2), str(copy))
    assert d["summary"]["changed"] == 0 and d["summary"]["common"] == counts["winners"]
    assert _digest(H200_DB_V2) == shipped               # the shipped file was only read


# ---- beside a real CPU hog --------------------------------------------------------------------

@pytest.mark.slow
def test_calibration_beside_a_cpu_hog_warns_and_flags(tmp_path):
    """Every core kept busy by another process: calibrate warns at once (one line naming
    the cause and the way out) and stores the probes that saw it and the undecided flags."""
    path = tmp_path / "hog.db"
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"])
            for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        p = subprocess.run([sys.executable, "-m", "fltune", "calibrate", "--model",
                            "tiny-qwen3", "--max-tokens", "4", "--db", str(path), "--json",
                            # two ops keep the check (probes, warning, flags) at half the
                            # time: every core is hogged, so each band crawls
                            "--ops", "rms_norm,silu_and_mul",
                            "--no-isolate"], capture_output=True, text=True,
                           env=child_env(), timeout=900)
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()
    assert p.returncode == 0, p.stderr[-2000:]
    warn = [line for line in p.stderr.splitlines() if "this machine is loaded" in line]
    assert warn, p.stderr[-2000:]
    assert "other processes took" in warn[0] and "--force" in warn[0]
    assert f"fltune verify --db {path}" in warn[0]
    doc = json.loads(p.stdout)
    probes = _rows(path, "select * from noise_probes")
    assert probes and probes[0]["phase"] == "start" and probes[0]["loaded"]
    assert probes[0]["busy_others"] > noise.BUSY_LIMIT
    winners = _rows(path, "select * from winners")
    assert winners and all(w["undecided"] in (0, 1) for w in winners)
    undecided = [w for w in winners if w["undecided"]]
    assert len(undecided) == doc["undecided"]
    assert all(w["reason"].startswith("undecided") for w in undecided)
    # a hog does not make every band's noise exceed its gap (how many it flips depends on
    # the scheduler), so the flags are checked against the rule, not counted: each stored
    # flag follows the rule on the stored measurements
    for w in winners:
        ms = _rows(path, "select * from measurements where op=? and signature=? and band_hi=?",
                   (w["op"], w["signature"], w["band_hi"]))
        nz, fast, second = noise.band_noise(ms, w["impl_id"])
        assert bool(w["undecided"]) == noise.judge(fast, second, nz, MARGIN)
