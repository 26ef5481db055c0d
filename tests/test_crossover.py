"""Crossover refinement (``fltune refine``, ``tune/crossover.py``): the bisection core on
synthetic timing curves (no noise), the schema 1 -> 2 migration on copies of real DBs,
freeze applying refined edges (checked through ``FrozenDispatch.select`` with real
tensors), and the CLI end to end on the CPU. CPU timing is noisy: the end-to-end test
asserts what was stored and frozen, never which candidate was faster."""
from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fltune.store import device as devmod
from fltune.dispatch.frozen import FrozenDispatch
from fltune.freeze import build_manifest
from fltune.ops import get_op
from fltune.store.db import SCHEMA_VERSION, CalibrationDB, _migrate_0_to_1
from fltune.tune import crossover
from fltune.tune.bands import bands
from fltune.tune.crossover import Probe, ProbeFailed, find_edge, oracle_gap, tolerance
from fltune.tune.workload import derive

from conftest import REPO

H200_DB = REPO / "db" / "NVIDIA-H200_driver-580.159.04.db"
H200_REFINED = REPO / "tests" / "fixtures" / "h200-schema2-2026-11-29.db"


# ---- the pure core -----------------------------------------------------------------------

def linear_pair(cross: float):
    """lower is faster below ``cross``, upper above it (straight lines, no noise)."""
    def measure(t):
        return 10.0 + 0.01 * t, 10.0 + 0.01 * cross + 0.005 * (t - cross)
    return measure


@pytest.mark.parametrize("cross", [1025, 1100, 1536, 1700, 2000, 2047])
def test_known_crossover_found_within_tolerance(cross):
    seen = []
    m = linear_pair(cross)
    e = find_edge(1024, 2048, lambda t: seen.append(t) or m(t))
    tol = tolerance(1024, 2048)
    assert tol == 128                                   # 1/8 of the band width
    assert e.converged and e.refined and 1024 <= e.edge < 2048
    assert abs(e.edge - cross) <= tol
    assert [p.tokens for p in e.probes] == seen          # every probe recorded, in order
    assert len(seen) == 3                                # 1024 -> 512 -> 256 -> 128
    for p in e.probes:                                   # faster median wins the probe
        assert p.winner == ("lower" if p.lower_us <= p.upper_us else "upper")


def test_min_tokens_floor_and_narrow_bands():
    # 64..128: width 64, 1/8 is 8 -> the 16-token floor applies: 64 -> 32 -> 16, two probes
    e = find_edge(64, 128, linear_pair(100))
    assert tolerance(64, 128) == 16 and len(e.probes) == 2 and abs(e.edge - 100) <= 16
    # a band already within the tolerance is not probed: the edge stays where it was
    calls = []
    e = find_edge(16, 32, lambda t: calls.append(t))
    assert calls == [] and e.edge == 16 and not e.refined and e.converged
    e = find_edge(1, 2, lambda t: calls.append(t))
    assert calls == [] and e.edge == 1


def test_probe_cap_honoured():
    calls = []
    m = linear_pair(9000)
    e = find_edge(8192, 16384, lambda t: calls.append(t) or m(t), min_tokens=1, frac=0,
                  max_probes=4)
    assert len(calls) == 4 == len(e.probes)
    assert not e.converged and 8192 <= e.edge < 16384
    e = find_edge(8192, 16384, m, max_probes=0)
    assert e.probes == [] and e.edge == 8192 and not e.converged


def test_non_monotone_finds_a_real_sign_change():
    """The upper winner is faster on an island (1100..1300) and again above 1900: bisection
    keeps "lower wins left, upper wins right" and lands on one of the crossings."""
    def upper_wins(t):
        return 1100 <= t <= 1300 or t > 1900

    def measure(t):
        return (2.0, 1.0) if upper_wins(t) else (1.0, 2.0)

    e = find_edge(1024, 2048, measure, min_tokens=1, frac=0, max_probes=20)
    assert e.converged
    crossings = [t for t in range(1024, 2048) if not upper_wins(t) and upper_wins(t + 1)]
    assert e.edge in crossings                      # exact: tolerance 1 token
    # with the default tolerance it is within 128 tokens of one of them
    e = find_edge(1024, 2048, measure)
    assert min(abs(e.edge - c) for c in crossings) <= tolerance(1024, 2048)


def test_probe_objects_decide_and_failures_propagate():
    # a Probe's own winner is used (here: the upper always wins, whatever the times say)
    e = find_edge(512, 1024, lambda t: Probe(t, 1.0, 2.0, "upper"))
    assert all(p.winner == "upper" for p in e.probes) and e.edge < 512 + 64

    def boom(t):
        raise ProbeFailed("parity failed")
    with pytest.raises(ProbeFailed):
        find_edge(512, 1024, boom)
    with pytest.raises(ValueError):
        find_edge(8, 8, boom)


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(1, 20000), width=st.integers(1, 20000), frac=st.floats(0, 1),
       cross=st.floats(0, 1), cap=st.integers(0, 12))
def test_edge_always_inside_the_upper_band(lo, width, frac, cross, cap):
    hi = lo + width
    c = lo + cross * width
    e = find_edge(lo, hi, linear_pair(c), frac=frac, max_probes=cap)
    assert lo <= e.edge < hi and len(e.probes) <= cap
    assert all(lo < p.tokens < hi for p in e.probes)
    if e.converged and e.refined:
        assert abs(e.edge - c) <= e.tolerance + 1


def test_oracle_gap_over_probe_points():
    probes = [{"tokens": 96, "lower_us": 10.0, "upper_us": 8.0},
              {"tokens": 80, "lower_us": 9.0, "upper_us": 10.0}]
    # coarse edge 64: both probes go to upper (8 + 10); refined edge 88: 80 -> lower (9)
    g = oracle_gap(probes, 64, 88, weight=2)
    assert g["before_us"] == 2 * 18 and g["after_us"] == 2 * 17 and g["oracle_us"] == 2 * 17
    assert g["gap_before"] == pytest.approx(18 / 17 - 1) and g["gap_after"] == 0


# ---- schema migration ------------------------------------------------------------------------

def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _counts(path) -> dict:
    con = sqlite3.connect(path)
    try:
        return {t: con.execute(f"select count(*) from {t}").fetchone()[0]
                for t in ("devices", "runs", "measurements", "winners")}
    finally:
        con.close()


def _as_version_1(src, dst):
    """A copy of ``src`` as schema version 1 wrote it: the H200 rows without the two tables
    that version 2 added (the shipped DB is already refined, hence version 2)."""
    shutil.copy(src, dst)
    con = sqlite3.connect(dst)
    try:
        con.execute("drop table if exists crossovers")
        con.execute("drop table if exists refine_runs")
        con.execute("update meta set value='1' where key='schema_version'")
        con.commit()
        con.execute("pragma wal_checkpoint(TRUNCATE)")
    finally:
        con.close()


def test_refined_h200_db_freezes_with_its_edges():
    """The H200 DB as shipped on 2026-11-29 (now a test fixture: the shipped one was
    recalibrated for issue 11, which made its Qwen3.5 crossovers stale) carries the crossovers `calibrate/recipes/h200_refine.sh` measured;
    freezing applies them (and `--order fl` does not)."""
    shipped = _digest(H200_REFINED)
    db = CalibrationDB(H200_REFINED, create=False)
    try:
        assert db.schema_version() == 2
        rows = db.db.execute("select count(*) from crossovers").fetchone()[0]
    finally:
        db.close()
    assert rows >= 1
    m, _ = build_manifest(str(H200_REFINED), device="NVIDIA", check_stack=False)
    refined = [b for e in m["ops"].values() for t in e["tables"] for b in t["bands"]
               if b.get("refined")]
    assert refined and all(b["hi"] != b["coarse_hi"] for b in refined)
    fl, _ = build_manifest(str(H200_REFINED), device="NVIDIA", check_stack=False, order="fl")
    assert not [b for e in fl["ops"].values() for t in e["tables"] for b in t["bands"]
                if b.get("refined")]
    assert _digest(H200_REFINED) == shipped          # readers never write the shipped file


def test_version_1_copy_of_the_h200_db_migrates_and_readers_leave_it_untouched(tmp_path):
    copy = tmp_path / "h200.db"
    _as_version_1(H200_DB, copy)
    v1 = _digest(copy)
    before = _counts(copy)
    # a reader (freeze, report) opens the version-1 DB as it is: no rewrite, no crossovers
    db = CalibrationDB(copy, create=False)
    assert db.schema_version() == 1 and db.crossovers("x", "y") == []
    db.close()
    assert _digest(copy) == v1
    m1, _ = build_manifest(str(copy), device="NVIDIA", check_stack=False)
    assert _digest(copy) == v1
    # a writer migrates it forward: new tables, every row kept
    db = CalibrationDB(copy, create=False, write=True)
    try:
        assert db.schema_version() == SCHEMA_VERSION
        assert {"crossovers", "refine_runs"} <= set(db.db.table_names())
        assert db.db["crossovers"].pks == ["device_key", "driver", "op", "signature", "dtype",
                                           "lower_hi"]
    finally:
        db.close()
    assert _counts(copy) == before
    m2, _ = build_manifest(str(copy), device="NVIDIA", check_stack=False)
    assert m2["ops"] == m1["ops"]               # no crossovers yet: the same tables


def test_version_1_db_built_by_the_old_schema_migrates(tmp_path):
    path = tmp_path / "v1.db"
    con = sqlite3.connect(path)
    con.execute("create table meta (key text primary key, value text)")
    con.execute("insert into meta values ('schema_version', '1')")
    con.commit()
    import sqlite_utils
    _migrate_0_to_1(sqlite_utils.Database(con))
    con.execute("insert into winners (device_key, driver, op, signature, dtype, band_lo, "
                "band_hi, impl_id) values ('k', 'd', 'rms_norm', 's', 'bf16', 1, 1, 'a')")
    con.commit()
    con.close()
    db = CalibrationDB(path)                    # a calibrate-style open: writes, migrates
    try:
        assert db.schema_version() == SCHEMA_VERSION
        assert len(db.winners("k", "d")) == 1
        assert db.crossovers("k", "d") == []
    finally:
        db.close()


# ---- freeze with refined edges ------------------------------------------------------------

Q_NORM = next(i for i in derive("tiny-qwen3").items
              if i.op == "rms_norm" and i.dims_dict.get("rows_per_token") == 4)
LOWER, UPPER = "reference.torch", "reference.torch_fused"


def _synthetic_db(path, *, edge=80, upper_impl=UPPER, xo_stack="s1"):
    """rms_norm q_norm (4 rows per token) on this CPU: LOWER wins bands <= 64, UPPER the
    rest, and a crossover between 64 and 128 at ``edge``."""
    dev = devmod.current("cpu")
    db = CalibrationDB(path)
    db.upsert_device(dev)
    for b in bands(256):
        impl = LOWER if b.hi <= 64 else upper_impl
        db.record_band([], {
            "device_key": dev["device_key"], "driver": dev["driver"], "op": "rms_norm",
            "signature": Q_NORM.signature, "dims": json.dumps(Q_NORM.dims_dict, sort_keys=True),
            "dtype": "bf16", "band_lo": b.lo, "band_hi": b.hi, "impl_id": impl,
            "kind": "reference", "vendor": None, "median_us": 1.0 + b.hi / 100,
            "runner_up": None, "runner_up_us": None, "gap": None, "noise": 0.01,
            "reason": "fastest", "weight": 2, "stack_key": "s1", "run_id": 1})
    db.record_crossover({
        "device_key": dev["device_key"], "driver": dev["driver"], "stack_key": xo_stack,
        "op": "rms_norm", "signature": Q_NORM.signature, "dtype": "bf16", "lower_hi": 64,
        "upper_hi": 128, "impl_below": LOWER, "impl_above": UPPER, "edge_tokens": edge,
        "converged": 1, "probes": [{"tokens": 96, "lower_us": 2.0, "upper_us": 1.0,
                                    "winner": "upper"},
                                   {"tokens": 80, "lower_us": 1.0, "upper_us": 1.1,
                                    "winner": "lower"}],
        "gap_before": 0.1, "gap_after": 0.0, "weight": 2, "run_id": 1})
    db.close()
    return dev


def _table(manifest):
    (t,) = manifest["ops"]["rms_norm"]["tables"]
    return t


def _picks(fd, ns):
    spec = get_op("rms_norm")
    out = {}
    for n in ns:
        args = spec.make_inputs(n, Q_NORM.dims_dict, torch.bfloat16, "cpu",
                                torch.Generator().manual_seed(n))
        assert args[spec.key_arg].shape[0] == 4 * n         # rows, not tokens
        out[n] = fd.select("rms_norm", *args).impl_id
    return out


def test_freeze_applies_a_refined_edge(tmp_path, builtin_registry):
    dev = _synthetic_db(tmp_path / "x.db", edge=80)
    m, _ = build_manifest(str(tmp_path / "x.db"), device=dev["device_key"],
                          registry=builtin_registry, check_stack=False)
    t = _table(m)
    assert t["rows_per_token"] == 4
    low, up = t["bands"]
    assert (low["lo"], low["hi"], low["impl_id"]) == (1, 80, LOWER)
    assert (up["lo"], up["hi"], up["impl_id"]) == (81, 256, UPPER)
    assert low["refined"] is True and low["coarse_hi"] == 64
    assert [p["tokens"] for p in low["crossover_probes"]] == [96, 80]
    assert "refined" not in up
    fd = FrozenDispatch(m, builtin_registry)
    got = _picks(fd, [1, 64, 65, 79, 80, 81, 82, 128, 256, 300])
    assert got == {1: LOWER, 64: LOWER, 65: LOWER, 79: LOWER, 80: LOWER, 81: UPPER,
                   82: UPPER, 128: UPPER, 256: UPPER, 300: UPPER}
    # the same DB frozen in the fixed FL order keeps the coarse edges
    fl, _ = build_manifest(str(tmp_path / "x.db"), device=dev["device_key"],
                           registry=builtin_registry, check_stack=False, order="fl")
    assert [(b["lo"], b["hi"]) for b in _table(fl)["bands"]] == [(1, 64), (65, 256)]
    assert not any(b.get("refined") for b in _table(fl)["bands"])
    assert fl["fingerprint"] != m["fingerprint"]


@pytest.mark.parametrize("kw", [{"upper_impl": "inductor.standalone"},   # winner changed
                                {"xo_stack": "other"},                  # measured elsewhere
                                {"edge": 128}])                          # outside the band
def test_freeze_ignores_a_crossover_that_no_longer_holds(tmp_path, builtin_registry, kw):
    dev = _synthetic_db(tmp_path / "x.db", **kw)
    m, _ = build_manifest(str(tmp_path / "x.db"), device=dev["device_key"],
                          registry=builtin_registry, check_stack=False)
    bs = _table(m)["bands"]
    assert (bs[0]["lo"], bs[0]["hi"]) == (1, 64) and bs[1]["lo"] == 65
    assert not any(b.get("refined") for b in bs)
    fd = FrozenDispatch(m, builtin_registry)
    got = _picks(fd, [64, 65, 80])
    assert got[64] == LOWER and got[65] == got[80] == bs[1]["impl_id"]


# ---- the CLI end to end on the CPU ------------------------------------------------------------

def fltune(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "fltune", *args], capture_output=True, text=True,
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"fltune {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


def test_refine_cli_end_to_end(tmp_path, builtin_registry):
    db = str(tmp_path / "tiny.db")
    fltune("calibrate", "--model", "tiny-qwen3", "--db", db, "--max-tokens", "128",
           "--ops", "silu_and_mul", "--budget", "0.003", "--quiet")
    # make the winners differ between two bands wide enough to probe (64 | 65-128): which
    # candidate is really faster on this CPU is noise; both are timed at every probe
    con = sqlite3.connect(db)
    con.execute("update winners set impl_id=?, kind='reference', vendor=null where band_hi<=64",
                (LOWER,))
    con.execute("update winners set impl_id=?, kind='reference', vendor=null where band_hi>64",
                (UPPER,))
    con.commit()
    con.close()

    p = fltune("refine", "--db", db, "--ops", "silu_and_mul", "--json", "--quiet")
    doc = json.loads(p.stdout)
    assert doc["format"] == "fltune.refine/1"
    (pair,) = doc["pairs"]
    assert (pair["lower_hi"], pair["upper_hi"]) == (64, 128)
    assert (pair["impl_below"], pair["impl_above"]) == (LOWER, UPPER)
    assert pair["status"] == "refined" and pair["old_edge"] == 64
    assert 64 <= pair["new_edge"] < 128 and 1 <= len(pair["probes"]) <= 6
    assert all(64 < pr["tokens"] < 128 and pr["lower_us"] > 0 and pr["upper_us"] > 0
               for pr in pair["probes"])
    s = doc["summary"]
    assert s["pairs"] == 1 and s["status"] == {"refined": 1}
    assert s["gap_after"] is not None and s["gap_before"] is not None

    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    (row,) = con.execute("select * from crossovers").fetchall()
    assert row["edge_tokens"] == pair["new_edge"] and row["impl_below"] == LOWER
    assert json.loads(row["probes"]) == pair["probes"]
    assert con.execute("select value from meta where key='schema_version'").fetchone()[0] == str(
        SCHEMA_VERSION)
    (run,) = con.execute("select * from refine_runs").fetchall()
    assert run["status"] == "done" and row["run_id"] == run["id"]
    con.close()

    out = tmp_path / "m.json"
    fltune("freeze", "--db", db, "--out", str(out))
    m = json.loads(out.read_text())
    (t,) = m["ops"]["silu_and_mul"]["tables"]
    low, up = t["bands"]
    edge = pair["new_edge"]
    assert (low["impl_id"], low["hi"], low["refined"], low["coarse_hi"]) == (LOWER, edge, True, 64)
    assert (up["impl_id"], up["lo"], up["hi"]) == (UPPER, edge + 1, 128)
    fd = FrozenDispatch(m, builtin_registry)
    spec = get_op("silu_and_mul")
    for n, want in ((edge, LOWER), (edge + 1, UPPER)):
        args = spec.make_inputs(n, t["dims"], torch.bfloat16, "cpu", torch.Generator())
        assert fd.select("silu_and_mul", *args).impl_id == want

    # a rerun finds the edge stored and measures nothing; the human table names it
    p = fltune("refine", "--db", db, "--model", "tiny-qwen3", "--no-isolate")
    assert "cached" in p.stdout and "new edge" in p.stdout and str(edge) in p.stdout
    # errors the user fixes: exit 2, one line
    p = fltune("refine", "--db", db, "--ops", "rotary_embedding", check=False)
    assert p.returncode == 2 and "rotary_embedding" in p.stderr
    p = fltune("refine", "--db", str(tmp_path / "missing.db"), check=False)
    assert p.returncode == 2 and "does not exist" in p.stderr
