"""``fltune merge`` (issue 14, item 3): several calibration DBs -> one fleet DB.

Every DB here is a real SQLite file written by the real store code (``CalibrationDB``'s
``start_run`` / ``record_band`` / ``record_probe`` / ``record_crossover`` /
``record_route_decision``), so the merge sees exactly what calibrate, refine and adjudicate
write. The properties (hypothesis over small DBs that share devices, stacks and bands, so
conflicts are common): merging is idempotent, commutative, associative on winners, keeps
every key of every input, and the result passes :func:`check` (SQLite's integrity check and
the cross-table references). Then one conflict case per rule, the refusals (nothing written,
inputs byte-identical, no side files), an older schema migrated in a copy, and the CLI end
to end.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fltune.store import db as dbmod
from fltune.store.db import SCHEMA_VERSION, CalibrationDB, DBError
from fltune.store.merge import (HANDLED, WIN_MARGIN, MergeError, check, content, margin_cell,
                                merge)

REPO = Path(__file__).resolve().parents[1]
H200_V2 = REPO / "tests" / "fixtures" / "h200-schema2-2026-11-29.db"

DEVICES = [
    {"device_key": "cpuAAAA", "device_type": "cpu", "name": "Test CPU A", "capability": "AVX2",
     "sms": 4, "memory_bytes": 8 << 30, "driver": "linux 6.0", "runtime": "torch x"},
    {"device_key": "cudaBBBB", "device_type": "cuda", "name": "Test GPU B", "capability": "9.0",
     "sms": 132, "memory_bytes": 80 << 30, "driver": "580.1", "runtime": "cuda 12"},
]
STACKS = [
    {"torch": "2.8.0", "triton": "3.4.0", "flag_gems": None, "vllm": "0.11.0",
     "fltune": "0.1.0", "python": "3.12.3"},
    {"torch": "2.9.0", "triton": "3.5.0", "flag_gems": None, "vllm": "0.11.0",
     "fltune": "0.1.0", "python": "3.12.3"},
]
IMPLS = ["reference.torch", "inductor.standalone", "vendor.vllm"]
#: 10.0 and 10.02 share a win-margin cell; 10.2 is within 3 % of 10.0 but in the next cell;
#: 10.0 < 10.2 < 10.4 is a chain where each is within 3 % of the next but 10.4 is not of 10.0
#: (the race's pairwise rule would go round in a circle on it: not order-independent)
TIMES = [10.0, 10.02, 10.2, 10.4, 12.0]
ERRORS = [1e-3, 2e-3, 4e-3]


def _skey(i):
    from fltune.store.device import stack_key
    return stack_key(STACKS[i])


def _digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _tree(d) -> dict:
    """Every file under ``d`` with its sha256: what a refused merge must leave as it was."""
    return {str(p.relative_to(d)): _digest(p) for p in sorted(Path(d).rglob("*"))
            if p.is_file()}


class Writer:
    """A DB written through the store's own write calls, one (device, stack) run each."""

    def __init__(self, path):
        self.db = CalibrationDB(path)
        self.runs: dict = {}
        self.refines: dict = {}

    def run(self, dev: int, stack: int) -> int:
        if (dev, stack) not in self.runs:
            d = DEVICES[dev]
            self.db.upsert_device(d)
            rid = self.db.start_run(d, "tiny-qwen3", "bf16", 1, {"margin": WIN_MARGIN},
                                    STACKS[stack], _skey(stack))
            self.db.record_probe({"run_id": rid, "device_key": d["device_key"],
                                  "driver": d["driver"], "phase": "start", "timer": "t",
                                  "median_us": 1.0, "spread": 0.01, "n": 5, "loadavg": 0.1,
                                  "cores": 4, "busy_others": 0.0, "loaded": None})
            self.runs[(dev, stack)] = rid
        return self.runs[(dev, stack)]

    def band(self, dev: int, stack: int, band_hi: int, cands: dict, winner=None) -> dict:
        """One band: ``cands`` impl -> (median µs, rel_error); the winner is the fastest,
        the most precise within the margin (the race's rule), unless given."""
        rid = self.run(dev, stack)
        d = DEVICES[dev]
        base = {"device_key": d["device_key"], "driver": d["driver"], "op": "rms_norm",
                "signature": "eps=1e-06,hidden=64", "dims": "{}", "dtype": "bf16",
                "band_lo": band_hi // 2 + 1, "band_hi": band_hi}
        rows = [{**base, "stack_key": _skey(stack), "tokens": band_hi, "impl_id": impl,
                 "kind": "reference", "vendor": None, "backend": impl.split(".")[0],
                 "outcome": "timed", "reason": None, "parity_score": 1.0, "rel_error": err,
                 "median_us": t, "p10_us": t * 0.99, "p90_us": t * 1.01, "n": 5,
                 "timer": json.dumps({"timer": "cpu-perf_counter"}), "bytes": 128,
                 "run_id": rid} for impl, (t, err) in sorted(cands.items())]
        if winner is None:
            fastest = min(t for t, _ in cands.values())
            winner = min((i for i, (t, _) in cands.items() if t <= fastest * (1 + WIN_MARGIN)),
                         key=lambda i: (cands[i][1], cands[i][0], i))
        t = cands[winner][0]
        w = {**base, "impl_id": winner, "kind": "reference", "vendor": None, "median_us": t,
             "runner_up": None, "runner_up_us": None, "gap": None, "noise": 0.02,
             "reason": "fastest", "weight": 2, "stack_key": _skey(stack), "run_id": rid}
        self.db.record_band(rows, w)
        return w

    def crossover(self, dev: int, stack: int, below: str, above: str, edge: int):
        d = DEVICES[dev]
        if (dev, stack) not in self.refines:
            self.refines[(dev, stack)] = self.db.start_refine(d, {"max_probes": 6},
                                                              STACKS[stack], _skey(stack))
        self.db.record_crossover({
            "device_key": d["device_key"], "driver": d["driver"], "stack_key": _skey(stack),
            "op": "rms_norm", "signature": "eps=1e-06,hidden=64", "dtype": "bf16",
            "lower_hi": 8, "upper_hi": 16, "impl_below": below, "impl_above": above,
            "edge_tokens": edge, "converged": 1, "probes": [edge], "gap_before": 0.1,
            "gap_after": 0.0, "weight": 2, "run_id": self.refines[(dev, stack)]})

    def decision(self, dev: int, stack: int, decision: str):
        d = DEVICES[dev]
        self.db.record_route_decision({
            "device_key": d["device_key"], "driver": d["driver"], "stack_key": _skey(stack),
            "model": "m0", "model_name": "tiny-qwen3", "op": "rms_norm", "decision": decision,
            "reason": f"measured: {decision}", "evidence": {"points": []}, "rule": "r1"})

    def close(self):
        for rid in self.runs.values():
            self.db.finish_run(rid)
        for rid in self.refines.values():
            self.db.finish_refine(rid)
        self.db.close()


def _winner_rows(path) -> dict:
    db = CalibrationDB(path, create=False)
    try:
        return {(r["device_key"], r["band_hi"]): r for d in DEVICES
                for r in db.winners(d["device_key"], d["driver"])}
    finally:
        db.close()


# ---- properties over generated DBs -----------------------------------------------------

BAND = st.tuples(st.integers(0, 1), st.integers(0, 1), st.sampled_from([8, 16]),
                 st.dictionaries(st.sampled_from(IMPLS),
                                 st.tuples(st.sampled_from(TIMES), st.sampled_from(ERRORS)),
                                 min_size=1, max_size=3))
SPEC = st.fixed_dictionaries({
    "bands": st.lists(BAND, max_size=4),
    "crossover": st.none() | st.tuples(st.integers(0, 1), st.integers(0, 1),
                                       st.sampled_from(IMPLS), st.sampled_from(IMPLS),
                                       st.integers(9, 16)),
    "decision": st.none() | st.tuples(st.integers(0, 1), st.integers(0, 1),
                                      st.sampled_from(["route", "native"])),
})


def _build(path, spec) -> Path:
    w = Writer(path)
    for dev, stack, hi, cands in spec["bands"]:
        w.band(dev, stack, hi, cands)
    if spec["crossover"]:
        w.crossover(*spec["crossover"])
    if spec["decision"]:
        w.decision(*spec["decision"])
    w.close()
    return Path(path)


#: the property tests' files on tmpfs where there is one: a merge's time is mostly fsyncs
FAST_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture(autouse=True)
def _fast_tmp(monkeypatch):
    """The merge's own temporary copies on tmpfs too (``tempfile`` picks the directory)."""
    if FAST_DIR:
        monkeypatch.setattr(tempfile, "tempdir", FAST_DIR)


@contextlib.contextmanager
def _dbs(*specs):
    with tempfile.TemporaryDirectory(prefix="merge-test-", dir=FAST_DIR) as d:
        yield Path(d), [_build(Path(d) / f"in{i}.db", s) for i, s in enumerate(specs)]


def _merged(d: Path, name: str, *paths) -> Path:
    out = d / name
    res = merge(list(paths), out)
    assert res.integrity == "ok" and res.checks == [], res.checks
    return out


#: small: each example writes real SQLite files (a merge is ~0.2 s of fsyncs)
PROPERTY = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@PROPERTY
@given(SPEC)
def test_property_idempotent(spec):
    with _dbs(spec) as (d, (a,)):
        before = _digest(a)
        aa = _merged(d, "aa.db", a, a)
        a1 = _merged(d, "a1.db", a)
        assert content(aa) == content(a)
        assert content(a1) == content(a)
        assert check(aa) == ([], "ok")
        assert _digest(a) == before


@PROPERTY
@given(SPEC, SPEC)
def test_property_commutative_and_keeps_every_key(sa, sb):
    with _dbs(sa, sb) as (d, (a, b)):
        ab = _merged(d, "ab.db", a, b)
        ba = _merged(d, "ba.db", b, a)
        assert content(ab) == content(ba)
        # a union: every winner key of either input is in the merge, and each merged
        # winner is one of the inputs' rows (the run it refers to renumbered, nothing else)
        wa, wb, wm = _winner_rows(a), _winner_rows(b), _winner_rows(ab)
        assert set(wm) == set(wa) | set(wb)
        skip = ("run_id",)
        for k, w in wm.items():
            sides = [x[k] for x in (wa, wb) if k in x]
            assert any({c: v for c, v in w.items() if c not in skip}
                       == {c: v for c, v in s.items() if c not in skip} for s in sides)
        # a key the inputs answer differently is listed as a conflict, never silent
        res = merge([a, b], d / "ab2.db")
        listed = {(c["key"]["device_key"], c["key"]["band_hi"]) for c in res.conflicts
                  if c["table"] == "winners"}
        differ = {k for k in set(wa) & set(wb)
                  if {c: v for c, v in wa[k].items() if c not in skip}
                  != {c: v for c, v in wb[k].items() if c not in skip}}
        assert listed == differ


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(SPEC, SPEC, SPEC)
def test_property_associative_on_winners(sa, sb, sc):
    with _dbs(sa, sb, sc) as (d, (a, b, c)):
        left = _merged(d, "ab_c.db", _merged(d, "ab.db", a, b), c)
        right = _merged(d, "a_bc.db", a, _merged(d, "bc.db", b, c))
        assert content(left)["winners"] == content(right)["winners"]
        assert content(left)["winners"] == content(_merged(d, "abc.db", a, b, c))["winners"]


# ---- one conflict case per rule ----------------------------------------------------------

def _one_band(path, stack=0, **cands) -> Path:
    w = Writer(path)
    w.band(0, stack, 8, {k.replace("_", "."): v for k, v in cands.items()})
    w.close()
    return Path(path)


def _winner_conflict(res) -> dict:
    (c,) = [c for c in res.conflicts if c["table"] == "winners"]
    return c


def test_margin_is_the_race_margin():
    from fltune.tune.race import WIN_MARGIN as RACE_MARGIN
    assert WIN_MARGIN == RACE_MARGIN
    assert margin_cell(10.0) == margin_cell(10.02) != margin_cell(10.2)


@pytest.mark.parametrize("newer_first", [False, True])
def test_rule_newer_stack_wins_whatever_the_clock(tmp_path, newer_first):
    """A winner measured on a newer stack (torch 2.9) replaces one from an older stack,
    even a faster one, and even when the older stack's DB was written later."""
    order = [("new.db", 1, {"vendor_vllm": (12.0, 4e-3)}),
             ("old.db", 0, {"reference_torch": (10.0, 1e-3)})]
    if not newer_first:
        order.reverse()
    paths = {n: _one_band(tmp_path / n, s, **c) for n, s, c in order}
    res = merge([paths["old.db"], paths["new.db"]], tmp_path / "out.db")
    c = _winner_conflict(res)
    assert c["rule"] == "newer stack" and "torch 2.8.0 -> 2.9.0" in c["why"]
    assert c["kept"] == [str(paths["new.db"])] and len(c["sides"]) == 2
    (w,) = _winner_rows(tmp_path / "out.db").values()
    assert w["impl_id"] == "vendor.vllm"


def test_rule_faster_beyond_the_margin(tmp_path):
    a = _one_band(tmp_path / "a.db", reference_torch=(12.0, 1e-3))
    b = _one_band(tmp_path / "b.db", vendor_vllm=(10.0, 4e-3))
    for order in ([a, b], [b, a]):
        out = tmp_path / f"out{order[0].stem}.db"
        c = _winner_conflict(merge(order, out))
        assert c["rule"] == "faster" and c["kept"] == [str(b)]
        assert _winner_rows(out)[("cpuAAAA", 8)]["impl_id"] == "vendor.vllm"


def test_rule_precision_within_the_margin(tmp_path):
    """Same stack, 10.0 vs 10.02 µs (one margin cell): the more precise wins, though slower
    and though written first."""
    precise = _one_band(tmp_path / "precise.db", vendor_vllm=(10.02, 1e-3))
    fast = _one_band(tmp_path / "fast.db", reference_torch=(10.0, 4e-3))
    c = _winner_conflict(merge([fast, precise], tmp_path / "out.db"))
    assert c["rule"] == "precision" and c["kept"] == [str(precise)]
    assert "rel err 0.001 vs 0.004" in c["why"]
    assert _winner_rows(tmp_path / "out.db")[("cpuAAAA", 8)]["impl_id"] == "vendor.vllm"


def test_rule_margin_grid_edge_goes_to_the_faster(tmp_path):
    """The documented difference from the race: 10.0 vs 10.2 µs is within 3 %, but the two
    lie in different cells of the margin grid, so the faster wins (the race's pairwise
    margin is not transitive, so it cannot be order-independent)."""
    precise = _one_band(tmp_path / "precise.db", vendor_vllm=(10.2, 1e-3))
    fast = _one_band(tmp_path / "fast.db", reference_torch=(10.0, 4e-3))
    c = _winner_conflict(merge([precise, fast], tmp_path / "out.db"))
    assert c["rule"] == "faster" and c["kept"] == [str(fast)]


def test_rule_newer_when_equal_precision(tmp_path):
    """Same stack, same margin cell, equal precision: the re-timed (newer) row wins; the
    same candidate re-timed is a conflict too, listed."""
    old = _one_band(tmp_path / "old.db", reference_torch=(10.0, 2e-3))
    new = _one_band(tmp_path / "new.db", reference_torch=(10.01, 2e-3))
    c = _winner_conflict(merge([new, old], tmp_path / "out.db"))
    assert c["rule"] == "newer" and c["kept"] == [str(new)]
    assert _winner_rows(tmp_path / "out.db")[("cpuAAAA", 8)]["median_us"] == 10.01


def test_measurements_follow_their_winner_and_lose_no_candidate(tmp_path):
    """The band's rows written with the kept winner win; a candidate only the other copy
    measured is kept; the winner's own row is its (so the DB stays consistent)."""
    a = _one_band(tmp_path / "a.db", reference_torch=(10.0, 4e-3), inductor_standalone=(30.0, 1e-3))
    b = _one_band(tmp_path / "b.db", vendor_vllm=(10.02, 1e-3), reference_torch=(10.5, 4e-3))
    res = merge([b, a], tmp_path / "out.db")
    (mc,) = [c for c in res.conflicts if c["table"] == "measurements"]
    assert mc["rule"] == "with the winner" and mc["kept"] == [str(b)]
    db = CalibrationDB(tmp_path / "out.db", create=False)
    try:
        got = {m["impl_id"]: m["median_us"] for m in db.measurements("cpuAAAA", "linux 6.0")}
    finally:
        db.close()
    assert got == {"vendor.vllm": 10.02, "reference.torch": 10.5, "inductor.standalone": 30.0}
    assert res.rows["measurements"] == {"in": 4, "out": 3}


def test_route_decisions_crossovers_and_devices(tmp_path):
    wa, wb = Writer(tmp_path / "a.db"), Writer(tmp_path / "b.db")
    for w, decision, edge in ((wa, "native", 10), (wb, "route", 12)):
        w.band(0, 0, 8, {"reference.torch": (10.0, 1e-3)})
        w.band(0, 0, 16, {"vendor.vllm": (20.0, 1e-3)})
        w.crossover(0, 0, "reference.torch", "vendor.vllm", edge)
        w.decision(0, 0, decision)
        w.close()
    res = merge([tmp_path / "b.db", tmp_path / "a.db"], tmp_path / "out.db")
    by = {c["table"]: c for c in res.conflicts}
    assert by["route_decisions"]["rule"] == "newer"
    assert by["crossovers"]["rule"] == "newer"
    db = CalibrationDB(tmp_path / "out.db", create=False)
    try:
        (rd,) = db.route_decisions("cpuAAAA", "linux 6.0")
        (cx,) = db.crossovers("cpuAAAA", "linux 6.0")
        assert len(db.devices()) == 1 and len(db.runs()) == 2
    finally:
        db.close()
    assert rd["decision"] == "route" and cx["edge_tokens"] == 12


def test_a_copy_taken_mid_run_is_one_run(tmp_path):
    """A DB copied while its run was still going and the finished DB: one run, the finished
    one, listed; the run's rows are not doubled."""
    w = Writer(tmp_path / "live.db")
    w.band(0, 0, 8, {"reference.torch": (10.0, 1e-3)})
    src, dst = sqlite3.connect(tmp_path / "live.db"), sqlite3.connect(tmp_path / "snap.db")
    src.backup(dst)
    src.close()
    dst.close()
    w.close()
    res = merge([tmp_path / "snap.db", tmp_path / "live.db"], tmp_path / "out.db")
    (c,) = res.conflicts
    assert c["table"] == "runs" and c["rule"] == "finished run"
    assert res.rows["runs"]["out"] == 1 and res.rows["measurements"]["out"] == 1
    assert res.rows["noise_probes"]["out"] == 1
    db = CalibrationDB(tmp_path / "out.db", create=False)
    try:
        (run,) = db.runs()
    finally:
        db.close()
    assert run["status"] == "done"


def test_disjoint_devices_union_without_conflict(tmp_path):
    wa, wb = Writer(tmp_path / "a.db"), Writer(tmp_path / "b.db")
    wa.band(0, 0, 8, {"reference.torch": (10.0, 1e-3)})
    wb.band(1, 0, 8, {"vendor.vllm": (2.0, 1e-3)})
    wa.close()
    wb.close()
    res = merge([tmp_path / "a.db", tmp_path / "b.db"], tmp_path / "out.db")
    assert res.conflicts == [] and res.rows["winners"] == {"in": 2, "out": 2}
    db = CalibrationDB(tmp_path / "out.db", create=False)
    try:
        assert {d["device_key"] for d in db.devices()} == {"cpuAAAA", "cudaBBBB"}
        # each winner still points at its own run (ids renumbered across the inputs)
        for d in DEVICES:
            (w,) = db.winners(d["device_key"], d["driver"])
            (run,) = [r for r in db.runs() if r["id"] == w["run_id"]]
            assert run["device_key"] == d["device_key"]
    finally:
        db.close()


# ---- an older schema: migrated in a copy, the input untouched ---------------------------

def test_older_schema_input_migrated_in_a_copy(tmp_path):
    """The shipped H200 DB of schema 2 (``reference.inductor`` named as before version 4):
    merged, its rows are all there with the current names, and its bytes are unchanged."""
    v2 = tmp_path / "h200.db"
    shutil.copyfile(H200_V2, v2)
    before = _tree(tmp_path)
    res = merge([v2], tmp_path / "out.db")
    assert _tree(tmp_path) == {**before, "out.db": _digest(tmp_path / "out.db")}
    (doc,) = res.inputs
    assert doc["schema_version"] == 2 and doc["migrated"]
    con = sqlite3.connect(v2)
    try:
        n = {t: con.execute(f"select count(*) from {t}").fetchone()[0]
             for t in ("measurements", "winners", "crossovers", "runs")}
        old_ids = con.execute("select count(*) from measurements where impl_id = "
                              "'reference.inductor'").fetchone()[0]
    finally:
        con.close()
    assert all(res.rows[t]["out"] == n[t] for t in n) and n["winners"] > 0
    out = CalibrationDB(tmp_path / "out.db", create=False)
    try:
        assert out.schema_version() == SCHEMA_VERSION
        assert out.db.execute("select count(*) from measurements where impl_id = "
                              "'inductor.standalone'").fetchone()[0] >= old_ids > 0
    finally:
        out.close()
    assert check(tmp_path / "out.db") == ([], "ok")


def test_freeze_of_a_merged_device_is_the_freeze_of_its_own_db(tmp_path):
    """The H200 DB merged with another device's DB freezes, for the H200, to the same
    manifest as the H200 DB alone: the same ops, bands, picks, stack and policy (only the
    source path, and so the fingerprint, differ)."""
    from fltune.freeze import build_manifest
    other = Writer(tmp_path / "cpu.db")
    other.band(0, 0, 8, {"reference.torch": (10.0, 1e-3)})
    other.close()
    out = tmp_path / "fleet.db"
    merge([H200_V2, tmp_path / "cpu.db"], out)
    db = CalibrationDB(H200_V2, create=False)
    try:
        (dev,) = db.devices()
    finally:
        db.close()
    alone, _ = build_manifest(str(H200_V2), device=dev["device_key"], check_stack=False)
    fleet, _ = build_manifest(str(out), device=dev["device_key"], check_stack=False)
    differ = {k for k in alone if alone[k] != fleet[k]}
    assert differ == {"source_db", "fingerprint"} and alone["ops"]
    assert alone["source_db"]["runs"] == fleet["source_db"]["runs"]


# ---- refusals: a clear message, nothing written, inputs unchanged -----------------------

def _good(tmp_path) -> Path:
    return _one_band(tmp_path / "good.db", reference_torch=(10.0, 1e-3))


def _bad_inputs(tmp_path) -> dict:
    d = tmp_path
    (d / "rand.db").write_bytes(os.urandom(4096))
    (d / "notes.db").write_text("not a database\n" * 100)
    (d / "empty.db").write_bytes(b"")
    con = sqlite3.connect(d / "foreign.db")
    con.execute("create table users (id integer primary key, name text)")
    con.execute("insert into users (name) values ('ada')")
    con.commit()
    con.close()
    _one_band(d / "newer.db", reference_torch=(10.0, 1e-3))
    con = sqlite3.connect(d / "newer.db")
    con.execute("update meta set value='99' where key='schema_version'")
    con.commit()
    con.close()
    _one_band(d / "table.db", reference_torch=(10.0, 1e-3))
    con = sqlite3.connect(d / "table.db")
    con.execute("create table engine_verdicts (device_key text, verdict text)")
    con.execute("insert into engine_verdicts values ('cpuAAAA', 'x')")
    con.commit()
    con.close()
    _one_band(d / "column.db", reference_torch=(10.0, 1e-3))
    con = sqlite3.connect(d / "column.db")
    con.execute("alter table winners add column confidence real")
    con.execute("update winners set confidence = 0.9")
    con.commit()
    con.close()
    (d / "adir").mkdir()
    return {"rand.db": "no SQLite header", "notes.db": "no SQLite header",
            "empty.db": "is empty (0 bytes)", "foreign.db": "not an fltune calibration DB",
            "newer.db": "schema version 99", "table.db": "'engine_verdicts'",
            "column.db": "winners.confidence", "adir": "is a directory",
            "missing.db": "does not exist"}


def test_bad_inputs_refused_nothing_written(tmp_path):
    good = _good(tmp_path)
    cases = _bad_inputs(tmp_path)
    for name, match in cases.items():
        before = _tree(tmp_path)
        out = tmp_path / "out.db"
        with pytest.raises(MergeError) as e:
            merge([good, tmp_path / name], out)
        msg = str(e.value)
        assert match in msg and name in msg, msg
        assert "leave it out" in msg or "upgrade" in msg.lower() or "name an" in msg \
            or "file" in msg, msg      # a way out
        assert isinstance(e.value, DBError)       # the CLI's one-line exit 2
        assert _tree(tmp_path) == before, f"{name}: files changed"
        assert not out.exists()


def test_output_is_an_input_or_exists(tmp_path):
    good = _good(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(MergeError, match="is also an input"):
        merge([good], good)
    link = tmp_path / "link.db"
    os.symlink(good, link)
    with pytest.raises(MergeError, match="is also an input"):
        merge([link], good)
    other = tmp_path / "other.db"
    other.write_bytes(b"keep me")
    with pytest.raises(MergeError, match="exists"):
        merge([good], other)
    assert other.read_bytes() == b"keep me"
    with pytest.raises(MergeError, match="no input"):
        merge([], tmp_path / "x.db")
    os.unlink(link)
    os.unlink(other)
    assert _tree(tmp_path) == before


def test_a_schema_table_merge_does_not_handle_is_refused(tmp_path, monkeypatch):
    """A table of this fltune's own schema that merge was not taught (a newer version adds
    one): refused by name when it holds data, never dropped."""
    import fltune.store.merge as mergemod
    if "engine_picks" not in CalibrationDB(tmp_path / "probe.db").db.table_names():
        pytest.skip("this schema has no engine_picks table")
    monkeypatch.setattr(mergemod, "HANDLED", tuple(t for t in HANDLED if t != "engine_picks"))
    good = _good(tmp_path)
    db = CalibrationDB(good)
    db.record_engine_picks([{"device_key": "cpuAAAA", "driver": "linux 6.0", "model": "m0",
                             "choice": "attention_backend", "model_name": "tiny",
                             "decision": "pick", "value": "FLASH_ATTN", "reason": "r",
                             "evidence": {}, "rule": "r1", "vllm": "0.11",
                             "stack_key": _skey(0)}])
    db.close()
    with pytest.raises(MergeError, match="'engine_picks'.*Upgrade fltune"):
        merge([good], tmp_path / "out.db")
    assert not (tmp_path / "out.db").exists()


def test_engine_picks_merged_when_the_schema_has_them(tmp_path):
    if not hasattr(CalibrationDB, "record_engine_picks"):
        pytest.skip("this schema has no engine_picks table")
    paths = []
    for name, value in (("a.db", "FLASH_ATTN"), ("b.db", "FLASHINFER")):
        p = _one_band(tmp_path / name, reference_torch=(10.0, 1e-3))
        db = CalibrationDB(p)
        db.record_engine_picks([{"device_key": "cpuAAAA", "driver": "linux 6.0",
                                 "model": "m0", "choice": "attention_backend",
                                 "model_name": "tiny", "decision": "pick", "value": value,
                                 "reason": "r", "evidence": {}, "rule": "r1", "vllm": "0.11",
                                 "stack_key": _skey(0)}])
        db.close()
        paths.append(p)
    res = merge(list(reversed(paths)), tmp_path / "out.db")
    (c,) = [c for c in res.conflicts if c["table"] == "engine_picks"]
    assert c["rule"] == "newer" and c["kept"] == [str(paths[1])]
    db = CalibrationDB(tmp_path / "out.db", create=False)
    try:
        (p,) = db.engine_picks("cpuAAAA", "linux 6.0")
    finally:
        db.close()
    assert p["value"] == "FLASHINFER"


def test_every_schema_table_is_handled(tmp_path):
    """The schema this fltune writes has no table merge does not know (when a migration adds
    one, this fails until merge.py handles it)."""
    db = CalibrationDB(tmp_path / "s.db")
    try:
        tables = set(db.db.table_names())
    finally:
        db.close()
    assert tables <= set(HANDLED), sorted(tables - set(HANDLED))
    assert dbmod.SCHEMA_VERSION == SCHEMA_VERSION


def test_input_with_a_wal_is_read_with_its_wal_and_untouched(tmp_path):
    """An input still held open by a writer (its rows in the WAL, not yet in the main
    file): the merge sees them, and the input's files are byte-identical afterwards."""
    w = Writer(tmp_path / "live.db")
    w.band(0, 0, 8, {"reference.torch": (10.0, 1e-3)})       # committed, in the WAL
    assert os.path.exists(tmp_path / "live.db-wal")
    # the -shm file is SQLite's shared-memory index, where every reader (sqlite3 on the
    # command line too) leaves its read mark: not data, so not compared
    before = {k: v for k, v in _tree(tmp_path).items() if not k.endswith("-shm")}
    res = merge([tmp_path / "live.db"], tmp_path / "out.db")
    after = {k: v for k, v in _tree(tmp_path).items() if not k.endswith("-shm")}
    after.pop("out.db")
    assert after == before and "live.db-wal" in after
    assert res.rows["winners"]["out"] == 1
    w.close()


# ---- the CLI end to end -----------------------------------------------------------------

def _fltune(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fltune", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_cli_merge_json_and_tables(tmp_path):
    """A real ``python -m fltune merge ... --json`` process; then the tables in process."""
    from fltune.cli.main import main
    _one_band(tmp_path / "a.db", reference_torch=(10.0, 4e-3))
    _one_band(tmp_path / "b.db", vendor_vllm=(10.02, 1e-3))
    p = _fltune("merge", "a.db", "b.db", "-o", "fleet.db", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["out"] == "fleet.db" and doc["integrity"] == "ok"
    assert doc["summary"]["rules"] == {"precision": 1, "with the winner": 1}
    (c,) = [c for c in doc["conflicts"] if c["table"] == "winners"]
    assert c["kept"] == ["b.db"] and {s["row"]["impl_id"] for s in c["sides"]} == {
        "reference.torch", "vendor.vllm"}
    assert check(tmp_path / "fleet.db") == ([], "ok")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["merge", str(tmp_path / "a.db"), str(tmp_path / "b.db"), "-o",
                     str(tmp_path / "fleet2.db")]) == 0
    assert "precision" in out.getvalue() and "integrity ok" in out.getvalue()


def test_cli_merge_errors_are_one_line(tmp_path, monkeypatch):
    from fltune.cli.main import main
    _one_band(tmp_path / "a.db", reference_torch=(10.0, 1e-3))
    (tmp_path / "rand.db").write_bytes(os.urandom(2048))
    before = _tree(tmp_path)
    p = _fltune("merge", "a.db", "rand.db", "-o", "out.db", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        "fltune: error: rand.db is not a usable SQLite calibration DB (no SQLite header). It "
        "was left untouched; leave it out of the merge"]
    monkeypatch.chdir(tmp_path)
    for args, match in ((["a.db", "-o", "a.db"], "also an input"),
                        (["a.db", "-o", "nodir/out.db"], "does not exist"),
                        (["-o", "out.db"], "required")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(["merge", *args])
            except SystemExit as e:       # argparse refuses before the command runs
                rc = e.code
        assert rc == 2, (args, err.getvalue())
        last = err.getvalue().strip().splitlines()[-1]
        assert "error:" in last and match in last, err.getvalue()
        assert _tree(tmp_path) == before
