"""End to end on the CPU, through the real CLI in subprocesses and a real SQLite file:
calibrate -> DB -> freeze -> manifest -> report; resume after SIGKILL; fingerprints;
frozen dispatch of a DB-built manifest; clear errors for bad input."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import torch

from fltune.dispatch import freeze_dispatch, get_default_manager, thaw_dispatch
from fltune.dispatch.manifest import fingerprint_of
from fltune.freeze import build_manifest
from fltune.ops import get_op
from fltune.tune import parity
from fltune.tune.bands import bands

from conftest import copy_db

FAST = ["--budget", "0.003", "--quiet"]


def fltune(*args, check=True, **kw):
    p = subprocess.run([sys.executable, "-m", "fltune", *args], capture_output=True, text=True,
                       timeout=600, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"fltune {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("cal") / "tiny.db")
    p = fltune("calibrate", "--model", "tiny-qwen3", "--db", db, "--max-tokens", "32", *FAST,
               "--json")
    return db, json.loads(p.stdout)


def test_calibrate_freeze_report_end_to_end(calibrated, tmp_path):
    db, res = calibrated
    n_bands = len(bands(32))
    # tiny-qwen3: rms_norm x3 shapes, fused_add_rms_norm, rotary_embedding, silu_and_mul
    assert res["measured"] == 6 * n_bands and res["skipped"] == 0
    con = sqlite3.connect(db)
    outcomes = dict(con.execute("select outcome, count(*) from measurements group by outcome"))
    assert outcomes.get("timed", 0) >= 6 * n_bands * 2       # >= 2 qualified per band
    assert outcomes.get("unqualified", 0) >= 6 * n_bands     # flaggems, with its reason
    reason = con.execute("select reason from measurements where impl_id='default.flagos' "
                         "limit 1").fetchone()[0]
    assert "GPU" in reason
    assert con.execute("select count(*) from winners").fetchone()[0] == 6 * n_bands
    assert con.execute("pragma journal_mode").fetchone()[0] == "wal"

    out = tmp_path / "m.json"
    fr = json.loads(fltune("freeze", "--db", db, "--out", str(out), "--json").stdout)
    manifest = json.loads(out.read_text())
    assert fr["fingerprint"] == manifest["fingerprint"] == fingerprint_of(manifest)
    assert set(manifest["ops"]) == {"rms_norm", "fused_add_rms_norm", "rotary_embedding",
                                    "silu_and_mul"}
    for entry in manifest["ops"].values():
        for t in entry["tables"]:
            his = [b["hi"] for b in t["bands"]]
            assert his == sorted(his) and his[-1] == 32 and t["bands"][0]["lo"] == 1
            # adjacent equal winners are merged
            ids = [b["impl_id"] for b in t["bands"]]
            assert all(a != b for a, b in zip(ids, ids[1:]))

    rep = json.loads(fltune("report", "--db", db, "--json").stdout)
    assert len(rep["rows"]) == 6 * n_bands
    for r in rep["rows"]:
        assert r["winner_us"] > 0 and r["parity"] >= 0.99
        assert r["fl_pick"] == "vendor.vllm" or r["op"] not in ("rms_norm", "silu_and_mul")
    assert rep["summary"]["weighted_speedup_vs_fl"] > 0
    text = fltune("report", "--db", db).stdout
    assert "silu_and_mul" in text and "FL pick" in text and "summary" in text
    devs = json.loads(fltune("devices", "--db", db, "--json").stdout)
    assert len(devs) == 1 and devs[0]["winners"] == 6 * n_bands

    # a warm rerun measures nothing
    again = json.loads(fltune("calibrate", "--model", "tiny-qwen3", "--db", db,
                              "--max-tokens", "32", *FAST, "--json").stdout)
    assert again["measured"] == 0 and again["skipped"] == 6 * n_bands


def test_fingerprint_stable_and_sensitive(calibrated, tmp_path):
    db, _ = calibrated
    m1, _ = build_manifest(db)
    m2, _ = build_manifest(db)
    assert m1["fingerprint"] == m2["fingerprint"]
    copy = tmp_path / "copy.db"
    dst = copy_db(db, copy)
    row = dst.execute("select op, signature, band_hi, impl_id from winners "
                      "where op='silu_and_mul' order by band_hi limit 1").fetchone()
    new = "reference.torch" if row[3] != "reference.torch" else "inductor.standalone"
    dst.execute("update winners set impl_id=? where op=? and signature=? and band_hi=?",
                (new, row[0], row[1], row[2]))
    dst.commit()
    dst.close()
    m3, _ = build_manifest(str(copy))
    assert m3["fingerprint"] != m1["fingerprint"]


def test_frozen_dispatch_runs_each_bands_winner(calibrated):
    db, _ = calibrated
    manifest, _ = build_manifest(db, registry=get_default_manager().registry)
    fd = freeze_dispatch(manifest)
    try:
        entry = manifest["ops"]["silu_and_mul"]["tables"][0]
        spec = get_op("silu_and_mul")
        for b in entry["bands"]:
            for n in {b["lo"], b["hi"]}:
                args = spec.make_inputs(n, entry["dims"], torch.bfloat16, "cpu",
                                        torch.Generator().manual_seed(n))
                assert fd.select("silu_and_mul", *args).impl_id == b["impl_id"]
                r = parity.check(spec, lambda *a: fd.call("silu_and_mul", *a), args,
                                 torch.bfloat16)
                assert r.passed, r
        # beyond the last band: clamped to the last band's winner
        args = spec.make_inputs(100, entry["dims"], torch.bfloat16, "cpu", torch.Generator())
        assert fd.select("silu_and_mul", *args).impl_id == entry["bands"][-1]["impl_id"]
    finally:
        thaw_dispatch()


def test_stack_change_warns_and_strict_refuses(calibrated, tmp_path):
    db, _ = calibrated
    copy = tmp_path / "stack.db"
    dst = copy_db(db, copy)
    for rid, st in dst.execute("select id, stack from runs").fetchall():
        s = json.loads(st)
        s["flag_gems"] = "0.0.1-old"
        dst.execute("update runs set stack=? where id=?", (json.dumps(s), rid))
    dst.commit()
    dst.close()
    p = fltune("freeze", "--db", str(copy), "--out", str(tmp_path / "m.json"))
    assert "software stack changed" in p.stderr and "flag_gems" in p.stderr
    p = fltune("freeze", "--db", str(copy), "--out", str(tmp_path / "m2.json"), "--strict",
               check=False)
    assert p.returncode == 2 and "flag_gems" in p.stderr
    assert not (tmp_path / "m2.json").exists()


def test_kill_and_resume_loses_nothing(tmp_path):
    """SIGKILL a calibrating process mid-run, several times; each rerun resumes. At the end:
    integrity ok, every band measured exactly once, rows written before a kill untouched."""
    db = str(tmp_path / "kill.db")
    args = [sys.executable, "-m", "fltune", "calibrate", "--model", "Qwen3-0.6B", "--db", db,
            "--max-tokens", "64", "--ops", "silu_and_mul,rms_norm,fused_add_rms_norm",
            "--budget", "0.01", "--quiet"]
    kills = 0
    snapshots = []
    for target in (3, 9, 15):
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            try:
                c = sqlite3.connect(db, timeout=5)
                n = c.execute("select count(*) from winners").fetchone()[0]
                c.close()
            except sqlite3.Error:
                n = 0
            if n >= target:
                break
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
        c = sqlite3.connect(db)
        snapshots.append(c.execute("select op, signature, band_hi, impl_id, created, median_us "
                                   "from measurements").fetchall())
        c.close()
    assert kills >= 2
    done = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    c = sqlite3.connect(db)
    assert c.execute("pragma integrity_check").fetchone()[0] == "ok"
    n_items = 4   # rms_norm (hidden, q_norm, k_norm) + fused_add_rms_norm; silu_and_mul
    expected = (n_items + 1) * len(bands(64))
    assert c.execute("select count(*) from winners").fetchone()[0] == expected
    dup = c.execute("select count(*) from (select op, signature, dtype, band_hi, impl_id, "
                    "count(*) copies from measurements group by 1,2,3,4,5 having copies > 1)").fetchone()[0]
    assert dup == 0
    final = set(c.execute("select op, signature, band_hi, impl_id, created, median_us "
                          "from measurements").fetchall())
    for snap in snapshots:
        assert set(snap) <= final          # nothing measured before a kill was lost or redone
    statuses = [r[0] for r in c.execute("select status from runs order by id")]
    assert statuses[-1] == "done" and "running" in statuses[:-1]   # killed runs stay visible


def test_bad_input_errors(tmp_path):
    p = fltune("calibrate", "--model", "No-Such-Model", "--db", str(tmp_path / "x.db"),
               check=False)
    assert p.returncode == 2 and "Qwen3.5-0.8B" in p.stderr and "unknown model" in p.stderr
    assert not (tmp_path / "x.db").exists()          # nothing written before validation
    p = fltune("report", "--db", str(tmp_path / "missing.db"), check=False)
    assert p.returncode == 2 and "does not exist" in p.stderr
    junk = tmp_path / "junk.db"
    junk.write_bytes(os.urandom(4096))
    before = junk.read_bytes()
    p = fltune("calibrate", "--model", "tiny-qwen3", "--db", str(junk), check=False)
    assert p.returncode == 2 and str(junk) in p.stderr
    assert junk.read_bytes() == before


def test_other_device_is_a_clear_miss(calibrated, tmp_path):
    db, _ = calibrated
    copy = tmp_path / "other.db"
    dst = copy_db(db, copy)
    for t in ("devices", "winners", "measurements", "runs"):
        dst.execute(f"update {t} set device_key='feedfacecafebeef'")
    dst.execute("update devices set name='NVIDIA H200'")
    dst.commit()
    dst.close()
    p = fltune("freeze", "--db", str(copy), "--out", str(tmp_path / "m.json"), check=False)
    assert p.returncode == 2 and "no calibration for this device" in p.stderr
    assert "NVIDIA H200" in p.stderr
    p = fltune("report", "--db", str(copy), "--device", "H200")
    assert "NVIDIA H200" in p.stdout
