"""The calibration DB: schema and version, WAL and busy timeout, one transaction per
(op, band), upserts that never duplicate, and files that are not ours left untouched."""
from __future__ import annotations

import gc
import os
import sqlite3

import pytest

from fltune.store import device as devmod
from fltune.store.db import (BUSY_TIMEOUT_MS, SCHEMA_VERSION, CalibrationDB, DBError,
                             MEASUREMENT_KEY, WINNER_KEY)
from conftest import file_digest

DEVICE = {"device_key": "cpu0123456789abc", "device_type": "cpu", "name": "Test CPU",
          "capability": "AVX2", "sms": 2, "memory_bytes": 8 << 30, "driver": "linux 6.0",
          "runtime": "torch x"}
TABLES = {"meta", "devices", "runs", "measurements", "winners", "crossovers", "refine_runs",
          "noise_probes"}


def _measurement(impl_id, median=10.0, band_hi=8, outcome="timed", **kw):
    row = {"device_key": DEVICE["device_key"], "driver": DEVICE["driver"], "stack_key": "s1",
           "op": "rms_norm", "signature": "eps=1e-06,hidden=1024", "dims": "{}",
           "dtype": "bf16", "band_lo": band_hi // 2 + 1, "band_hi": band_hi, "tokens": band_hi,
           "impl_id": impl_id, "kind": "reference", "vendor": None, "backend": "t",
           "outcome": outcome, "reason": None, "parity_score": 1.0, "rel_error": 1e-3,
           "median_us": median, "p10_us": median, "p90_us": median, "n": 5,
           "timer": "{}", "bytes": 100, "run_id": 1}
    row.update(kw)
    return row


def _winner(impl_id, median=10.0, band_hi=8, **kw):
    row = {"device_key": DEVICE["device_key"], "driver": DEVICE["driver"], "op": "rms_norm",
           "signature": "eps=1e-06,hidden=1024", "dims": "{}", "dtype": "bf16",
           "band_lo": band_hi // 2 + 1, "band_hi": band_hi, "impl_id": impl_id,
           "kind": "reference", "vendor": None, "median_us": median, "runner_up": None,
           "runner_up_us": None, "gap": None, "noise": 0.1, "reason": "fastest", "weight": 3,
           "stack_key": "s1", "run_id": 1}
    row.update(kw)
    return row


def _count(path, table) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute(f"select count(*) from {table}").fetchone()[0]
    finally:
        con.close()


def test_new_db_schema_version_wal_and_busy_timeout(tmp_db_path):
    assert not tmp_db_path.parent.exists()
    db = CalibrationDB(tmp_db_path)                   # creates parent dirs too
    try:
        assert TABLES <= set(db.db.table_names())
        assert db.schema_version() == SCHEMA_VERSION == 6
        assert db.db.execute("PRAGMA busy_timeout").fetchone()[0] == BUSY_TIMEOUT_MS
        assert db.db["measurements"].pks == MEASUREMENT_KEY
        assert db.db["winners"].pks == WINNER_KEY
        assert db.integrity_check() == "ok"
    finally:
        db.close()
    con = sqlite3.connect(tmp_db_path)                # WAL is a property of the file
    try:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert con.execute("select value from meta where key='schema_version'"
                           ).fetchone()[0] == str(SCHEMA_VERSION)
    finally:
        con.close()


def test_reopen_keeps_data_and_version(tmp_db_path):
    db = CalibrationDB(tmp_db_path)
    db.upsert_device(DEVICE)
    db.record_band([_measurement("a")], _winner("a"))
    db.close()
    db = CalibrationDB(tmp_db_path, create=False)
    try:
        assert db.schema_version() == SCHEMA_VERSION
        assert len(db.measurements(DEVICE["device_key"], DEVICE["driver"])) == 1
        assert db.devices()[0]["winners"] == 1
    finally:
        db.close()


def test_record_band_writes_measurements_and_winner(tmp_db_path):
    db = CalibrationDB(tmp_db_path)
    try:
        rows = [_measurement("a", 10.0), _measurement("b", 12.0),
                _measurement("c", None, outcome="parity_failed", parity_score=0.5,
                             reason="parity 0.5000 below floor 0.99", median_us=None),
                _measurement("d", None, outcome="unqualified", reason="needs a GPU",
                             parity_score=None, median_us=None)]
        db.record_band(rows, _winner("a", runner_up="b", runner_up_us=12.0, gap=0.2))
        got = {r["impl_id"]: r for r in db.measurements(DEVICE["device_key"], DEVICE["driver"])}
        assert set(got) == {"a", "b", "c", "d"}
        assert got["c"]["outcome"] == "parity_failed" and got["c"]["parity_score"] == 0.5
        assert got["d"]["reason"] == "needs a GPU"
        assert all(r["created"] for r in got.values())
        (w,) = db.winners(DEVICE["device_key"], DEVICE["driver"])
        assert w["impl_id"] == "a" and w["runner_up"] == "b" and w["gap"] == 0.2
        assert db.has_band(DEVICE["device_key"], DEVICE["driver"], "s1", "rms_norm",
                           "eps=1e-06,hidden=1024", "bf16", 8)
        assert not db.has_band(DEVICE["device_key"], DEVICE["driver"], "s2", "rms_norm",
                               "eps=1e-06,hidden=1024", "bf16", 8)
        assert not db.has_band(DEVICE["device_key"], DEVICE["driver"], "s1", "rms_norm",
                               "eps=1e-06,hidden=1024", "bf16", 16)
        db.record_band([_measurement("z", outcome="refused", reason="raised")], None)
        assert len(db.winners(DEVICE["device_key"], DEVICE["driver"])) == 1
    finally:
        db.close()


def test_record_band_is_one_transaction(tmp_db_path):
    """A failure anywhere in the (op, band) write leaves nothing of it behind."""
    db = CalibrationDB(tmp_db_path)
    try:
        bad_row = _measurement("b", no_such_column=1)
        with pytest.raises(sqlite3.Error):
            db.record_band([_measurement("a"), bad_row], _winner("a"))
        with pytest.raises(sqlite3.Error):
            db.record_band([_measurement("a")], _winner("a", no_such_column=1))
        assert not db.db.conn.in_transaction
    finally:
        db.close()
    assert _count(tmp_db_path, "measurements") == 0
    assert _count(tmp_db_path, "winners") == 0


def test_committed_band_is_visible_to_another_connection(tmp_db_path):
    db = CalibrationDB(tmp_db_path)
    try:
        db.record_band([_measurement("a")], _winner("a"))
        # no close(): a killed process would not close either
        assert _count(tmp_db_path, "measurements") == 1
        assert _count(tmp_db_path, "winners") == 1
    finally:
        db.close()


def test_upsert_does_not_duplicate(tmp_db_path):
    db = CalibrationDB(tmp_db_path)
    try:
        for median in (10.0, 7.0):
            db.record_band([_measurement("a", median), _measurement("b", 20.0)],
                           _winner("a", median))
            db.upsert_device(DEVICE)
        m = db.measurements(DEVICE["device_key"], DEVICE["driver"])
        assert len(m) == 2 and {r["impl_id"]: r["median_us"] for r in m}["a"] == 7.0
        (w,) = db.winners(DEVICE["device_key"], DEVICE["driver"])
        assert w["median_us"] == 7.0
        # a different winner for the same band replaces it (winners are unique per band)
        db.record_band([_measurement("b", 5.0)], _winner("b", 5.0))
        (w,) = db.winners(DEVICE["device_key"], DEVICE["driver"])
        assert w["impl_id"] == "b"
        # another band, dtype or stack is a different row
        db.record_band([_measurement("a", band_hi=16)], _winner("a", band_hi=16))
        db.record_band([_measurement("a", dtype="fp16")], None)
        db.record_band([_measurement("a", stack_key="s2")], None)
        assert len(db.measurements(DEVICE["device_key"], DEVICE["driver"])) == 5
        assert len(db.winners(DEVICE["device_key"], DEVICE["driver"])) == 2
        assert len(db.devices()) == 1
    finally:
        db.close()


def test_runs_and_devices(tmp_db_path):
    db = CalibrationDB(tmp_db_path)
    try:
        dev = devmod.current("cpu")
        db.upsert_device(dev)
        stack = devmod.stack()
        rid = db.start_run(dev, "tiny-qwen3", "bf16", 1, {"margin": 0.03}, stack,
                           devmod.stack_key(stack))
        (run,) = db.runs()
        assert run["id"] == rid and run["status"] == "running" and run["pid"] == os.getpid()
        db.finish_run(rid, "done")
        (run,) = db.runs(dev["device_key"])
        assert run["status"] == "done" and run["finished"] >= run["started"]
        (d,) = db.devices()
        assert d["device_key"] == dev["device_key"] and d["name"] == dev["name"]
        assert db.device(dev["device_key"], dev["driver"])["sms"] == dev["sms"]
        assert db.device("nope") is None
    finally:
        db.close()


# ---- files that are not a usable fltune DB ---------------------------------------------

def _assert_refused_untouched(path, match):
    before = file_digest(path)
    listing = sorted(os.listdir(os.path.dirname(path)))
    with pytest.raises(DBError) as e:
        CalibrationDB(path)
    assert str(path) in str(e.value)
    assert match in str(e.value)
    del e
    gc.collect()     # the refused connection is not closed explicitly; its finalizer does it
    assert file_digest(path) == before, "the file's bytes changed"
    assert sorted(os.listdir(os.path.dirname(path))) == listing, "side files were left behind"


def test_random_bytes_refused_untouched(tmp_path):
    path = tmp_path / "noise.db"
    path.write_bytes(os.urandom(8192))
    _assert_refused_untouched(path, "not a usable SQLite calibration DB")


def test_text_file_refused_untouched(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("this is not a database\n" * 200)
    _assert_refused_untouched(path, "not a usable SQLite calibration DB")


def test_foreign_sqlite_db_refused_untouched(tmp_path):
    path = tmp_path / "other.db"
    con = sqlite3.connect(path)
    con.execute("create table users (id integer primary key, name text)")
    con.execute("insert into users (name) values ('ada')")
    con.commit()
    con.close()
    _assert_refused_untouched(path, "not an fltune calibration DB")


def _newer_db(path, wal: bool):
    if wal:                     # written by a (future) fltune: WAL, full schema
        CalibrationDB(path).close()
        con = sqlite3.connect(path)
    else:                       # a minimal DB in SQLite's default rollback-journal mode
        con = sqlite3.connect(path)
        con.execute("create table meta (key text primary key, value text)")
    con.execute("insert or replace into meta (key, value) values ('schema_version', '99')")
    con.commit()
    con.close()
    for side in ("-wal", "-shm"):
        assert not os.path.exists(str(path) + side)


def test_newer_schema_refused_with_version(tmp_path):
    path = tmp_path / "future.db"
    _newer_db(path, wal=True)
    _assert_refused_untouched(path, "schema version 99")


def test_newer_schema_rollback_journal_db_untouched(tmp_path):
    path = tmp_path / "future_rj.db"
    _newer_db(path, wal=False)
    _assert_refused_untouched(path, "schema version 99")


def test_foreign_db_with_meta_table_refused_untouched(tmp_path):
    path = tmp_path / "app.db"
    con = sqlite3.connect(path)
    con.execute("create table meta (name text, data blob)")
    con.execute("insert into meta values ('version', x'00')")
    con.commit()
    con.close()
    _assert_refused_untouched(path, "not an fltune calibration DB")


def test_missing_file_with_create_false(tmp_path):
    path = tmp_path / "missing.db"
    with pytest.raises(DBError, match="missing.db does not exist"):
        CalibrationDB(path, create=False)
    assert not path.exists()


def test_directory_refused(tmp_path):
    with pytest.raises(DBError, match="is a directory"):
        CalibrationDB(tmp_path)


def test_has_band_counts_a_band_only_under_the_timing_switches_asked_for(tmp_db_path):
    """A band timed with its weight hot is not the band a ``--cold-weights`` run asks for:
    with a regime, ``has_band`` counts only measurements of a run with the same switches (a
    switch a run did not record was off); without one, any measurement counts, as before."""
    db = CalibrationDB(tmp_db_path)
    try:
        db.upsert_device(DEVICE)
        hot = db.start_run(DEVICE, "m", "bf16", 1, {"cold_l2": False}, {}, "s1")
        cold = db.start_run(DEVICE, "m", "bf16", 1, {"cold_l2": False, "cold_weights": True},
                            {}, "s1")
        db.record_band([_measurement("a", band_hi=8, run_id=hot)], _winner("a", band_hi=8))
        db.record_band([_measurement("a", band_hi=16, run_id=cold)], _winner("a", band_hi=16))
        key = (DEVICE["device_key"], DEVICE["driver"], "s1", "rms_norm",
               "eps=1e-06,hidden=1024", "bf16")
        assert db.has_band(*key, 8) and db.has_band(*key, 16)
        assert db.has_band(*key, 8, {"cold_weights": False})
        assert not db.has_band(*key, 8, {"cold_weights": True})
        assert db.has_band(*key, 16, {"cold_weights": True})
        assert not db.has_band(*key, 16, {"cold_weights": False})
        assert db.has_band(*key, 16, {"cold_weights": True, "cold_l2": False})
        assert not db.has_band(*key, 16, {"cold_l2": True})
        assert not db.has_band(*key, 32, {})           # never measured
    finally:
        db.close()


def test_has_band_counts_a_band_only_for_the_context_it_was_raced_for(tmp_db_path):
    """Context dims are not in the signature, but native.vllm compiles per context: a band
    raced without ``after_qk_norm`` (another model, or an older fltune) is raced again for
    a Qwen3 rope, and the other way round; absent, None and False read alike."""
    import time as _time

    db = CalibrationDB(tmp_db_path)
    try:
        db.upsert_device(DEVICE)
        run = db.start_run(DEVICE, "m", "bf16", 1, {}, {}, "s1")
        key = (DEVICE["device_key"], DEVICE["driver"], "s1", "rms_norm",
               "eps=1e-06,hidden=1024", "bf16")
        db.record_band([_measurement("a", run_id=run)], _winner("a"))     # dims "{}"
        assert db.has_band(*key, 8, None, {"after_qk_norm": None})
        assert db.has_band(*key, 8, None, {"after_qk_norm": False})
        assert not db.has_band(*key, 8, None, {"after_qk_norm": True})
        _time.sleep(0.01)
        db.record_band([_measurement("a", run_id=run, dims='{"after_qk_norm": true}')],
                       _winner("a"))
        assert db.has_band(*key, 8, None, {"after_qk_norm": True})
        assert not db.has_band(*key, 8, {}, {"after_qk_norm": None})
        assert db.has_band(*key, 8)                    # no context asked: any race counts
    finally:
        db.close()


def test_has_band_reads_the_last_race_of_a_band_and_survives_odd_settings(tmp_db_path):
    """Rows are kept per candidate, so a band can hold a candidate's row from an older run
    (it left the field) beside the newer race's: the regime is the last race's. A run whose
    settings are not a JSON object (a hand-edited or foreign row) had every switch off."""
    import time as _time

    db = CalibrationDB(tmp_db_path)
    try:
        db.upsert_device(DEVICE)
        hot = db.start_run(DEVICE, "m", "bf16", 1, {"cold_l2": False}, {}, "s1")
        cold = db.start_run(DEVICE, "m", "bf16", 1, {"cold_l2": True}, {}, "s1")
        key = (DEVICE["device_key"], DEVICE["driver"], "s1", "rms_norm",
               "eps=1e-06,hidden=1024", "bf16")
        db.record_band([_measurement("a", run_id=hot), _measurement("b", run_id=hot)],
                       _winner("a"))
        _time.sleep(0.01)
        db.record_band([_measurement("a", run_id=cold)], _winner("a", run_id=cold))
        assert db.has_band(*key, 8, {"cold_l2": True})
        assert not db.has_band(*key, 8, {"cold_l2": False})       # b's old row does not count
        odd = db.start_run(DEVICE, "m", "bf16", 1, {}, {}, "s1")
        db.db.execute("update runs set settings = 'null' where id = ?", [odd])
        _time.sleep(0.01)
        db.record_band([_measurement("a", run_id=odd)], _winner("a", run_id=odd))
        assert db.has_band(*key, 8, {"cold_l2": False})
        assert not db.has_band(*key, 8, {"cold_l2": True})
    finally:
        db.close()
