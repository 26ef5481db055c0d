"""The calibration DB: one SQLite file (sqlite-utils), the single source of truth.

Tables
  meta          key/value: schema_version (migrations run forward on open)
  devices       device_key -> name, capability, SMs, memory, driver, runtime
  runs          one calibration run: model, dtype, tp, settings, stack, status, times
  measurements  every candidate's outcome per (device, driver, stack, op, signature,
                dtype, band): unqualified | refused (reason) | parity_failed (score) |
                timed (median/p10/p90/n, timer) — never only the winners
  winners       unique per (device, driver, op, signature, dtype, band): the pick, its
                time, runner-up and gap, the reason, the stack it was measured with
  crossovers    (v2) unique per (device, driver, op, signature, dtype, lower band): where
                two adjacent bands pick different winners, the token count found by
                ``fltune refine`` up to which the lower band's winner is served (its edge),
                the probes that found it, the stack it was measured with
  refine_runs   (v2) one ``fltune refine`` run: device, stack, settings, status, times
  noise_probes  (v3) the machine's own noise during a calibration run: a fixed reference
                kernel timed with the race's timer (median, spread), the load average and
                the share of CPU time other processes took (``tune/noise.py``)
  winners.undecided, winners.machine_noise  (v3) the band's noise exceeded its win margin
                (1) or not (0), and the machine probe's spread the band was judged with
  route_decisions  (v4) unique per (device, driver, stack, model, op): whether the vLLM
                plugin routes the op for that model ('route') or leaves vLLM's own path
                ('native'), decided from end-to-end model-step measurements
                (``evaluate/model_step.py``), with the reason, the evidence (the e2e points of
                the arm that routes this op alone, the scenarios, reps and the command, as
                JSON) and the version of the rule that decided
  engine_picks  (v5) unique per (device, driver, model, choice): the measured pick of an
                engine-wide vLLM setting (``attention_backend``, ``gdn_prefill_backend``,
                ...) for that model, decided from end-to-end model-step measurements of
                every value against vLLM's own default (``evaluate/engine_pick.py``):
                ``decision`` 'pick' (serve with ``value``) or 'default' (leave vLLM's rule),
                the reason, the evidence (per value: its overlay, e2e points and verdict;
                the scenarios, reps, command, as JSON), the rule, the vLLM version and the
                stack it was measured with

Version 4 also renames the candidate ``reference.inductor`` to ``inductor.standalone`` in every
column that holds an impl id (measurements, winners incl. the runner-up, crossovers): the
same thing measured (the reference compiled alone by Inductor, dynamic token dimension),
named for what it is rather than as vLLM's path. A reader of an older DB sees the new name
too (the rows are renamed as they are read, :data:`RENAMED_IMPLS`), so the DB's bytes stay
as they are.

Views (v3), for people: ``winners_readable``, ``measurements_readable`` and
``noise_readable`` (v4: ``route_decisions_readable``; v5: ``engine_picks_readable``) hold the same rows with the model, the device's name, times in µs
rounded and gaps and noise in percent, so ``sqlite3 X.db 'select * from winners_readable'``
needs no join. They are derived: nothing reads them back.

Migrations run forward when a DB is opened for writing. A reader (``write=False``, the
default with ``create=False``) opens an older DB as it is and never rewrites it: every
migration after version 1 only adds tables, views and nullable columns, and their readers
treat a missing table as empty and a missing column as unknown (``None``) — so a shipped
DB read by ``freeze``/``report`` keeps its bytes. (Version 4's renaming of an impl id is
applied to the rows a reader returns, so a reader sees the same ids either way.)

Crash and concurrency safety: WAL journal (readers never block the writer), a busy
timeout (writers queue instead of failing with "database is locked"), and each finished
(op, band) written in one ``BEGIN IMMEDIATE`` transaction — so a killed run leaves only
whole (op, band) results, and a rerun skips exactly those.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterable, Optional

import sqlite_utils

from ..util import has_sqlite_header, json_object

SCHEMA_VERSION = 6
DEFAULT_DB = os.environ.get("FLTUNE_DB_PATH",
                            str(Path.home() / ".cache" / "fltune" / "calibration.db"))
BUSY_TIMEOUT_MS = 60_000


class DBError(RuntimeError):
    """A DB that cannot be used as is; the message names the file and the way out."""


MEASUREMENT_KEY = ["device_key", "driver", "stack_key", "op", "signature", "dtype",
                   "band_hi", "impl_id"]
WINNER_KEY = ["device_key", "driver", "op", "signature", "dtype", "band_hi"]
CROSSOVER_KEY = ["device_key", "driver", "op", "signature", "dtype", "lower_hi"]
ROUTE_DECISION_KEY = ["device_key", "driver", "stack_key", "model", "op", "min_tokens"]
#: (schema 6) the whole token range of a decision made before ranges: (min, max), no max
WHOLE_RANGE = (1, None)
#: the key of schema 4 and 5 (before ranges): what migration 3 -> 4 creates
ROUTE_DECISION_KEY_V4 = ["device_key", "driver", "stack_key", "model", "op"]
ENGINE_PICK_KEY = ["device_key", "driver", "model", "choice"]
#: impl ids renamed by a migration: old -> new (v4: the standalone Inductor candidate)
RENAMED_IMPLS = {"reference.inductor": "inductor.standalone"}
#: (table, columns holding an impl id, text columns that may name one)
IMPL_ID_COLUMNS = (("measurements", ("impl_id",), ("reason",)),
                   ("winners", ("impl_id", "runner_up"), ("reason",)),
                   ("crossovers", ("impl_below", "impl_above"), ()))


def _migrate_0_to_1(db: sqlite_utils.Database):
    db["devices"].create({"device_key": str, "device_type": str, "name": str,
                          "capability": str, "sms": int, "memory_bytes": int, "driver": str,
                          "runtime": str}, pk=["device_key", "driver"], if_not_exists=True)
    db["runs"].create({"id": int, "device_key": str, "driver": str, "model": str,
                       "dtype": str, "tp": int, "settings": str, "stack": str,
                       "stack_key": str, "status": str, "started": float,
                       "finished": float, "pid": int}, pk="id", if_not_exists=True)
    db["measurements"].create({
        "device_key": str, "driver": str, "stack_key": str, "op": str, "signature": str,
        "dims": str, "dtype": str, "band_lo": int, "band_hi": int, "tokens": int,
        "impl_id": str, "kind": str, "vendor": str, "backend": str, "outcome": str,
        "reason": str, "parity_score": float, "rel_error": float, "median_us": float,
        "p10_us": float, "p90_us": float, "n": int, "timer": str, "bytes": int,
        "run_id": int, "created": float}, pk=MEASUREMENT_KEY, if_not_exists=True)
    db["winners"].create({
        "device_key": str, "driver": str, "op": str, "signature": str, "dims": str,
        "dtype": str, "band_lo": int, "band_hi": int, "impl_id": str, "kind": str,
        "vendor": str, "median_us": float, "runner_up": str, "runner_up_us": float,
        "gap": float, "noise": float, "reason": str, "weight": int, "stack_key": str,
        "run_id": int, "created": float}, pk=WINNER_KEY, if_not_exists=True)


def _migrate_1_to_2(db: sqlite_utils.Database):
    """Crossover refinement (``fltune refine``): two new tables, nothing else changes."""
    db["refine_runs"].create({"id": int, "device_key": str, "driver": str, "settings": str,
                              "stack": str, "stack_key": str, "status": str, "started": float,
                              "finished": float, "pid": int}, pk="id", if_not_exists=True)
    db["crossovers"].create({
        "device_key": str, "driver": str, "stack_key": str, "op": str, "signature": str,
        "dtype": str, "lower_hi": int, "upper_hi": int, "impl_below": str, "impl_above": str,
        "edge_tokens": int, "converged": int, "probes": str, "gap_before": float,
        "gap_after": float, "weight": int, "run_id": int, "created": float},
        pk=CROSSOVER_KEY, if_not_exists=True)


#: the views of schema 3: one flat row per winner / measurement / noise probe, no joins needed
VIEWS = {
    "winners_readable": """
select r.model as model, d.name as device, w.driver as driver, w.op as op,
       w.signature as signature, w.dtype as dtype, w.band_lo || '-' || w.band_hi as band,
       w.band_lo as band_lo, w.band_hi as band_hi, w.impl_id as winner,
       round(w.median_us, 2) as winner_us, w.runner_up as runner_up,
       round(w.runner_up_us, 2) as runner_up_us, round(100 * w.gap, 1) as gap_pct,
       round(100 * w.noise, 1) as noise_pct, round(100 * w.machine_noise, 1) as machine_noise_pct,
       w.undecided as undecided, w.reason as reason, w.weight as calls_per_step,
       w.device_key as device_key, w.run_id as run_id,
       datetime(w.created, 'unixepoch') as measured_utc
from winners w
left join devices d on d.device_key = w.device_key and d.driver = w.driver
left join runs r on r.id = w.run_id""",
    "measurements_readable": """
select r.model as model, d.name as device, m.driver as driver, m.op as op,
       m.signature as signature, m.dtype as dtype, m.band_lo || '-' || m.band_hi as band,
       m.band_lo as band_lo, m.band_hi as band_hi, m.tokens as tokens,
       m.impl_id as candidate, m.outcome as outcome, m.reason as reason,
       round(m.median_us, 2) as median_us, round(m.p10_us, 2) as p10_us,
       round(m.p90_us, 2) as p90_us, m.n as n,
       round(100 * (m.p90_us - m.p10_us) / nullif(m.median_us, 0), 1) as noise_pct,
       round(m.parity_score, 4) as parity, m.rel_error as rel_error,
       case when json_valid(m.timer) then json_extract(m.timer, '$.timer') end as timer,
       (w.impl_id is not null) as is_winner, m.device_key as device_key,
       m.stack_key as stack_key, m.run_id as run_id,
       datetime(m.created, 'unixepoch') as measured_utc
from measurements m
left join devices d on d.device_key = m.device_key and d.driver = m.driver
left join runs r on r.id = m.run_id
left join winners w on w.device_key = m.device_key and w.driver = m.driver
     and w.op = m.op and w.signature = m.signature and w.dtype = m.dtype
     and w.band_hi = m.band_hi and w.impl_id = m.impl_id and w.stack_key = m.stack_key""",
    "noise_readable": """
select r.model as model, d.name as device, p.driver as driver, p.phase as phase,
       datetime(p.created, 'unixepoch') as measured_utc, p.timer as timer,
       round(p.median_us, 2) as median_us, round(100 * p.spread, 1) as spread_pct,
       round(p.loadavg, 2) as loadavg, p.cores as cores,
       round(100 * p.busy_others, 1) as busy_others_pct, p.loaded as loaded,
       p.run_id as run_id, p.device_key as device_key
from noise_probes p
left join devices d on d.device_key = p.device_key and d.driver = p.driver
left join runs r on r.id = p.run_id""",
}


def _migrate_2_to_3(db: sqlite_utils.Database):
    """Honest noise and the DB for people: the machine's noise probes, two nullable winner
    columns (an older row reads as unknown), and the readable views."""
    db["noise_probes"].create({
        "id": int, "run_id": int, "created": float, "device_key": str, "driver": str,
        "phase": str, "timer": str, "median_us": float, "spread": float, "n": int,
        "loadavg": float, "cores": int, "busy_others": float, "loaded": str},
        pk="id", if_not_exists=True)
    cols = {c.name for c in db["winners"].columns}
    if "undecided" not in cols:
        db["winners"].add_column("undecided", int)
    if "machine_noise" not in cols:
        db["winners"].add_column("machine_noise", float)
    for name, sql in VIEWS.items():
        db.create_view(name, sql.strip(), replace=True)


VIEWS_V4 = {
    "route_decisions_readable": """
select d.name as device, r.driver as driver, r.model_name as model, r.model as model_key,
       r.op as op, r.decision as decision, r.reason as reason, r.rule as rule,
       r.stack_key as stack_key, r.device_key as device_key,
       datetime(r.created_at, 'unixepoch') as decided_utc
from route_decisions r
left join devices d on d.device_key = r.device_key and d.driver = r.driver""",
}


def _migrate_3_to_4(db: sqlite_utils.Database):
    """Routing decided by model-step measurement: the ``route_decisions`` table and its
    view; and the standalone Inductor candidate's honest name (:data:`RENAMED_IMPLS`) in
    every table that stores impl ids."""
    db["route_decisions"].create({
        "device_key": str, "driver": str, "stack_key": str, "model": str, "model_name": str,
        "op": str, "decision": str, "reason": str, "evidence": str, "rule": str,
        "created_at": float}, pk=ROUTE_DECISION_KEY_V4, if_not_exists=True)
    names = set(db.table_names())
    for old, new in RENAMED_IMPLS.items():
        for table, id_cols, text_cols in IMPL_ID_COLUMNS:
            if table not in names:
                continue
            for c in id_cols:
                db.execute(f"update {table} set {c}=? where {c}=?", [new, old])
            for c in text_cols:
                db.execute(f"update {table} set {c}=replace({c}, ?, ?) where {c} like ?",
                           [old, new, f"%{old}%"])
    for name, sql in VIEWS_V4.items():
        db.create_view(name, sql.strip(), replace=True)


VIEWS_V5 = {
    "engine_picks_readable": """
select d.name as device, e.driver as driver, e.model_name as model, e.model as model_key,
       e.choice as choice, e.decision as decision, e.value as value, e.reason as reason,
       e.rule as rule, e.vllm as vllm, e.stack_key as stack_key, e.device_key as device_key,
       datetime(e.created_at, 'unixepoch') as decided_utc
from engine_picks e
left join devices d on d.device_key = e.device_key and d.driver = e.driver""",
}


def _migrate_4_to_5(db: sqlite_utils.Database):
    """Engine-wide picks measured by model step: the ``engine_picks`` table and its view;
    nothing else changes (every older row stays as it is)."""
    db["engine_picks"].create({
        "device_key": str, "driver": str, "model": str, "choice": str, "model_name": str,
        "decision": str, "value": str, "reason": str, "evidence": str, "rule": str,
        "vllm": str, "stack_key": str, "created_at": float},
        pk=ENGINE_PICK_KEY, if_not_exists=True)
    for name, sql in VIEWS_V5.items():
        db.create_view(name, sql.strip(), replace=True)


VIEWS_V6 = {
    "route_decisions_readable": """
select d.name as device, r.driver as driver, r.model_name as model, r.model as model_key,
       r.op as op, r.min_tokens as min_tokens, r.max_tokens as max_tokens,
       r.min_tokens || '-' || coalesce(r.max_tokens, 'inf') as tokens,
       r.decision as decision, r.reason as reason, r.rule as rule,
       r.stack_key as stack_key, r.device_key as device_key,
       datetime(r.created_at, 'unixepoch') as decided_utc
from route_decisions r
left join devices d on d.device_key = r.device_key and d.driver = r.driver""",
}


def _migrate_5_to_6(db: sqlite_utils.Database):
    """Per-range route decisions: ``route_decisions`` gains the token range it covers
    (``min_tokens``, ``max_tokens``; every older row gets the whole range, 1 to no bound)
    and ``min_tokens`` joins its key. SQLite cannot change a primary key in place, so the
    table is rebuilt (sqlite-utils ``transform``: copy, drop, rename, in this migration's
    transaction); its view is dropped first and recreated with the range."""
    db.execute("drop view if exists route_decisions_readable")
    t = db["route_decisions"]
    cols = {c.name for c in t.columns}
    if "min_tokens" not in cols:
        t.add_column("min_tokens", int)
    if "max_tokens" not in cols:
        t.add_column("max_tokens", int)
    db.execute("update route_decisions set min_tokens=? where min_tokens is null",
               [WHOLE_RANGE[0]])
    if t.pks != ROUTE_DECISION_KEY:
        t.transform(pk=ROUTE_DECISION_KEY, not_null={"min_tokens"})
    for name, sql in VIEWS_V6.items():
        db.create_view(name, sql.strip(), replace=True)


MIGRATIONS = {0: _migrate_0_to_1, 1: _migrate_1_to_2, 2: _migrate_2_to_3,
              3: _migrate_3_to_4, 4: _migrate_4_to_5, 5: _migrate_5_to_6}


def renamed_impl(impl_id):
    """An impl id as this schema names it (:data:`RENAMED_IMPLS`)."""
    return RENAMED_IMPLS.get(impl_id, impl_id)


def _renamed_row(row: dict, table: str) -> dict:
    """A row read from a DB older than version 4, with the ids version 4 renamed."""
    for t, id_cols, text_cols in IMPL_ID_COLUMNS:
        if t != table:
            continue
        for c in id_cols:
            if row.get(c) in RENAMED_IMPLS:
                row[c] = RENAMED_IMPLS[row[c]]
        for c in text_cols:
            if isinstance(row.get(c), str):
                for old, new in RENAMED_IMPLS.items():
                    row[c] = row[c].replace(old, new)
    return row


def band_key(row: dict) -> tuple:
    """The band a measurement or winner row belongs to: (op, signature, dtype, band_hi)."""
    return (row["op"], row["signature"], row["dtype"], row["band_hi"])


class CalibrationDB:
    def __init__(self, path: str | os.PathLike, *, create: bool = True,
                 write: Optional[bool] = None):
        """``create``: make the file if it is missing. ``write`` (default: ``create``):
        this connection will write, so an older schema is migrated forward on open; a
        reader leaves an older (>= 1) schema as it is (see the module docstring)."""
        self.path = str(path)
        self.write = create if write is None else write
        p = Path(self.path)
        if not p.exists():
            if not create:
                from .hints import calibrate_command
                raise DBError(f"calibration DB {self.path} does not exist; create it with "
                              f"`{calibrate_command(self.path)}`")
            p.parent.mkdir(parents=True, exist_ok=True)
        elif p.is_dir():
            raise DBError(f"{self.path} is a directory, not a calibration DB file")
        elif p.stat().st_size and not has_sqlite_header(p):
            # SQLite takes a file shorter than its header for an empty DB and overwrites it
            raise DBError(f"{self.path} is not a usable SQLite calibration DB (no SQLite "
                          f"header). It was left untouched; point --db at another file, or "
                          f"move this one away and calibrate again")
        try:
            conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000,
                                   isolation_level=None)
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            self.db = sqlite_utils.Database(conn)
            names = self.db.table_names()
        except sqlite3.DatabaseError as e:
            conn.close()
            raise DBError(f"{self.path} is not a usable SQLite calibration DB ({e}). It was "
                          f"left untouched; point --db at another file, or move this one "
                          f"away and calibrate again") from None
        if names and ("meta" not in names or not self._is_fltune_meta()):
            conn.close()
            raise DBError(f"{self.path} is an SQLite file but not an fltune calibration DB "
                          f"(tables: {', '.join(sorted(names)[:6])}). It was left untouched; "
                          f"use another --db path")
        if not names and not self.write:
            # an empty file (0 bytes, or SQLite without a table) holds no calibration yet;
            # a reader must not turn it into a DB: read it as an empty one, in memory
            conn.close()
            self.db = sqlite_utils.Database(sqlite3.connect(":memory:", isolation_level=None))
            self._ensure_schema()
            return
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            conn.close()
            raise DBError(f"{self.path} has schema version {version}, newer than this fltune "
                          f"understands ({SCHEMA_VERSION}). It was left untouched; upgrade "
                          f"fltune (pip install -U fltune) to read it")
        try:
            self._wal()
        except sqlite3.DatabaseError as e:
            conn.close()
            raise DBError(f"{self.path}: cannot open ({e}); it was left untouched. If it is "
                          f"damaged, move it away and calibrate again") from None
        self._ensure_schema()

    def _is_fltune_meta(self) -> bool:
        cols = {c.name for c in self.db["meta"].columns}
        if cols != {"key", "value"}:
            return False
        row = self.db.execute("select value from meta where key='schema_version'").fetchone()
        return row is not None
    def _wal(self):
        if self.db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            self.db.execute("PRAGMA journal_mode=wal")
        self.db.execute("PRAGMA synchronous=NORMAL")

    def _ensure_schema(self):
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise DBError(f"{self.path} has schema version {version}, newer than this fltune "
                          f"understands ({SCHEMA_VERSION}). It was left untouched; upgrade "
                          f"fltune (pip install -U fltune) to read it")
        if version >= 1 and not self.write:
            return          # readable as is: later migrations only add tables and columns
        while version < SCHEMA_VERSION:
            with self.transaction():
                if version == 0:
                    self.db["meta"].create({"key": str, "value": str}, pk="key",
                                           if_not_exists=True)
                MIGRATIONS[version](self.db)
                self.db["meta"].upsert({"key": "schema_version", "value": str(version + 1)},
                                       pk="key")
            version += 1

    def schema_version(self) -> int:
        if "meta" not in self.db.table_names():
            return 0
        row = self.db.execute("select value from meta where key='schema_version'").fetchone()
        return int(row[0]) if row else 0

    # ---- transactions -----------------------------------------------------------------
    def transaction(self):
        return _Immediate(self.db.conn)

    # ---- writes -----------------------------------------------------------------------
    def upsert_device(self, rec: dict) -> None:
        cols = ["device_key", "device_type", "name", "capability", "sms", "memory_bytes",
                "driver", "runtime"]
        with self.transaction():
            self.db["devices"].upsert({k: rec[k] for k in cols}, pk=["device_key", "driver"])

    def start_run(self, device: dict, model: str, dtype: str, tp: int, settings: dict,
                  stack: dict, stack_key: str) -> int:
        with self.transaction():
            t = self.db["runs"].insert({
                "device_key": device["device_key"], "driver": device["driver"],
                "model": model, "dtype": dtype, "tp": tp,
                "settings": json.dumps(settings, sort_keys=True),
                "stack": json.dumps(stack, sort_keys=True), "stack_key": stack_key,
                "status": "running", "started": time.time(), "finished": None,
                "pid": os.getpid()})
            return t.last_pk

    def finish_run(self, run_id: int, status: str = "done") -> None:
        with self.transaction():
            self.db["runs"].update(run_id, {"status": status, "finished": time.time()})

    def record_band(self, measurements: list[dict], winner: Optional[dict]) -> None:
        """All outcomes of one (op, signature, dtype, band), and its winner: one transaction."""
        now = time.time()
        with self.transaction():
            for m in measurements:
                self.db["measurements"].upsert({**m, "created": now}, pk=MEASUREMENT_KEY)
            if winner is not None:
                self.db["winners"].upsert({**winner, "created": now}, pk=WINNER_KEY)

    # ---- reads ------------------------------------------------------------------------
    def has_band(self, device_key, driver, stack_key, op, signature, dtype, band_hi,
                 regime: Optional[dict] = None, context: Optional[dict] = None) -> bool:
        """Measured already for this device, driver and stack? (what a rerun skips)

        ``regime``: the timing switches that change how this band is timed
        (``race.timing_regime``: ``{"cold_weights": True}`` for a GEMM's decode band with
        ``--cold-weights``, ``{"cold_l2": …}`` above 512 tokens on CUDA); the band counts only
        if the run that raced it last used the same switches (a switch a run did not record
        was off; a row without a run, from an old or merged DB, had them all off). The last
        race, not any: rows are kept per candidate, so a candidate that left the field keeps
        an older run's row beside the newer ones. Why: a band timed with its weight hot is
        not the band a ``--cold-weights`` run asks for, yet a resume skipped it, so the
        switch silently changed nothing (session 21); the stack is part of the key for the
        same reason.

        ``context``: the item's context dims (``OpSpec.context``, e.g. a rope's
        ``after_qk_norm``), which are not in the signature; the band counts only if its last
        race was for the same context (absent, None and False alike). Why: ``native.vllm``
        compiles differently per context, so a band raced for a model without a q/k norm
        (or before the context existed) is not the race a Qwen3 rope asks for (session 23)."""
        row = self.db.execute(
            "select r.settings, m.dims from measurements m left join runs r on r.id = m.run_id "
            "where m.device_key=? and m.driver=? and m.stack_key=? and m.op=? and "
            "m.signature=? and m.dtype=? and m.band_hi=? "
            "order by m.created desc, m.rowid desc limit 1",
            [device_key, driver, stack_key, op, signature, dtype, band_hi]).fetchone()
        if row is None:
            return False
        if context:
            raced = json_object(row[1])
            if any((raced.get(k) or None) != (v or None) for k, v in context.items()):
                return False
        if not regime:
            return True
        st = json_object(row[0])
        return all(bool(st.get(k, False)) == bool(v) for k, v in regime.items())

    def devices(self) -> list[dict]:
        return list(self.db.query(
            "select d.*, (select count(*) from winners w where w.device_key=d.device_key and "
            "w.driver=d.driver) as winners, (select count(*) from measurements m where "
            "m.device_key=d.device_key and m.driver=d.driver) as measurements, (select "
            "max(finished) from runs r where r.device_key=d.device_key and r.driver=d.driver) "
            "as last_run from devices d order by name, driver"))

    def device(self, device_key: str, driver: Optional[str] = None) -> Optional[dict]:
        q = "select * from devices where device_key=?"
        args = [device_key]
        if driver:
            q += " and driver=?"
            args.append(driver)
        rows = list(self.db.query(q, args))
        return rows[0] if rows else None

    def winners(self, device_key: str, driver: str, op: Optional[str] = None) -> list[dict]:
        q = "select * from winners where device_key=? and driver=?"
        args = [device_key, driver]
        if op:
            q += " and op=?"
            args.append(op)
        return self._current(self.db.query(q + " order by op, signature, dtype, band_hi",
                                           args), "winners")

    def _current(self, rows, table: str) -> list[dict]:
        """``rows`` as a list, with the impl ids of the current schema (an older DB opened
        for reading keeps its old ids on disk; see the module docstring)."""
        rows = list(rows)
        if self.schema_version() < 4:
            rows = [_renamed_row(r, table) for r in rows]
        return rows

    def measurements(self, device_key: str, driver: str, **where) -> list[dict]:
        q = "select * from measurements where device_key=? and driver=?"
        args = [device_key, driver]
        for k, v in where.items():
            q += f" and {k}=?"
            if self.schema_version() < 4 and k == "impl_id":
                v = next((o for o, n in RENAMED_IMPLS.items() if n == v), v)
            args.append(v)
        return self._current(self.db.query(
            q + " order by op, signature, dtype, band_hi, impl_id", args), "measurements")

    def measurements_by_band(self, device_key: str, driver: str, **where) -> dict:
        """:meth:`measurements` grouped by band: (op, signature, dtype, band_hi) -> rows."""
        out: dict = {}
        for m in self.measurements(device_key, driver, **where):
            out.setdefault(band_key(m), []).append(m)
        return out

    def runs(self, device_key: Optional[str] = None) -> list[dict]:
        if device_key:
            return list(self.db.query("select * from runs where device_key=? order by id",
                                      [device_key]))
        return list(self.db.query("select * from runs order by id"))

    # ---- crossovers (schema 2) ------------------------------------------------------
    def start_refine(self, device: dict, settings: dict, stack: dict, stack_key: str) -> int:
        with self.transaction():
            t = self.db["refine_runs"].insert({
                "device_key": device["device_key"], "driver": device["driver"],
                "settings": json.dumps(settings, sort_keys=True),
                "stack": json.dumps(stack, sort_keys=True), "stack_key": stack_key,
                "status": "running", "started": time.time(), "finished": None,
                "pid": os.getpid()})
            return t.last_pk

    def finish_refine(self, run_id: int, status: str = "done") -> None:
        with self.transaction():
            self.db["refine_runs"].update(run_id, {"status": status, "finished": time.time()})

    def record_crossover(self, row: dict) -> None:
        """One refined edge (``probes`` as a list, stored as JSON): one transaction; a
        re-refinement of the same pair of bands replaces it."""
        with self.transaction():
            self.db["crossovers"].upsert({**row, "probes": json.dumps(row["probes"]),
                                          "created": time.time()}, pk=CROSSOVER_KEY)

    def crossovers(self, device_key: str, driver: str, op: Optional[str] = None) -> list[dict]:
        """The refined edges of a device (``probes`` decoded); none in a version-1 DB."""
        if "crossovers" not in self.db.table_names():
            return []
        q = "select * from crossovers where device_key=? and driver=?"
        args = [device_key, driver]
        if op:
            q += " and op=?"
            args.append(op)
        out = self._current(self.db.query(q + " order by op, signature, dtype, lower_hi",
                                          args), "crossovers")
        for r in out:
            r["probes"] = json.loads(r["probes"]) if r["probes"] else []
        return out

    def stacks_of_winners(self, device_key: str, driver: str) -> dict:
        """stack_key -> stack dict, for the stacks the winners were measured with."""
        out = {}
        for row in self.db.query(
                "select distinct w.stack_key, r.stack from winners w join runs r on "
                "r.stack_key = w.stack_key where w.device_key=? and w.driver=?",
                [device_key, driver]):
            out[row["stack_key"]] = json.loads(row["stack"])
        return out

    # ---- noise (schema 3) -------------------------------------------------------------
    def record_probe(self, row: dict) -> None:
        """One machine-noise probe of a calibration run (``tune/noise.py``)."""
        with self.transaction():
            self.db["noise_probes"].insert({**row, "created": time.time()})

    def noise_probes(self, device_key: str, driver: str,
                     run_id: Optional[int] = None) -> list[dict]:
        """The machine-noise probes of a device (of one run); none in a DB before v3."""
        if "noise_probes" not in self.db.table_names():
            return []
        q = "select * from noise_probes where device_key=? and driver=?"
        args = [device_key, driver]
        if run_id is not None:
            q += " and run_id=?"
            args.append(run_id)
        return list(self.db.query(q + " order by id", args))

    # ---- route decisions (schema 4) ---------------------------------------------------
    def record_route_decision(self, row: dict) -> None:
        """One model-step routing decision (``evidence`` as a dict, stored as JSON)."""
        self.record_route_decisions([row])

    def record_route_decisions(self, rows: list[dict]) -> None:
        """Several decisions (one adjudication) in one transaction. The rows of one
        (device, driver, stack, model, op) replace all of that op's older rows (every range:
        a decision split differently, or not split, leaves no stale range behind); a row
        without a range covers the whole range (:data:`WHOLE_RANGE`)."""
        rows = [{**r, "min_tokens": r.get("min_tokens") or WHOLE_RANGE[0],
                 "max_tokens": r.get("max_tokens")} for r in rows]
        with self.transaction():
            for key in {tuple(r[k] for k in ROUTE_DECISION_KEY[:-1]) for r in rows}:
                self.db.execute(
                    "delete from route_decisions where " + " and ".join(
                        f"{k}=?" for k in ROUTE_DECISION_KEY[:-1]), list(key))
            self._upsert_with_evidence("route_decisions", rows, ROUTE_DECISION_KEY)

    def route_decisions(self, device_key: str, driver: str,
                        model: Optional[str] = None) -> list[dict]:
        """The routing decisions of a device (``evidence`` decoded), of every stack, by
        model, op and token range, newest last; none in a DB before v4. A DB before v6
        (read as it is) gives every row the whole range (:data:`WHOLE_RANGE`)."""
        if ("route_decisions" in self.db.table_names() and "min_tokens" not in
                {c.name for c in self.db["route_decisions"].columns}):
            rows = self._with_evidence("route_decisions", device_key, driver, model,
                                       "model, op, created_at")
            return [{**r, "min_tokens": WHOLE_RANGE[0], "max_tokens": WHOLE_RANGE[1]}
                    for r in rows]
        return self._with_evidence("route_decisions", device_key, driver, model,
                                   "model, op, created_at, min_tokens")

    # ---- engine-wide picks (schema 5) --------------------------------------------------
    def record_engine_picks(self, rows: list[dict]) -> None:
        """The picks of one adjudication (``evidence`` as a dict, stored as JSON) in one
        transaction; a pick for the same (device, driver, model, choice) replaces the
        older one. A reader-opened DB (``write=False``) refuses rather than losing them."""
        if not self.write:
            raise DBError(f"{self.path} was opened for reading; open it with write=True to "
                          f"record engine picks")
        self._upsert_with_evidence("engine_picks", rows, ENGINE_PICK_KEY)

    def engine_picks(self, device_key: str, driver: str,
                     model: Optional[str] = None) -> list[dict]:
        """The engine-wide picks of a device (``evidence`` decoded), by model and choice;
        none in a DB before v5."""
        return self._with_evidence("engine_picks", device_key, driver, model, "model, choice")

    # ---- the two measured-decision tables share their storage shape --------------------
    def _upsert_with_evidence(self, table: str, rows: list[dict], pk) -> None:
        """``rows`` into ``table`` in one transaction, ``evidence`` stored as JSON, a row with
        the same key replacing the older one."""
        now = time.time()
        with self.transaction():
            for row in rows:
                self.db[table].upsert(
                    {**row, "evidence": json.dumps(row.get("evidence"), sort_keys=True),
                     "created_at": row.get("created_at") or now}, pk=pk)

    def _with_evidence(self, table: str, device_key: str, driver: str,
                       model: Optional[str], order: str) -> list[dict]:
        """A device's rows of ``table`` (optionally one model's), ``evidence`` decoded; none
        when the DB predates the table."""
        if table not in self.db.table_names():
            return []
        q = f"select * from {table} where device_key=? and driver=?"
        args = [device_key, driver]
        if model:
            q += " and model=?"
            args.append(model)
        out = list(self.db.query(q + f" order by {order}", args))
        for r in out:
            r["evidence"] = json.loads(r["evidence"]) if r["evidence"] else None
        return out

    def integrity_check(self) -> str:
        return self.db.execute("PRAGMA integrity_check").fetchone()[0]

    def close(self):
        self.db.conn.close()


class _Immediate:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``: take the write lock up front, so two writers
    queue on the busy timeout instead of deadlocking on a lock upgrade."""

    def __init__(self, conn):
        self.conn = conn
        self.depth_owner = False

    def __enter__(self):
        if not self.conn.in_transaction:
            self.conn.execute("BEGIN IMMEDIATE")
            self.depth_owner = True
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.depth_owner:
            self.conn.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
