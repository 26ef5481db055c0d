"""``fltune merge``: several calibration DBs -> one fleet DB, union by (device key, driver,
stack), every conflict resolved by a stated rule and listed.

Why a merge of its own rather than ``sqlite3 .dump | sqlite3``: the tables reference each
other by ids that every DB numbers from 1 (``runs.id`` <- ``measurements/winners/
noise_probes.run_id``, ``refine_runs.id`` <- ``crossovers.run_id``), one band's rows are
written together (``record_band``: its measurements and its winner in one transaction, with
one ``created``), and the winner of a band is unique per (device, driver, op, signature,
dtype, band) whatever the stack — so two hosts of one device type that both calibrated hold
two answers for one key. A row-wise copy would renumber nothing, mix bands and keep the
answer of whichever file came last.

What the merge guarantees (``tests/test_merge.py`` checks each with hypothesis over DBs
written by the real store code):

- **inputs are never modified**: each is read through a read-only SQLite connection and
  copied (SQLite's backup API: a consistent snapshot, WAL content included) into a
  temporary file; the copy, not the input, is opened by :class:`CalibrationDB` for writing,
  so an older schema is migrated forward there with the same migrations as any DB, and the
  same checks refuse a file that is not an fltune DB or is of a newer schema. The output
  must not be an input and must not exist; it is written to a temporary file next to it
  and renamed into place only after it passed :func:`check`.
- **nothing is dropped silently**: every table of the schema is handled by name
  (:data:`HANDLED`); a table or column this code does not know that holds data (a newer
  schema, a hand-made table) refuses the merge, naming the table and the way out. A row that
  loses a conflict is listed in the result with the row that won and the rule.
- **idempotent and order-independent**: every conflict is resolved by taking the maximum
  under a total order on the candidates computed from the candidate's own data (data that
  travels with it into a merged DB), so ``merge(A, A) == A``, ``merge(A, B) == merge(B, A)``
  and ``merge(merge(A, B), C) == merge(A, merge(B, C))`` on winners. Ids are renumbered from
  the content (runs in order of start), so the same content gets the same ids.

The winner rule (:func:`winner_order`), the race's rules made a total order:

1. **newer stack** — two winners measured on different software stacks: the newer stack
   wins (its package versions compared in :data:`STACK_ORDER`: torch, vLLM, Triton,
   FlagGems, fltune, Python). Re-timed data on the software the fleet runs now replaces the
   older; it is what calibrating both into one DB would leave when the stacks were installed
   in version order. Why versions and not the clock: a clock order between stacks together
   with a race within a stack is not a total order (three DBs can go round in a circle),
   so the result would depend on the merge order.
2. **faster** — on the same stack, both are measurements of the same race: the faster
   winner wins when the two times lie in different win-margin cells (a log grid of the
   race's margin, :data:`WIN_MARGIN`: cell = floor(ln t / ln 1.03)).
3. **precision within the margin** — times in one cell are within the margin of each other,
   and, as in the race, the more precise (smaller measured ``rel_error`` of the winner's own
   measurement row) wins: a 2 % timing difference is what a rerun moves, a precision
   difference is real. The grid is where this differs from the race's rule: two times
   within the margin that straddle a cell edge go to the faster (the race's "within the
   margin of the fastest" is not transitive, so it cannot be order-independent).
4. **newer** — equal precision: the newer measurement (``created``) wins (re-timed data).
5. **tiebreak** — the impl id, then the row's content: deterministic, listed as such.

The measurements of a band on one stack follow their winner: the rows written in the same
transaction as the kept winner (same ``created``) win over other copies of the same
candidates; elsewhere the newer copy. Crossovers: one consistent with the kept winners of
both its bands, then the newer stack, then the newer. Route decisions: the newer decision.
Devices: the description of the device's newest run. Runs: one row per (device, driver,
model, started, pid, ...), a finished one over an unfinished copy.
"""
from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from ..util import has_sqlite_header
from . import db as _db
from .db import (CROSSOVER_KEY, MEASUREMENT_KEY, ROUTE_DECISION_KEY, SCHEMA_VERSION,
                 WINNER_KEY, CalibrationDB, DBError)

#: (schema 5) the key of an engine-wide pick; spelled out where the schema predates it
ENGINE_PICK_KEY = getattr(_db, "ENGINE_PICK_KEY", ["device_key", "driver", "model", "choice"])

#: the race's win margin (``tune.race.WIN_MARGIN``; the store may not import the tune stage,
#: a test checks the two agree): the width of the grid cells of rule 3
WIN_MARGIN = 0.03
#: the packages whose versions order two stacks (rule 1), most significant first
STACK_ORDER = ("torch", "vllm", "triton", "flag_gems", "fltune", "python")
#: every table of the schema, by name; each is merged by the code below
HANDLED = ("meta", "devices", "runs", "refine_runs", "measurements", "winners",
           "crossovers", "noise_probes", "route_decisions", "engine_picks")
#: tables with an id the merge renumbers, and who refers to them
RUN_TABLES = {"runs": ("measurements", "winners", "noise_probes"),
              "refine_runs": ("crossovers",)}
#: a run's columns that may change after it started (a copy taken mid-run)
RUN_MUTABLE = ("id", "status", "finished")


class MergeError(DBError):
    """A merge that cannot be done as asked; the message names the file or table and the
    way out. Nothing was written."""


@dataclass
class MergeResult:
    """What ``merge`` did, as a document (``--json`` prints :meth:`as_dict`)."""
    out: str
    inputs: list                 # [{path, schema_version, migrated, rows: {table: n}}]
    rows: dict                   # table -> {"in": rows over all inputs, "out": rows written}
    conflicts: list              # [{table, key, kept, rule, why, sides: [...]}]
    notes: list = field(default_factory=list)
    integrity: str = ""
    checks: list = field(default_factory=list)   # problems found by check(); empty: ok
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        rules: dict = {}
        for c in self.conflicts:
            rules[c["rule"]] = rules.get(c["rule"], 0) + 1
        d["summary"] = {"inputs": len(self.inputs), "conflicts": len(self.conflicts),
                        "rules": rules,
                        "rows_out": sum(v["out"] for v in self.rows.values())}
        return d


# ---- reading an input ---------------------------------------------------------------------

def _dump(v) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def _snapshot(path: str, copy: str) -> int:
    """Copy ``path`` into ``copy`` through a read-only connection; return its schema
    version as stored. Refuses (``MergeError``) what is not an SQLite file."""
    p = Path(path)
    if not p.exists():
        raise MergeError(f"{path} does not exist; name an existing calibration DB")
    if p.is_dir():
        raise MergeError(f"{path} is a directory, not a calibration DB file")
    if p.stat().st_size == 0:
        raise MergeError(f"{path} is empty (0 bytes): it holds no calibration; leave it out "
                         f"of the merge")
    if not has_sqlite_header(p):
        raise MergeError(f"{path} is not a usable SQLite calibration DB (no SQLite header). "
                         f"It was left untouched; leave it out of the merge")
    # read-only, and no side files left next to the input: a DB without a WAL file (no
    # writer has it open; the usual case) is read as immutable, which makes SQLite create
    # no -wal/-shm; one with a WAL file is read through it (its side files exist already)
    wal = os.path.exists(str(p) + "-wal")
    uri = ("file:" + urllib.parse.quote(str(p.resolve())) + "?mode=ro"
           + ("" if wal else "&immutable=1"))
    src = dst = None
    try:
        src = sqlite3.connect(uri, uri=True)
        dst = sqlite3.connect(copy)
        src.backup(dst)
        ok = dst.execute("PRAGMA integrity_check").fetchone()[0]
        if ok != "ok":
            raise MergeError(f"{path} failed SQLite's integrity check ({ok}); it was left "
                             f"untouched. If a calibration is writing it, merge when it is "
                             f"done; otherwise leave it out of the merge")
        row = None
        names = {r[0] for r in dst.execute("select name from sqlite_master where type='table'")}
        if "meta" in names:
            try:
                row = dst.execute("select value from meta where key='schema_version'"
                                  ).fetchone()
            except sqlite3.DatabaseError:
                row = None
        try:
            return int(row[0]) if row else 0
        except (TypeError, ValueError):
            return 0
    except sqlite3.DatabaseError as e:
        raise MergeError(f"{path} is not a usable SQLite calibration DB ({e}). It was left "
                         f"untouched; leave it out of the merge") from None
    finally:
        for c in (src, dst):
            if c is not None:
                c.close()


def _open_copy(path: str, copy: str) -> CalibrationDB:
    """The copy opened for writing: the same checks as any DB, and migrations forward."""
    try:
        return CalibrationDB(copy, create=False, write=True)
    except DBError as e:
        msg = str(e).replace(copy, path).replace("use another --db path",
                                                 "leave it out of the merge")
        raise MergeError(msg) from None


def _columns(db: CalibrationDB, table: str) -> list:
    return [c.name for c in db.db[table].columns]


def _tables(db: CalibrationDB) -> list:
    return [r[0] for r in db.db.execute(
        "select name from sqlite_master where type='table' and name not like 'sqlite_%' "
        "order by name")]


def _handled(out_columns: dict) -> list:
    """The handled tables this fltune's schema has (``engine_picks`` from version 5)."""
    return [t for t in HANDLED if t in out_columns]


def _read(db: CalibrationDB, path: str, out_columns: dict) -> dict:
    """Every row of every handled table (dicts), after refusing data this code does not
    know how to merge."""
    present = _tables(db)
    for t in present:
        if t in HANDLED and t in out_columns:
            continue
        n = db.db.execute(f'select count(*) from "{t}"').fetchone()[0]
        if n:
            raise MergeError(
                f"{path} has a table {t!r} ({n} rows) that fltune merge does not know how to "
                f"merge (it handles: {', '.join(HANDLED)}); merging would drop it, so nothing "
                f"was written. Upgrade fltune (pip install -U fltune) to a version whose "
                f"merge handles {t!r}, or move the table out of a copy of {path}")
    rows = {}
    for t in _handled(out_columns):
        if t not in present:
            rows[t] = []
            continue
        extra = [c for c in _columns(db, t) if c not in out_columns[t]]
        for c in extra:
            n = db.db.execute(f'select count(*) from "{t}" where "{c}" is not null'
                              ).fetchone()[0]
            if n:
                raise MergeError(
                    f"{path}: column {t}.{c} ({n} values) is not in this fltune's schema, so "
                    f"merge would drop it; nothing was written. Upgrade fltune (pip install "
                    f"-U fltune), or merge with the fltune that wrote {path}")
        rows[t] = [{k: v for k, v in r.items() if k in out_columns[t]}
                   for r in db.db.query(f'select * from "{t}"')]
    # the output's schema_version is its own (every input is migrated to it)
    rows["meta"] = [r for r in rows["meta"] if r.get("key") != "schema_version"]
    return rows


# ---- the order of candidates -----------------------------------------------------------

try:  # packaging ships with pip/setuptools/vLLM but is not a dependency of fltune
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover
    Version = None


def _version(v) -> tuple:
    """A package version as a sortable key: absent < unparseable < parsed (PEP 440)."""
    if v is None:
        return (0,)
    s = str(v)
    if Version is not None:
        try:
            return (2, Version(s))
        except InvalidVersion:
            pass
    return (1, tuple(int(x) for x in re.findall(r"\d+", s)), s)


def stack_generation(stack: Optional[dict]) -> tuple:
    """The key by which a newer software stack sorts after an older one (rule 1)."""
    stack = stack or {}
    return tuple(_version(stack.get(k)) for k in STACK_ORDER) + (_dump(stack),)


def margin_cell(median_us) -> float:
    """The win-margin grid cell of a time (rule 2/3): times in one cell are within the
    margin of each other. Unknown or non-positive times sort as the slowest."""
    if median_us is None or not median_us > 0 or math.isinf(median_us):
        return math.inf
    return math.floor(math.log(median_us) / math.log1p(WIN_MARGIN))


def _num(v, default):
    return default if v is None or (isinstance(v, float) and math.isnan(v)) else v


class _Ctx:
    """What the rules look up beyond a row: the stack of a stack key (from every input's
    runs: a stack key is the hash of its stack, so all agree) and each winner's precision,
    the ``rel_error`` of its own measurement row (written in the same transaction; it
    travels with the winner into a merged DB, see :meth:`_Merger.measurements`)."""

    def __init__(self):
        self.stacks: dict = {}
        self.errors: dict = {}        # winner row (JSON) -> rel_error of its measurement

    def generation(self, stack_key) -> tuple:
        return stack_generation(self.stacks.get(stack_key))

    def rel_error(self, w: dict):
        return self.errors.get(_dump(w))


def winner_order(w: dict, ctx: _Ctx) -> tuple:
    """The total order on candidate winners of one key (the largest wins): the rules of
    the module docstring, in order."""
    err = ctx.rel_error(w)
    return (ctx.generation(w.get("stack_key")), -margin_cell(w.get("median_us")),
            -_num(err, math.inf), _num(w.get("created"), -math.inf), str(w.get("impl_id")),
            _dump(w))


# ---- merging -------------------------------------------------------------------------------

def _key(row: dict, cols) -> tuple:
    return tuple(row.get(c) for c in cols)


def _side(row: dict, inputs: list, table: str) -> dict:
    """A conflict side as listed: which inputs held it and the row's telling columns."""
    keep = {"winners": ("impl_id", "median_us", "stack_key", "created", "reason"),
            "measurements": ("impl_id", "outcome", "median_us", "rel_error", "created"),
            "crossovers": ("impl_below", "impl_above", "edge_tokens", "stack_key", "created"),
            "route_decisions": ("decision", "reason", "rule", "created_at"),
            "engine_picks": ("decision", "value", "reason", "rule", "created_at"),
            }.get(table)
    return {"inputs": inputs, "row": {k: row.get(k) for k in keep} if keep else row}


class _Merger:
    def __init__(self, paths: list):
        self.paths = paths
        self.conflicts: list = []
        self.notes: list = []
        self.ctx = _Ctx()

    # runs: renumbered from their content --------------------------------------------
    def runs(self, table: str, inputs: list) -> tuple:
        """(merged rows with new ids, per input {old id: new id})."""
        by_nat: dict = {}
        for i, rows in enumerate(inputs):
            for r in rows[table]:
                nat = _dump({k: v for k, v in r.items() if k not in RUN_MUTABLE})
                by_nat.setdefault(nat, {}).setdefault(_dump({k: v for k, v in r.items()
                                                             if k != "id"}), (r, []))[1].append(i)
        merged, ident = [], {}
        for nat, variants in by_nat.items():
            cands = sorted(variants.values(), key=lambda c: (
                c[0].get("status") == "done", _num(c[0].get("finished"), -math.inf),
                _dump(c[0])), reverse=True)
            row = {k: v for k, v in cands[0][0].items() if k != "id"}
            if len(cands) > 1:
                self.conflicts.append({
                    "table": table, "key": {k: row.get(k) for k in
                                            ("device_key", "driver", "started", "pid")},
                    "kept": cands[0][1], "rule": "finished run",
                    "why": "copies of one run at different moments: the finished (latest) one",
                    "sides": [_side({k: c[0].get(k) for k in ("status", "finished")}, c[1],
                                    table) for c in cands]})
            merged.append(row)
            ident[nat] = row
        merged.sort(key=lambda r: (_num(r.get("started"), -math.inf), _dump(r)))
        for n, r in enumerate(merged, 1):
            r["id"] = n
        remap = []
        for rows in inputs:
            m = {}
            for r in rows[table]:
                nat = _dump({k: v for k, v in r.items() if k not in RUN_MUTABLE})
                m[r["id"]] = ident[nat]["id"]
            remap.append(m)
        return merged, remap

    def relink(self, inputs: list, table: str, remaps: dict) -> None:
        """Point every run_id at the merged run; one the input does not hold becomes NULL
        (noted, never silently)."""
        for run_table, users in RUN_TABLES.items():
            if table not in users:
                continue
            for i, rows in enumerate(inputs):
                lost = 0
                for r in rows[table]:
                    if r.get("run_id") is None:
                        continue
                    new = remaps[run_table][i].get(r["run_id"])
                    lost += new is None
                    r["run_id"] = new
                if lost:
                    self.notes.append(f"{self.paths[i]}: {lost} {table} rows referred to a "
                                      f"{run_table} id the file does not hold; their run_id "
                                      f"is NULL in the output")

    # keyed tables --------------------------------------------------------------------
    def keyed(self, table: str, inputs: list, cols) -> dict:
        """key -> [(row, [input indices])] over distinct rows, for a table with a key."""
        out: dict = {}
        for i, rows in enumerate(inputs):
            for r in rows[table]:
                variants = out.setdefault(_key(r, cols), {})
                variants.setdefault(_dump(r), (r, []))[1].append(i)
        return {k: list(v.values()) for k, v in out.items()}

    def resolve(self, table: str, key_cols, groups: dict, order, rule) -> list:
        kept = []
        for key, cands in groups.items():
            cands = sorted(cands, key=lambda c: order(c[0]), reverse=True)
            best = cands[0]
            kept.append(best[0])
            if len(cands) > 1:
                rules = [rule(best[0], c[0]) for c in cands[1:]]
                self.conflicts.append({
                    "table": table, "key": dict(zip(key_cols, key)),
                    "kept": [self.paths[i] for i in best[1]], "rule": rules[0][0],
                    "why": rules[0][1],
                    "sides": [_side(c[0], [self.paths[i] for i in c[1]], table)
                              for c in cands]})
                if table == "winners":      # the precision the rules compared
                    for side, c in zip(self.conflicts[-1]["sides"], cands):
                        side["row"]["rel_error"] = self.ctx.rel_error(c[0])
        return kept

    def measurements(self, inputs: list, winners_by_key: dict) -> list:
        """Per (device, driver, stack, op, signature, dtype, band): the copies of the band
        ordered (the one written with the kept winner first, then newer); each candidate's
        row from the first copy that has it, so a row only one copy holds is kept."""
        band_cols = MEASUREMENT_KEY[:-1]
        bands: dict = {}
        for i, rows in enumerate(inputs):
            per: dict = {}
            for r in rows["measurements"]:
                per.setdefault(_key(r, band_cols), []).append(r)
            for bk, rs in per.items():
                rs.sort(key=lambda r: _dump(r))
                dig = _dump(rs)
                bands.setdefault(bk, {}).setdefault(dig, (rs, []))[1].append(i)
        out = []
        for bk, copies in bands.items():
            copies = list(copies.values())
            if len(copies) == 1:
                out.extend(copies[0][0])
                continue
            b = dict(zip(band_cols, bk))
            w = winners_by_key.get(_key(b, WINNER_KEY))

            def carries(rs, w=w, b=b):
                return (w is not None and w.get("stack_key") == b["stack_key"] and any(
                    r.get("impl_id") == w.get("impl_id") and r.get("created") == w.get("created")
                    for r in rs))

            def order(c):
                rs = c[0]
                return (carries(rs), max(_num(r.get("created"), -math.inf) for r in rs),
                        _dump(rs))
            copies.sort(key=order, reverse=True)
            taken: dict = {}
            for rs, _ in copies:
                for r in rs:
                    taken.setdefault(r["impl_id"], r)
            out.extend(taken.values())
            best = copies[0]
            self.conflicts.append({
                "table": "measurements", "key": b, "kept": [self.paths[i] for i in best[1]],
                "rule": "with the winner" if carries(best[0]) else "newer",
                "why": ("the band's rows written with the kept winner (same transaction) win; "
                        "a candidate only another copy measured is kept from it"
                        if carries(best[0]) else
                        "the newest copy of the band wins; a candidate only another copy "
                        "measured is kept from it"),
                "sides": [{"inputs": [self.paths[i] for i in ix],
                           "row": {"candidates": len(rs),
                                   "created": max(_num(r.get("created"), 0) for r in rs),
                                   "has_kept_winner": carries(rs)}} for rs, ix in copies]})
        return out


def _content_rows(rows: dict) -> dict:
    return {t: sorted(_dump(r) for r in rs) for t, rs in rows.items()}


def merge(paths, out, *, progress=None) -> MergeResult:
    """Merge the calibration DBs ``paths`` into a new DB ``out`` (see the module docstring
    for the rules). Raises :class:`MergeError` (nothing written) for an input that is not
    a usable fltune DB, holds data this code cannot merge, or is the output."""
    t0 = time.time()
    paths = [str(p) for p in paths]
    out = str(out)
    if not paths:
        raise MergeError("no input DBs; name at least one calibration DB to merge")
    o = Path(out)
    for p in paths:
        if os.path.abspath(p) == os.path.abspath(out) or (
                o.exists() and Path(p).exists() and os.path.samefile(p, out)):
            raise MergeError(f"the output {out} is also an input; write the merge to a new file "
                             f"(-o fleet.db) and move it into place afterwards")
    if o.is_dir():
        raise MergeError(f"{out} is a directory; name a file to write (-o fleet.db)")
    if o.exists() or os.path.exists(out + "-wal"):
        raise MergeError(f"{out} exists; it was left untouched. Name a new file (-o), or "
                         f"remove {out} first")
    if not o.parent.resolve().is_dir():
        raise MergeError(f"directory {o.parent} does not exist; create it or name another -o")
    with tempfile.TemporaryDirectory(prefix="fltune-merge-") as tmp:
        # the schema this fltune writes: what the output will be, and what inputs migrate to
        ref = CalibrationDB(os.path.join(tmp, "schema.db"))
        out_columns = {t: _columns(ref, t) for t in _tables(ref)}
        ref.close()
        inputs, docs = [], []
        for n, p in enumerate(paths):
            copy = os.path.join(tmp, f"in{n}.db")
            version = _snapshot(p, copy)
            db = _open_copy(p, copy)
            try:
                rows = _read(db, p, out_columns)
            finally:
                db.close()
            inputs.append(rows)
            docs.append({"path": p, "schema_version": version,
                         "migrated": version < SCHEMA_VERSION,
                         "rows": {t: len(r) for t, r in rows.items()}})
            if progress:
                progress("read", path=p)
        res = _merge_rows(paths, inputs, out_columns)
        merged, m = res
        tmp_out = f"{out}.tmp.{os.getpid()}"
        try:
            _write(tmp_out, merged)
            problems, integrity = check(tmp_out)
            if os.path.exists(tmp_out + "-wal") and os.path.getsize(tmp_out + "-wal"):
                problems.append("the merged DB's WAL was not checkpointed")
            if problems:
                raise MergeError(f"the merged DB failed its checks ({'; '.join(problems[:3])}); "
                                 f"nothing was written to {out}. Please report this")
            os.replace(tmp_out, out)
        finally:
            for side in ("", "-wal", "-shm"):
                if os.path.exists(tmp_out + side):
                    os.unlink(tmp_out + side)
    rows_doc = {t: {"in": sum(len(i[t]) for i in inputs), "out": len(merged[t])}
                for t in merged}
    return MergeResult(out=out, inputs=docs, rows=rows_doc, conflicts=m.conflicts,
                       notes=m.notes, integrity=integrity, checks=problems,
                       wall_s=time.time() - t0)


def _merge_rows(paths: list, inputs: list, out_columns: dict):
    """The merged rows of every handled table (ids renumbered), and the merger (its
    conflicts and notes)."""
    m = _Merger(paths)
    merged: dict = {}
    remaps = {}
    for t in RUN_TABLES:
        merged[t], remaps[t] = m.runs(t, inputs)
    for t in ("measurements", "winners", "noise_probes", "crossovers"):
        m.relink(inputs, t, remaps)
    for r in merged["runs"] + merged["refine_runs"]:
        if r.get("stack_key") and r.get("stack"):
            try:
                m.ctx.stacks.setdefault(r["stack_key"], json.loads(r["stack"]))
            except ValueError:
                pass
    # meta: the output's schema_version is its own; any other key is kept
    meta = {k: v for k, v in m.keyed("meta", inputs, ["key"]).items()
            if k != ("schema_version",)}
    merged["meta"] = m.resolve("meta", ["key"], meta, lambda r: _dump(r),
                               lambda a, b: ("tiebreak", "the larger value"))
    # devices: the description of the device's newest run
    newest: list = []
    for rows in inputs:
        d: dict = {}
        for r in rows["runs"]:
            k = (r.get("device_key"), r.get("driver"))
            d[k] = max(d.get(k, -math.inf), _num(r.get("started"), -math.inf))
        newest.append(d)
    dev_groups = m.keyed("devices", inputs, ["device_key", "driver"])
    started = {}
    for k, cands in dev_groups.items():
        for r, ix in cands:
            started[_dump(r)] = max(newest[i].get(k, -math.inf) for i in ix)
    merged["devices"] = m.resolve(
        "devices", ["device_key", "driver"], dev_groups,
        lambda r: (started[_dump(r)], _dump(r)),
        lambda a, b: ("newest run", "the device as described by its newest calibration run"))
    # winners first (the measurements of a band follow their winner); their precision is
    # read from each input's own measurement row of the winner
    win_groups = m.keyed("winners", inputs, WINNER_KEY)
    for rows in inputs:
        idx = {_key(r, MEASUREMENT_KEY): r for r in rows["measurements"]}
        for w in rows["winners"]:
            own = idx.get(_key(w, MEASUREMENT_KEY))
            err = None if own is None else own.get("rel_error")
            prev = m.ctx.errors.get(_dump(w))
            if err is not None and (prev is None or err < prev):
                m.ctx.errors[_dump(w)] = err

    def worder(w):
        return winner_order(w, m.ctx)

    def wrule(a, b):
        return _winner_rule(a, b, m.ctx)
    merged["winners"] = m.resolve("winners", WINNER_KEY, win_groups, worder, wrule)
    by_key = {_key(w, WINNER_KEY): w for w in merged["winners"]}
    merged["measurements"] = m.measurements(inputs, by_key)
    merged["noise_probes"] = _union_probes(inputs)
    # crossovers: consistent with the kept winners, then the newer stack, then newer

    def corder(c):
        lo = by_key.get((c.get("device_key"), c.get("driver"), c.get("op"),
                         c.get("signature"), c.get("dtype"), c.get("lower_hi")))
        hi = by_key.get((c.get("device_key"), c.get("driver"), c.get("op"),
                         c.get("signature"), c.get("dtype"), c.get("upper_hi")))
        ok = (lo is not None and hi is not None and lo.get("impl_id") == c.get("impl_below")
              and hi.get("impl_id") == c.get("impl_above"))
        return (ok, m.ctx.generation(c.get("stack_key")), _num(c.get("created"), -math.inf),
                _dump(c))

    def crule(a, b):
        ka, kb = corder(a), corder(b)
        if ka[0] != kb[0]:
            return "consistent with winners", ("its two bands' kept winners are the impls "
                                               "it separates")
        if ka[1] != kb[1]:
            return "newer stack", "refined on a newer software stack"
        if ka[2] != kb[2]:
            return "newer", "the newer refinement"
        return "tiebreak", "the larger row content"
    merged["crossovers"] = m.resolve("crossovers", CROSSOVER_KEY,
                                     m.keyed("crossovers", inputs, CROSSOVER_KEY), corder, crule)
    merged["route_decisions"] = m.resolve(
        "route_decisions", ROUTE_DECISION_KEY,
        m.keyed("route_decisions", inputs, ROUTE_DECISION_KEY),
        lambda r: (_num(r.get("created_at"), -math.inf), _dump(r)),
        lambda a, b: (("newer", "the newer decision (decided again later)")
                      if a.get("created_at") != b.get("created_at") else
                      ("tiebreak", "the larger row content")))
    if "engine_picks" in out_columns:
        merged["engine_picks"] = m.resolve(
            "engine_picks", ENGINE_PICK_KEY,
            m.keyed("engine_picks", inputs, ENGINE_PICK_KEY),
            lambda r: (_num(r.get("created_at"), -math.inf), _dump(r)),
            lambda a, b: (("newer", "the newer pick (measured again later)")
                          if a.get("created_at") != b.get("created_at") else
                          ("tiebreak", "the larger row content")))
    return {t: [{k: r.get(k) for k in out_columns[t] if k in r} for r in merged[t]]
            for t in _handled(out_columns)}, m


def _winner_rule(a: dict, b: dict, ctx: _Ctx) -> tuple:
    """(rule, why): the first rule of :func:`winner_order` that puts ``a`` before ``b``."""
    ka, kb = winner_order(a, ctx), winner_order(b, ctx)
    if ka[0] != kb[0]:
        sa = ctx.stacks.get(a.get("stack_key")) or {}
        sb = ctx.stacks.get(b.get("stack_key")) or {}
        diff = [f"{k} {sb.get(k)} -> {sa.get(k)}" for k in STACK_ORDER if sa.get(k) != sb.get(k)]
        return "newer stack", ("measured on a newer software stack (" + (", ".join(diff) or
                                                                        "stack content") + ")")
    if ka[1] != kb[1]:
        return "faster", (f"same stack: {a.get('median_us')} µs vs {b.get('median_us')} µs, "
                          f"beyond the {WIN_MARGIN:.0%} win margin: the faster wins")
    if ka[2] != kb[2]:
        return "precision", (f"same stack, within the {WIN_MARGIN:.0%} win margin "
                             f"({a.get('median_us')} vs {b.get('median_us')} µs): the more "
                             f"precise wins (rel err {ctx.rel_error(a)} vs {ctx.rel_error(b)})")
    if ka[3] != kb[3]:
        return "newer", ("same stack, within the margin, equal precision: the newer "
                         "measurement (re-timed) wins")
    return "tiebreak", "indistinguishable by the rules: the larger impl id, then row content"


def _union_probes(inputs: list) -> list:
    """Noise probes have no key: the distinct probes of all inputs, renumbered by time."""
    seen: dict = {}
    for rows in inputs:
        for r in rows["noise_probes"]:
            r = {k: v for k, v in r.items() if k != "id"}
            seen.setdefault(_dump(r), r)
    out = sorted(seen.values(), key=lambda r: (_num(r.get("created"), -math.inf), _dump(r)))
    for n, r in enumerate(out, 1):
        r["id"] = n
    return out


def _write(path: str, merged: dict) -> None:
    """The merged rows into a new DB at ``path``, in one transaction."""
    db = CalibrationDB(path)
    try:
        with db.transaction():
            for t in merged:
                rows = merged[t]
                if not rows:
                    continue
                if t == "meta":
                    db.db["meta"].upsert_all(rows, pk="key")
                else:
                    db.db[t].insert_all(rows)
        # everything into the main file before it is renamed: the -wal beside the
        # temporary name does not travel with it
        db.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()


def check(path) -> tuple:
    """The checks every DB passes, run on a DB (the merge's output before it is moved into
    place): SQLite's integrity check, the schema version, and the references the tables
    make to each other. Returns (problems, integrity)."""
    db = CalibrationDB(path, create=False)
    problems = []
    try:
        integrity = db.integrity_check()
        if integrity != "ok":
            problems.append(f"integrity_check: {integrity}")
        if db.schema_version() != SCHEMA_VERSION:
            problems.append(f"schema version {db.schema_version()} != {SCHEMA_VERSION}")
        q = db.db.execute
        for run_table, users in RUN_TABLES.items():
            for t in users:
                n = q(f"select count(*) from {t} where run_id is not null and run_id not in "
                      f"(select id from {run_table})").fetchone()[0]
                if n:
                    problems.append(f"{n} {t} rows refer to a missing {run_table} row")
        n = q("select count(*) from winners w where not exists (select 1 from measurements m "
              "where m.device_key=w.device_key and m.driver=w.driver and "
              "m.stack_key=w.stack_key and m.op=w.op and m.signature=w.signature and "
              "m.dtype=w.dtype and m.band_hi=w.band_hi and m.impl_id=w.impl_id)").fetchone()[0]
        if n:
            problems.append(f"{n} winners have no measurement row of their own")
    finally:
        db.close()
    return problems, integrity


def content(path) -> dict:
    """A DB's content independent of how its ids are numbered: table -> sorted rows (JSON),
    each ``run_id`` replaced by the run it refers to. Two DBs with equal content hold the
    same calibration (what ``merge(A, A) == A`` means)."""
    db = CalibrationDB(path, create=False)
    try:
        present = set(_tables(db))
        rows = {t: ([dict(r) for r in db.db.query(f"select * from {t}")] if t in present
                    else []) for t in HANDLED if t in present}
    finally:
        db.close()
    rows["meta"] = [r for r in rows["meta"] if r["key"] != "schema_version"]
    for run_table, users in RUN_TABLES.items():
        ident = {r["id"]: {k: v for k, v in r.items() if k != "id"} for r in rows[run_table]}
        for t in users:
            for r in rows[t]:
                r["run_id"] = ident.get(r.get("run_id"), r.get("run_id"))
                r.pop("id", None)
        for r in rows[run_table]:
            r.pop("id")
    for r in rows["noise_probes"]:
        r.pop("id", None)
    return _content_rows(rows)
