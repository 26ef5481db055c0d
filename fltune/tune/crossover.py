"""Crossover refinement (``fltune refine``): where two neighbouring bands pick different
winners, find the token count where the pick should change, instead of at the band edge.

Why: calibration measures each band at its top edge only, and the winner covers the whole
band. When band k (measured at ``h_k``) picks A and band k+1 (measured at ``h_k+1``) picks
B, the coarse table sends every count in ``(h_k, h_k+1]`` to B — but the true crossover can
lie anywhere in there, and in the wide prefill bands (8k..16k tokens) "anywhere" is
thousands of tokens of the slower kernel. Bisecting only that interval, timing only A and
B, costs a few races per pair of bands instead of a denser band grid everywhere.

The method, per pair of adjacent bands with different winners (one device and driver,
same software stack as the winners):

- the interval is ``(lower_hi, upper_hi)``: A is known to win at ``lower_hi`` and B at
  ``upper_hi`` (the calibration's verdicts, taken as given);
- probe the midpoint: A and B raced in one interleaved run on fresh inputs of that token
  count (``adjudicate`` with just those two: the same qualify -> parity -> timing machinery
  as calibrate, ``tune/timing.py``, the op's ``make_inputs``, the calibration run's
  settings); the faster median wins the probe (ties go to A). The precision tie-break of
  calibration is deliberately not applied: both passed parity at the probe, and where
  they are within the margin either choice costs less than the margin;
- keep the half whose ends have different winners, until the interval is at most
  ``max(min_tokens, frac x band width)`` tokens (defaults 16 and 1/8) or ``max_probes``
  probes were spent;
- the **edge** is the middle of the final interval: the largest token count still served
  by A. Tokens ``<= edge`` go to A, ``> edge`` to B — exactly the band rule's
  ``(edge[i-1], edge[i]]``, with the lower band's ``hi`` replaced by the edge, so
  ``FrozenDispatch.select`` (``bisect_left(his, rows)``, ``rows = tokens x rows_per_token``)
  needs no change.

Bisection keeps one invariant — A won at the left end, B at the right — so it finds *a*
crossover even when the two curves cross more than once (it does not find all of them).

The oracle gap, before and after: over the probe points only (the points where both A and
B were timed), the workload-weighted time of what the frozen table picks (before: the
coarse edge ``lower_hi``; after: the refined edge) over the better of A and B at each
point. It measures what refinement bought at the sizes it looked at; other candidates are
not timed at probes.

``find_edge`` is the pure core (give it a measuring function; unit-tested with synthetic
curves), ``refine`` the driver that reads the DB, times real candidates and writes the
``crossovers`` table that ``freeze`` consumes.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from ..ops import dtype_from_name
from ..store import CalibrationDB, DBError
from ..store import device as devmod
from ..store.device import device_row_for_this_machine
from ..store.hints import calibrate_hint
from .bands import Band
from .race import Settings
from .worker import racer
from .workload import derive

MIN_TOKENS = 16
FRACTION = 1 / 8
MAX_PROBES = 6


class ProbeFailed(RuntimeError):
    """A probe could not time both candidates (parity failed, raised, out of memory)."""


@dataclass
class Probe:
    tokens: int
    lower_us: Optional[float]
    upper_us: Optional[float]
    winner: str                     # "lower" | "upper"

    def as_dict(self):
        return asdict(self)


@dataclass
class Edge:
    lower_hi: int
    upper_hi: int
    edge: int                       # largest token count served by the lower band's winner
    probes: list = field(default_factory=list)
    converged: bool = True          # interval reached the tolerance (not cut by max_probes)
    tolerance: int = 0

    @property
    def refined(self) -> bool:
        return bool(self.probes)


def tolerance(lower_hi: int, upper_hi: int, *, min_tokens: int = MIN_TOKENS,
              frac: float = FRACTION) -> int:
    return max(1, min_tokens, math.ceil((upper_hi - lower_hi) * frac))


def _as_probe(tokens: int, got) -> Probe:
    if isinstance(got, Probe):
        return got
    lo_us, up_us = got
    return Probe(tokens, lo_us, up_us, "lower" if lo_us <= up_us else "upper")


def find_edge(lower_hi: int, upper_hi: int, measure: Callable[[int], object], *,
              min_tokens: int = MIN_TOKENS, frac: float = FRACTION,
              max_probes: int = MAX_PROBES) -> Edge:
    """Bisect ``(lower_hi, upper_hi)`` for the crossover between the lower band's winner
    (known to win at ``lower_hi``) and the upper band's (known to win at ``upper_hi``).

    ``measure(tokens)`` returns ``(lower_us, upper_us)`` or a :class:`Probe` (whose
    ``winner`` then decides); it may raise :class:`ProbeFailed`. Returns the edge: tokens
    ``<= edge`` go to the lower winner. With no probe taken (the interval is already within
    the tolerance) the edge stays ``lower_hi``.
    """
    if upper_hi <= lower_hi:
        raise ValueError(f"upper_hi {upper_hi} must be above lower_hi {lower_hi}")
    tol = tolerance(lower_hi, upper_hi, min_tokens=min_tokens, frac=frac)
    a, b = lower_hi, upper_hi
    probes: list[Probe] = []
    while b - a > tol and len(probes) < max_probes:
        m = (a + b) // 2
        p = _as_probe(m, measure(m))
        probes.append(p)
        if p.winner == "lower":
            a = m
        else:
            b = m
    if not probes:
        return Edge(lower_hi, upper_hi, lower_hi, [], b - a <= tol, tol)
    return Edge(lower_hi, upper_hi, (a + b) // 2, probes, b - a <= tol, tol)


def pick_us(p: dict | Probe, edge: int) -> Optional[float]:
    """The time of what a table with this edge runs at the probe's token count."""
    p = p if isinstance(p, dict) else p.as_dict()
    return p["lower_us"] if p["tokens"] <= edge else p["upper_us"]


def oracle_gap(probes: list, edge_before: int, edge_after: int, weight: float = 1.0) -> dict:
    """Weighted sums over the probe points: the frozen pick with the coarse edge, with the
    refined edge, and the better of the two candidates at each point."""
    before = after = best = 0.0
    for p in probes:
        p = p if isinstance(p, dict) else p.as_dict()
        if p["lower_us"] is None or p["upper_us"] is None:
            continue
        before += weight * pick_us(p, edge_before)
        after += weight * pick_us(p, edge_after)
        best += weight * min(p["lower_us"], p["upper_us"])
    return {"before_us": before, "after_us": after, "oracle_us": best,
            "gap_before": (before / best - 1) if best else None,
            "gap_after": (after / best - 1) if best else None}


# ---- pairs of bands -----------------------------------------------------------------------

def adjacent_pairs(winners: list[dict]) -> list[tuple[dict, dict]]:
    """(lower, upper) winner rows of consecutive bands of one table with different winners."""
    tables: dict = {}
    for w in winners:
        tables.setdefault((w["op"], w["signature"], w["dtype"]), []).append(w)
    out = []
    for key in sorted(tables):
        ws = sorted(tables[key], key=lambda r: r["band_hi"])
        for lo, up in zip(ws, ws[1:]):
            if lo["impl_id"] != up["impl_id"] and lo["band_hi"] + 1 == up["band_lo"]:
                out.append((lo, up))
    return out


def crossover_valid(c: dict, lower: dict, upper: dict) -> bool:
    """A stored crossover applies to these two winner rows only if nothing it assumed has
    changed: the same bands, the same two winners, the same software stack."""
    return (c["lower_hi"] == lower["band_hi"] and c["upper_hi"] == upper["band_hi"]
            and c["impl_below"] == lower["impl_id"] and c["impl_above"] == upper["impl_id"]
            and c["stack_key"] == lower.get("stack_key") == upper.get("stack_key")
            and lower["band_hi"] <= c["edge_tokens"] < upper["band_hi"])


# ---- the driver ---------------------------------------------------------------------------

def _settings_of_run(db, run_id, device_type: str) -> Settings:
    """The race settings the calibration run used (a probe is timed as its bands were)."""
    row = next((r for r in db.runs() if r["id"] == run_id), None)
    s = json.loads(row["settings"]) if row and row.get("settings") else {}
    known = set(Settings().__dict__)
    out = Settings(**{k: v for k, v in s.items() if k in known})
    out.device = device_type
    return out


def _available(registry, op: str, impl_id: str) -> bool:
    try:
        registry.get(op, impl_id)
        return True
    except KeyError:
        return False


def _winners_to_refine(db, db_path, row, ops, model) -> list[dict]:
    """The device's winner rows, narrowed to ``ops`` (each must have winners) and to the
    tables of ``model``'s workload."""
    winners = db.winners(row["device_key"], row["driver"])
    if ops:
        unknown = set(ops) - {w["op"] for w in winners}
        if unknown:
            raise DBError(f"--ops {','.join(sorted(unknown))}: no winners in {db_path} for "
                          f"{row['name']} (ops there: "
                          f"{', '.join(sorted({w['op'] for w in winners}))})")
        winners = [w for w in winners if w["op"] in ops]
    if model:
        keys = {(i.op, i.signature, i.dtype) for i in derive(model).items}
        winners = [w for w in winners if (w["op"], w["signature"], w["dtype"]) in keys]
    return winners


def _pair_record(lower: dict, upper: dict) -> dict:
    return {"op": lower["op"], "signature": lower["signature"], "dtype": lower["dtype"],
            "lower_lo": lower["band_lo"], "lower_hi": lower["band_hi"],
            "upper_lo": upper["band_lo"], "upper_hi": upper["band_hi"],
            "impl_below": lower["impl_id"], "impl_above": upper["impl_id"],
            "weight": upper["weight"] or 1, "old_edge": lower["band_hi"],
            "new_edge": None, "probes": [], "converged": None,
            "gap_before": None, "gap_after": None, "status": None, "reason": None}


def _prober(pool, rec: dict, impls, dims: dict, dt, settings: Settings,
            progress: Optional[Callable]) -> Callable[[int], tuple]:
    """``measure(tokens)`` for :func:`find_edge`: the pair raced by the one race loop at
    that token count (in the worker when isolating); raises :class:`ProbeFailed` unless
    both were timed."""
    def measure(tokens):
        v = pool.race(rec["op"], dims, dt, Band(tokens, tokens), impls, settings)
        got = {o.impl.impl_id: o for o in v.outcomes}
        times = []
        for iid in (rec["impl_below"], rec["impl_above"]):
            o = got.get(iid)
            if o is None or o.outcome != "timed" or o.timing is None:
                why = o.reason if o is not None else "not run"
                raise ProbeFailed(f"{iid} at {tokens} tokens: "
                                  f"{o.outcome if o else 'missing'} ({why})")
            times.append(o.timing.median_us)
        if progress:
            progress("probe", op=rec["op"], tokens=tokens, times=times)
        return tuple(times)
    return measure


def _refine_pair(db, row, run_id, skey, registry, pool, lower, upper, stored, *,
                 force, min_tokens, frac, max_probes, progress) -> dict:
    """One pair of adjacent bands: skipped (stack changed), cached (a valid stored
    crossover), failed (a candidate missing or a probe failing), narrow (already within
    the tolerance) or refined (the edge written to the DB)."""
    rec = _pair_record(lower, upper)
    old = stored.get((lower["op"], lower["signature"], lower["dtype"], lower["band_hi"]))
    if lower["stack_key"] != skey or upper["stack_key"] != skey:
        rec["status"], rec["reason"] = "skipped", (
            "software stack changed since these bands were calibrated; re-measure with "
            f"`{calibrate_hint(db, row['device_key'], row['driver'])}` first (a crossover "
            "measured with another stack would not describe these winners)")
        return rec
    if old is not None and not force and crossover_valid(old, lower, upper):
        rec.update({"new_edge": old["edge_tokens"], "probes": old["probes"],
                    "converged": bool(old["converged"]), "status": "cached"})
        return rec
    missing = [i for i in (lower["impl_id"], upper["impl_id"])
               if not _available(registry, lower["op"], i)]
    if missing:
        rec["status"], rec["reason"] = "failed", (
            f"{', '.join(missing)} not available on this machine (backend not installed?)")
        return rec
    impls = [registry.get(lower["op"], lower["impl_id"]),
             registry.get(upper["op"], upper["impl_id"])]
    settings = _settings_of_run(db, upper["run_id"], row["device_type"])
    measure = _prober(pool, rec, impls, json.loads(lower["dims"]),
                      dtype_from_name(lower["dtype"]), settings, progress)
    try:
        e = find_edge(lower["band_hi"], upper["band_hi"], measure,
                      min_tokens=min_tokens, frac=frac, max_probes=max_probes)
    except ProbeFailed as ex:
        rec["status"], rec["reason"] = "failed", str(ex)
        return rec
    rec.update({"new_edge": e.edge, "probes": [p.as_dict() for p in e.probes],
                "converged": e.converged, "tolerance": e.tolerance})
    if not e.refined:
        rec["status"] = "narrow"
        rec["reason"] = (f"band width {upper['band_hi'] - lower['band_hi']} "
                         f"within the tolerance {e.tolerance}: edge kept")
        return rec
    rec["status"] = "refined"
    g = oracle_gap(rec["probes"], lower["band_hi"], e.edge, 1)
    db.record_crossover({
        "device_key": row["device_key"], "driver": row["driver"],
        "stack_key": skey, "op": rec["op"], "signature": rec["signature"],
        "dtype": rec["dtype"], "lower_hi": lower["band_hi"],
        "upper_hi": upper["band_hi"], "impl_below": rec["impl_below"],
        "impl_above": rec["impl_above"], "edge_tokens": e.edge,
        "converged": int(e.converged), "probes": rec["probes"],
        "gap_before": g["gap_before"], "gap_after": g["gap_after"],
        "weight": rec["weight"], "run_id": run_id})
    return rec


def refine(db_path: str, *, device: Optional[str] = None, ops: Optional[list] = None,
           model: Optional[str] = None, force: bool = False, max_probes: int = MAX_PROBES,
           min_tokens: int = MIN_TOKENS, frac: float = FRACTION, isolate: bool = True,
           candidate_timeout: float = 120.0, manager=None,
           progress: Optional[Callable] = None) -> dict:
    """Refine every adjacent pair of differing winners of this machine's device in the DB
    (optionally only ``ops`` / the tables of ``model``'s workload); write the edges into
    the ``crossovers`` table. Returns a JSON-able document (``fltune refine --json``)."""
    from ..dispatch.manager import get_default_manager

    t0 = time.perf_counter()
    registry = (manager or get_default_manager()).registry
    # find the device with a reader first: a writer would migrate a file that holds no
    # calibration for this device (an empty file would become an fltune DB) before refusing
    reader = CalibrationDB(db_path, create=False)
    try:
        device_row_for_this_machine(reader, device)
    finally:
        reader.close()
    db = CalibrationDB(db_path, create=False, write=True)
    pool = None
    run_id = None
    status = "failed"
    try:
        row, me, notes = device_row_for_this_machine(db, device)
        if row["driver"] != me["driver"]:
            raise DBError(f"{db_path}: calibrated with driver {row['driver']}, this machine runs "
                          f"{me['driver']}; refine times the calibrated winners and needs the "
                          f"same driver (calibrate this driver first)")
        stack = devmod.stack()
        skey = devmod.stack_key(stack)
        pairs = adjacent_pairs(_winners_to_refine(db, db_path, row, ops, model))
        stored = {(c["op"], c["signature"], c["dtype"], c["lower_hi"]): c
                  for c in db.crossovers(row["device_key"], row["driver"])}
        settings_doc = {"max_probes": max_probes, "min_tokens": min_tokens, "frac": frac,
                        "isolate": isolate, "force": force}
        run_id = db.start_refine(row, settings_doc, stack, skey)
        if progress:
            progress("start", total=len(pairs))
        pool = racer(isolate and bool(pairs), candidate_timeout)
        records = []
        for lower, upper in pairs:
            rec = _refine_pair(db, row, run_id, skey, registry, pool, lower, upper, stored,
                               force=force, min_tokens=min_tokens, frac=frac,
                               max_probes=max_probes, progress=progress)
            if rec["probes"] and rec["new_edge"] is not None:
                g = oracle_gap(rec["probes"], rec["old_edge"], rec["new_edge"], 1)
                rec["gap_before"], rec["gap_after"] = g["gap_before"], g["gap_after"]
            records.append(rec)
            if progress:
                progress("pair", record=rec)
        status = "done"
    finally:
        if pool is not None:
            pool.close()
        if run_id is not None:
            db.finish_refine(run_id, status)
        db.close()
    return {"format": "fltune.refine/1", "db": str(db_path), "run_id": run_id,
            "device": {k: row[k] for k in ("device_key", "name", "driver", "device_type")},
            "stack_key": skey, "notes": notes, "settings": settings_doc,
            "pairs": records, "summary": summarize(records),
            "wall_s": round(time.perf_counter() - t0, 3)}


def summarize(records: list[dict]) -> dict:
    """Workload-weighted oracle gap over every probe point of every pair (each point
    weighted by its table's calls per step)."""
    before = after = best = 0.0
    for r in records:
        if r["probes"] and r["new_edge"] is not None:
            g = oracle_gap(r["probes"], r["old_edge"], r["new_edge"], r["weight"])
            before += g["before_us"]
            after += g["after_us"]
            best += g["oracle_us"]
    by = {}
    for r in records:
        by[r["status"]] = by.get(r["status"], 0) + 1
    moved = [r for r in records if r["new_edge"] is not None and r["new_edge"] != r["old_edge"]]
    return {"pairs": len(records), "status": by, "edges_moved": len(moved),
            "probes": sum(len(r["probes"]) for r in records if r["status"] == "refined"),
            "weighted_before_us": before, "weighted_after_us": after,
            "weighted_oracle_us": best,
            "gap_before": (before / best - 1) if best else None,
            "gap_after": (after / best - 1) if best else None}
