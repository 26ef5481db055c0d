"""``fltune bench``: what the calibrated selection is worth, measured now, side by side.

For every (op, shape, dtype, token band) of a model's workload, one interleaved timing race
(``tune.timing.time_candidates``: round r times every candidate once before round r+1) of
every qualified candidate on fresh inputs at the band's measured size (its top edge). From
that one race the bench reads off, per band:

- **manifest**: the implementation the frozen manifest (built from the DB for this device,
  exactly as serving freezes it) dispatches these arguments to — ``FrozenDispatch.select``,
  so shadowed signatures and the fallback behave as they do in serving;
- **fl**: the fixed FL order's pick — the first *qualified* candidate in policy order
  (what vllm-plugin-FL runs; it does not check parity; like ``OpManager.call_op`` under a
  non-strict policy, past a candidate that raises);
- **every single backend**, each as it is;
- **oracle**: the fastest parity-passing candidate *of this run* — independent of the
  calibration's numbers (as the minimum of several noisy medians it is, if anything,
  slightly optimistic, which makes "within x % of the oracle" a conservative test).

Each candidate passes parity on these inputs before it can be the oracle; a candidate that
fails parity is still timed and shown (FL would run it), flagged.

Bandwidth: every time is turned into GB/s with the op's own byte count
(``OpSpec.bytes_moved``) and divided by the copy bandwidth measured on the same device in
the same run (``dst.copy_(src)`` on a buffer far larger than the caches, timed with the same
timer, before and after the races; the better of the two is the limit).

Workload totals: per mix (decode: batch 1, 8, 32, 128; prefill: 2048 and 8192 tokens —
counts above the largest band are clamped to it, as the band rule does, and de-duplicated),
the sum over the workload's ops of calls-per-step x the per-call time in the band the token
count falls in, for each pick.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..dispatch.frozen import FrozenDispatch
from ..dispatch.manifest import Manifest
from ..dispatch.policy import SelectionPolicy, fl_pick
from ..freeze import build_manifest
from ..ops import DTYPE_NAMES, dtype_from_name, get_op
from ..store import CalibrationDB
from ..store import device as devmod
from ..store.device import device_row_for_this_machine
from ..tune import parity, timing
from ..tune.bands import band_of, bands, max_tokens_for
from ..tune.race import Settings
from ..tune.worker import racer
from ..tune.workload import derive

DECODE_MIX = (1, 8, 32, 128)
PREFILL_MIX = (2048, 8192)
#: copy buffer size per device type (MiB): far above any L2/LLC, so the copy streams DRAM/HBM
DEFAULT_COPY_MIB = {"cuda": 1024, "cpu": 256}
#: the issue's goals, evaluated in the output (never asserted by the tool)
GOAL_ORACLE_GAP = 0.02
GOAL_SHARE = 0.85
GOAL_SHARE_FROM_TOKENS = 4096


@dataclass
class BenchSettings:
    device: str = "cpu"
    reps: int = 0                  # 0 = adaptive (budget_s per candidate)
    budget_s: float = 0.05
    graph_calls: int = 20
    cold_l2: bool = False          # eager cold-L2 timing above 512 tokens (CUDA)
    parity_floor: float = parity.PARITY_FLOOR
    copy_mib: Optional[int] = None
    seed: int = 0

    def as_dict(self):
        d = dict(self.__dict__)
        d["copy_mib"] = self.copy_mib or DEFAULT_COPY_MIB.get(self.device, 256)
        return d


# ---- device / DB ------------------------------------------------------------------------

def _device_arg(row: dict) -> str:
    """The ``--device`` that makes build_manifest freeze exactly ``row``: KEY@DRIVER."""
    return f"{row['device_key']}@{row['driver']}"


def copy_bandwidth(device: str, mib: int, *, reps: int = 0, budget_s: float = 0.05,
                   graph_calls: int = 20) -> dict:
    """GB/s of ``dst.copy_(src)`` over ``mib`` MiB (read + write counted), with the same
    timer the candidates get."""
    n = int(mib) * 2**20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timing.time_candidates({"copy": lambda: dst.copy_(src)}, device, reps=reps,
                               budget_s=max(budget_s, 0.05),
                               graph_calls=min(graph_calls, 5) if device == "cuda" else graph_calls)
    t = t["copy"]
    if not isinstance(t, timing.Timing):
        raise RuntimeError(f"timing the copy failed: {t}")
    del src, dst
    return {"bytes": 2 * n, "mib": mib, "median_us": t.median_us, "p10_us": t.p10_us,
            "gbps": 2 * n / (t.median_us * 1e-6) / 1e9,
            "gbps_best": 2 * n / (t.p10_us * 1e-6) / 1e9, "timer": t.timer}


# ---- the bench --------------------------------------------------------------------------

def _pick(name_or_none, cands):
    if name_or_none is None:
        return None
    c = cands.get(name_or_none)
    return {"impl_id": name_or_none, "us": c.get("median_us") if c else None,
            "parity_ok": c.get("parity_ok") if c else None}


def _race_settings(settings: BenchSettings) -> Settings:
    """The race settings of a bench: parity-failing candidates are timed too (FL would run
    them), so the bench can show what they cost."""
    return Settings(device=settings.device, parity_floor=settings.parity_floor,
                    cold_l2=settings.cold_l2, reps=settings.reps, budget_s=settings.budget_s,
                    graph_calls=settings.graph_calls, seed=settings.seed, time_failing=True)


def _candidate(o, nbytes: int) -> dict:
    """One race outcome as the bench document's candidate record."""
    if o.outcome in ("unqualified", "refused"):     # did not qualify, or raised
        return {"outcome": o.outcome, "reason": o.reason}
    p, t = o.parity, o.timing
    c = {"outcome": "timed", "parity": p.score, "parity_ok": p.passed,
         "rel_error": p.rel_error if math.isfinite(p.rel_error) else None,
         "reason": p.reason}
    if t is not None:
        c.update({"median_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us,
                  "n": t.n, "noise": t.noise, "timer": t.timer,
                  "gbps": nbytes / (t.median_us * 1e-6) / 1e9 if t.median_us else None})
    return c


def bench_band(op: str, dims: dict, dtype: torch.dtype, band, impls, policy: SelectionPolicy,
               fd: Optional[FrozenDispatch], manifest: Optional[dict],
               settings: BenchSettings, pool=None) -> dict:
    """One (op, shape, dtype, band): every qualified candidate in one interleaved race (the
    one race loop, ``tune/race.py``; in the supervised worker when ``pool`` is one)."""
    spec = get_op(op)
    nbytes = spec.bytes_moved(band.tokens, dims, dtype)
    v = (pool or racer(False)).race(op, dims, dtype, band, impls, _race_settings(settings))
    cands = {o.impl.impl_id: _candidate(o, nbytes) for o in v.outcomes}
    cold = settings.cold_l2 and band.tokens > 512
    # the fixed FL order's pick (``dispatch.policy.fl_pick``): the first qualified candidate
    # in policy order; like OpManager.call_op, a non-strict policy falls back past one that
    # raises
    fl, fl_skipped = fl_pick(policy, op, impls,
                             lambda iid: cands.get(iid, {}).get("outcome"))
    # the manifest's pick: what frozen dispatch runs for exactly these arguments (its
    # lookup reads only the key argument's dtype and shape)
    man, source = None, "op not in manifest"
    if fd is not None and op in fd.ops():
        args = spec.make_inputs(band.tokens, dims, dtype, settings.device,
                                torch.Generator().manual_seed(settings.seed))
        x = args[spec.key_arg]
        man = fd.select(op, *args).impl_id
        typed = Manifest.from_json(manifest, verify=False)
        source = ("table" if typed.table_for(op, DTYPE_NAMES.get(x.dtype), x.shape[1:])
                  else "fallback")
        del args, x
    good = {k: c for k, c in cands.items() if c.get("median_us") and c.get("parity_ok")}
    oracle = min(good, key=lambda k: good[k]["median_us"]) if good else None
    rec = {"op": op, "dims": dims, "dtype": DTYPE_NAMES[dtype], "band_lo": band.lo,
           "band_hi": band.hi, "tokens": band.tokens, "bytes": nbytes, "cold_l2": cold,
           "candidates": cands, "manifest": _pick(man, cands), "manifest_source": source,
           "fl": _pick(fl, cands), "fl_fell_back_from": fl_skipped,
           "oracle": _pick(oracle, cands)}
    rec["ratios"] = _ratios(rec)
    return rec


def _ratios(rec: dict) -> dict:
    cands = rec["candidates"]
    m = rec["manifest"]
    mu = m["us"] if m else None
    fl_us = rec["fl"]["us"] if rec["fl"] else None
    or_us = rec["oracle"]["us"] if rec["oracle"] else None
    out = {"manifest_vs_oracle": (mu / or_us) if mu and or_us else None,
           "fl_vs_oracle": (fl_us / or_us) if fl_us and or_us else None,
           "speedup_vs_fl": (fl_us / mu) if mu and fl_us else None,
           "backend_vs_manifest": {k: c["median_us"] / mu for k, c in cands.items()
                                   if c.get("median_us") and mu}}
    # "slower than X beyond the measured noise": the larger of the two candidates' spread
    worse = []
    if mu:
        mn = cands[m["impl_id"]].get("noise") or 0.0
        for k, c in cands.items():
            if k == m["impl_id"] or not c.get("median_us") or not c.get("parity_ok"):
                continue
            noise = max(mn, c.get("noise") or 0.0)
            if mu > c["median_us"] * (1 + noise):
                worse.append({"than": k, "ratio": mu / c["median_us"], "noise": noise,
                              "is_fl": rec["fl"] is not None and k == rec["fl"]["impl_id"]})
    out["manifest_slower_beyond_noise"] = worse
    return out


def _shares(rec: dict, copy_gbps: float) -> None:
    for c in rec["candidates"].values():
        if c.get("gbps"):
            c["copy_share"] = c["gbps"] / copy_gbps
    for key in ("manifest", "fl", "oracle"):
        p = rec[key]
        if p and p["us"]:
            p["gbps"] = rec["bytes"] / (p["us"] * 1e-6) / 1e9
            p["copy_share"] = p["gbps"] / copy_gbps


def mix_totals(records: list[dict], items: list, band_list, requested, copy_gbps) -> dict:
    """Workload-weighted per-step time of each pick over a token mix (clamped, deduped)."""
    top = band_list[-1].hi
    counts = []
    for n in requested:
        c = min(n, top)
        if c not in counts:
            counts.append(c)
    idx = {(r["op"], r["signature"], r["dtype"], r["band_hi"]): r for r in records}
    impl_ids = sorted({k for r in records for k, c in r["candidates"].items()
                       if c.get("median_us")})
    keys = ["manifest", "fl", "oracle"] + impl_ids
    totals = {k: 0.0 for k in keys}
    bytes_total = 0
    missing = {k: [] for k in keys}
    per_count = []
    for n in counts:
        b = band_of(n, band_list)
        step = {k: 0.0 for k in keys}
        for it in items:
            r = idx.get((it.op, it.signature, it.dtype, b.hi))
            if r is None:
                continue
            bytes_total += it.calls * r["bytes"]
            for k in keys:
                if k in ("manifest", "fl", "oracle"):
                    us = r[k]["us"] if r[k] else None
                else:
                    us = r["candidates"].get(k, {}).get("median_us")
                if us is None:
                    missing[k].append(f"{it.op}[{it.signature}]@{b.hi}")
                else:
                    step[k] += it.calls * us
        per_count.append({"tokens": n, "band_hi": b.hi,
                          "step_us": {k: (v if not missing[k] else None) for k, v in step.items()}})
        for k in keys:
            totals[k] += step[k]
    tot = {k: (v if not missing[k] else None) for k, v in totals.items()}
    m, o, f = tot["manifest"], tot["oracle"], tot["fl"]
    return {"requested": list(requested), "tokens": counts, "total_us": tot,
            "missing": {k: v for k, v in missing.items() if v},
            "manifest_vs_oracle": (m / o) if m and o else None,
            "fl_vs_oracle": (f / o) if f and o else None,
            "speedup_vs_fl": (f / m) if m and f else None,
            "backend_vs_manifest": {k: tot[k] / m for k in impl_ids if tot[k] and m},
            "manifest_copy_share": (bytes_total / (m * 1e-6) / 1e9 / copy_gbps) if m else None,
            "per_tokens": per_count}


def run_bench(model: str, db_path: str, *, tp: int = 1, dtype: Optional[str] = None,
              max_tokens: Optional[int] = None, settings: Optional[BenchSettings] = None,
              ops: Optional[list] = None, device: Optional[str] = None, manager=None,
              policy: Optional[SelectionPolicy] = None, isolate: bool = False,
              candidate_timeout: float = 120.0,
              progress: Optional[Callable] = None) -> dict:
    """``isolate``: race in the supervised worker (``tune/worker.py``), as calibrate does;
    the CLI turns it on (``--no-isolate`` turns it off). ``device`` (``KEY |
    NAME[@DRIVER]``) picks the DB's row to freeze; it must be this machine's device."""
    from ..dispatch.manager import get_default_manager

    t0 = time.perf_counter()
    settings = settings or BenchSettings()
    workload = derive(model, tp=tp, dtype=dtype)
    if ops:
        workload.restrict(ops)
    max_tokens = max_tokens_for(settings.device, max_tokens)
    band_list = bands(max_tokens)
    manager = manager or get_default_manager()
    registry = manager.registry
    policy = policy or SelectionPolicy.from_env()
    db = CalibrationDB(db_path, create=False)
    try:
        row, me, notes = device_row_for_this_machine(db, device, settings.device)
        dev_arg = _device_arg(row)
    finally:
        db.close()
    manifest, warnings = build_manifest(db_path, device=dev_arg, policy=policy,
                                        registry=registry)
    warnings = notes + warnings
    fd = FrozenDispatch(manifest, registry)
    for it in workload.items:
        if it.op not in manifest["ops"]:
            warnings.append(f"{it.op} is not in the manifest (the DB was calibrated for another "
                            f"model?): its bands have no manifest pick")
    copy_mib = settings.copy_mib or DEFAULT_COPY_MIB.get(settings.device, 256)
    copies = [copy_bandwidth(settings.device, copy_mib, reps=settings.reps,
                             budget_s=settings.budget_s, graph_calls=settings.graph_calls)]
    # an item capped below the top band (the LM head, gdn_decode's sequences) is not served
    # there, as calibrate leaves those bands out
    tasks = [(it, b) for it in workload.items for b in band_list
             if it.max_tokens is None or b.lo <= it.max_tokens]
    if progress:
        progress("start", total=len(tasks))
    records = []
    with racer(isolate and bool(tasks), candidate_timeout) as pool:
        for it, b in tasks:
            impls = registry.get_implementations(it.op)
            rec = bench_band(it.op, it.dims_dict, dtype_from_name(it.dtype), b, impls, policy,
                             fd, manifest, settings, pool)
            rec["signature"] = it.signature
            rec["weight"] = it.calls
            rec["where"] = it.where
            records.append(rec)
            if progress:
                progress("band", op=it.op, band=b, record=rec)
    copies.append(copy_bandwidth(settings.device, copy_mib, reps=settings.reps,
                                 budget_s=settings.budget_s, graph_calls=settings.graph_calls))
    copy_gbps = max(c["gbps"] for c in copies)
    for r in records:
        _shares(r, copy_gbps)
    mixes = {"decode": mix_totals(records, workload.items, band_list, DECODE_MIX, copy_gbps),
             "prefill": mix_totals(records, workload.items, band_list, PREFILL_MIX, copy_gbps)}
    doc = {"format": "fltune.bench/1",
           "model": workload.model, "tp": tp, "dtype": workload.dtype,
           "db": str(db_path), "device": me, "db_device": row,
           "manifest_fingerprint": manifest["fingerprint"], "policy": policy.to_dict(),
           "stack": devmod.stack(), "settings": settings.as_dict(), "max_tokens": max_tokens,
           "bands": [b.hi for b in band_list], "warnings": warnings,
           "copy": {"gbps": copy_gbps, "runs": copies}, "records": records, "mixes": mixes}
    doc["goals"] = goals(doc)
    doc["wall_s"] = round(time.perf_counter() - t0, 3)
    return doc


def goals(doc: dict) -> dict:
    """The issue's goals, evaluated on this run's figures (reported, never asserted)."""
    viol = []
    for r in doc["records"]:
        for w in r["ratios"]["manifest_slower_beyond_noise"]:
            viol.append({"op": r["op"], "signature": r["signature"], "band_hi": r["band_hi"],
                         "manifest": r["manifest"]["impl_id"], **w})
    gaps = {name: m["manifest_vs_oracle"] for name, m in doc["mixes"].items()}
    big = [r for r in doc["records"] if r["band_hi"] >= GOAL_SHARE_FROM_TOKENS]
    shares = [(r["manifest"] or {}).get("copy_share") for r in big]
    low = [{"op": r["op"], "signature": r["signature"], "band_hi": r["band_hi"],
            "manifest": r["manifest"]["impl_id"] if r["manifest"] else None,
            "copy_share": s} for r, s in zip(big, shares) if s is None or s < GOAL_SHARE]
    return {
        "manifest_never_slower_beyond_noise": {
            "met": not viol, "bands_checked": len(doc["records"]), "violations": viol,
            "violations_vs_fl": sum(1 for v in viol if v["is_fl"])},
        "workload_within_2pct_of_oracle": {
            "met": (None if any(g is None for g in gaps.values()) else
                    all(g <= 1 + GOAL_ORACLE_GAP for g in gaps.values())),
            "manifest_vs_oracle": gaps},
        "share_of_copy_from_4096_tokens": {
            "met": (not low) if big else None, "goal": GOAL_SHARE,
            "bands_checked": len(big),
            "min": min((s for s in shares if s is not None), default=None), "below": low},
    }
