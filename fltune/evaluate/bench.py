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

from . import device as devmod
from .dispatch.frozen import FrozenDispatch
from .dispatch.policy import SelectionPolicy
from .dispatch.types import QualifyContext
from .ops import DTYPE_NAMES, clone_args, dtype_from_name, get_op
from .store import CalibrationDB, DBError
from .tune import parity, timing
from .tune.bands import DEFAULT_MAX_TOKENS, band_of, bands
from .tune.workload import derive

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

def device_row_for_this_machine(db: CalibrationDB, device_type: str,
                                device: Optional[str] = None) -> tuple[dict, dict, list[str]]:
    """(DB device row, this machine's record, notes): the DB's calibration of *this*
    device. ``device`` (key prefix or name) picks among the DB's rows, but it must still
    be this machine's device, because measuring needs the hardware. A different driver of
    the same device is accepted, with a note (that is exactly what verify is for)."""
    me = devmod.current(device_type)
    rows = db.devices()
    have = "; ".join(f"{r['name']} [{r['device_key']}] driver {r['driver']}" for r in rows) or "none"
    if device is not None:
        cand = [r for r in rows if r["device_key"].startswith(device.split("@")[0]) or
                device.lower() in r["name"].lower()]
        if "@" in device:
            cand = [r for r in cand if r["driver"] == device.split("@", 1)[1]]
    else:
        cand = [r for r in rows if r["device_key"] == me["device_key"]]
    mine = [r for r in cand if r["device_key"] == me["device_key"]]
    if not mine:
        what = f"--device {device!r} matches no calibration of" if device else "holds no calibration for"
        raise DBError(f"{db.path} {what} this machine's device ({devmod.label(me)} "
                      f"[{me['device_key']}]); measuring needs the device itself. Devices in "
                      f"it: {have}")
    same = [r for r in mine if r["driver"] == me["driver"]]
    notes = []
    if same:
        row = same[0]
    else:
        row = max(mine, key=lambda r: r.get("last_run") or 0)
        notes.append(f"driver changed: calibrated with {row['driver']}, running {me['driver']}")
    return row, me, notes


def _device_arg(db: CalibrationDB, row: dict) -> Optional[str]:
    """What build_manifest's --device needs to find ``row`` (None = this machine's)."""
    same_key = [r for r in db.devices() if r["device_key"] == row["device_key"]]
    return row["device_key"] if len(same_key) == 1 else None


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


def _manifest_table(manifest: dict, op: str, x: torch.Tensor) -> Optional[dict]:
    entry = manifest["ops"].get(op)
    if entry is None:
        return None
    dt = DTYPE_NAMES.get(x.dtype)
    for t in entry["tables"]:
        if t["dtype"] == dt and list(t["trailing"]) == list(x.shape[1:]):
            return t
    return None


def bench_band(op: str, dims: dict, dtype: torch.dtype, band, impls, policy: SelectionPolicy,
               fd: Optional[FrozenDispatch], manifest: Optional[dict],
               settings: BenchSettings) -> dict:
    """One (op, shape, dtype, band): every qualified candidate in one interleaved race."""
    spec = get_op(op)
    dev = settings.device
    cap = torch.cuda.get_device_capability() if dev == "cuda" else None
    ctx = QualifyContext(dev, dtype, cap)
    gen = torch.Generator().manual_seed(settings.seed)
    args = spec.make_inputs(band.tokens, dims, dtype, dev, gen)
    nbytes = spec.bytes_moved(band.tokens, dims, dtype)
    ref = parity.reference_outputs(spec, args)
    cands: dict = {}
    calls = {}
    for impl in impls:
        why = impl.qualify(ctx)
        if why is not None:
            cands[impl.impl_id] = {"outcome": "unqualified", "reason": why}
            continue
        p = parity.check(spec, impl.fn, args, dtype, reference=ref, floor=settings.parity_floor)
        if p.reason and p.reason.startswith("raised"):
            cands[impl.impl_id] = {"outcome": "refused", "reason": p.reason}
            continue
        cands[impl.impl_id] = {"outcome": "timed", "parity": p.score, "parity_ok": p.passed,
                               "rel_error": p.rel_error if math.isfinite(p.rel_error) else None,
                               "reason": p.reason}
        own = clone_args(args)
        calls[impl.impl_id] = (lambda fn=impl.fn, a=own: fn(*a))
    del ref
    cold = settings.cold_l2 and band.tokens > 512
    times = timing.time_candidates(calls, dev, reps=settings.reps, budget_s=settings.budget_s,
                                   graph_calls=settings.graph_calls, cold_l2=cold) if calls else {}
    for name, t in times.items():
        c = cands[name]
        if isinstance(t, timing.Timing):
            c.update({"median_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us,
                      "n": t.n, "noise": t.noise, "timer": t.timer,
                      "gbps": nbytes / (t.median_us * 1e-6) / 1e9 if t.median_us else None})
        else:
            c.update({"outcome": "refused", "reason": f"raised while timing: "
                                                      f"{type(t).__name__}: {t}"})
    # the fixed FL order's pick: the first qualified candidate in policy order (FL checks no
    # parity); like OpManager.call_op, a non-strict policy falls back past one that raises
    fl, fl_skipped = None, []
    for i in policy.order(op, impls):
        out = cands.get(i.impl_id, {}).get("outcome")
        if out == "unqualified":
            continue
        if out == "refused" and not policy.strict:
            fl_skipped.append(i.impl_id)
            continue
        fl = i.impl_id
        break
    # the manifest's pick: what frozen dispatch runs for exactly these arguments
    man, source = None, "op not in manifest"
    if fd is not None and op in fd.ops():
        man = fd.select(op, *args).impl_id
        source = "table" if _manifest_table(manifest, op, args[spec.key_arg]) else "fallback"
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
              policy: Optional[SelectionPolicy] = None,
              progress: Optional[Callable] = None) -> dict:
    from .dispatch.manager import get_default_manager
    from .freeze import build_manifest

    t0 = time.perf_counter()
    settings = settings or BenchSettings()
    workload = derive(model, tp=tp, dtype=dtype)
    if ops:
        workload.restrict(ops)
    max_tokens = max_tokens or DEFAULT_MAX_TOKENS.get(settings.device, 2048)
    band_list = bands(max_tokens)
    manager = manager or get_default_manager()
    registry = manager.registry
    policy = policy or SelectionPolicy.from_env()
    db = CalibrationDB(db_path, create=False)
    try:
        row, me, notes = device_row_for_this_machine(db, settings.device, device)
        dev_arg = _device_arg(db, row)
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
    tasks = [(it, b) for it in workload.items for b in band_list]
    if progress:
        progress("start", total=len(tasks))
    records = []
    for it, b in tasks:
        impls = registry.get_implementations(it.op)
        rec = bench_band(it.op, it.dims_dict, dtype_from_name(it.dtype), b, impls, policy, fd,
                         manifest, settings)
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


# ---- screen -----------------------------------------------------------------------------

def _fmt_us(v):
    return "—" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _x(v, good_above=None):
    if v is None:
        return "—"
    s = f"{v:.2f}x"
    if good_above is not None and v > good_above:
        return f"[green]{s}[/]"
    return s


def render(doc: dict, console=None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from .report import short, wide_console

    if console is None:
        console = wide_console(170)
    d = doc["device"]
    console.print(f"[bold]fltune bench[/] — {doc['model']} {doc['dtype']} tp={doc['tp']} on "
                  f"{d['name']} [{d['device_key']}], manifest {doc['manifest_fingerprint'][:12]}; "
                  f"copy bandwidth {doc['copy']['gbps']:.1f} GB/s "
                  f"({doc['copy']['runs'][0]['mib']} MiB, same timer)")
    for w in doc["warnings"]:
        console.print(f"[yellow]warning:[/] {escape(w)}")
    impl_ids = sorted({k for r in doc["records"] for k, c in r["candidates"].items()
                       if c.get("median_us")})
    groups: dict = {}
    for r in doc["records"]:
        groups.setdefault((r["op"], r["signature"], r["dtype"]), []).append(r)
    for (op, sig, dt), rows in groups.items():
        t = Table(title=escape(f"{op}  [{sig}]  {dt}  ×{rows[0]['weight']}/step (µs per call)"),
                  title_justify="left")
        t.add_column("tokens", justify="right")
        t.add_column("manifest", justify="left")
        t.add_column("FL", justify="left")
        t.add_column("oracle", justify="left")
        t.add_column("man/orc", justify="right")
        t.add_column("FL/man", justify="right")
        for i in impl_ids:
            t.add_column(short(i), justify="right")
        t.add_column("man GB/s", justify="right")
        t.add_column("% copy", justify="right")
        for r in rows:
            def pk(p):
                return "—" if not p else f"{short(p['impl_id'])} {_fmt_us(p['us'])}" + (
                    "" if p.get("parity_ok", True) else " [red](parity)[/]")
            mor = r["ratios"]["manifest_vs_oracle"]
            mor_s = _x(mor)
            if r["ratios"]["manifest_slower_beyond_noise"]:
                mor_s = f"[red]{mor_s}[/]"
            cells = []
            for i in impl_ids:
                c = r["candidates"].get(i, {})
                # · does not qualify here, ✗ raised, blank: the backend has no such op
                cells.append(_fmt_us(c.get("median_us")) if c.get("median_us") else
                             {"unqualified": "·", None: ""}.get(c.get("outcome"), "✗"))
            m = r["manifest"] or {}
            t.add_row(str(r["band_hi"]), pk(r["manifest"]), pk(r["fl"]), pk(r["oracle"]),
                      mor_s, _x(r["ratios"]["speedup_vs_fl"], 1.03), *cells,
                      "—" if not m.get("gbps") else f"{m['gbps']:.1f}",
                      "—" if not m.get("copy_share") else f"{m['copy_share']:.0%}")
        console.print(t)
    console.print("(µs per call; man/orc = manifest / oracle, red: slower than some candidate "
                  "beyond the measured noise; FL/man = speedup over the fixed FL order; "
                  "· = does not qualify here, ✗ = raised)")
    t = Table(title="workload-weighted per-step totals (µs; calls per step x per-call time)",
              title_justify="left")
    for c in ("mix", "tokens", "manifest", "FL", "oracle", "man/orc", "FL/man",
              *(f"{short(i)}/man" for i in impl_ids), "% copy"):
        t.add_column(c, justify="right" if c not in ("mix",) else "left")
    for name, m in doc["mixes"].items():
        tot = m["total_us"]
        t.add_row(name, ",".join(map(str, m["tokens"])), _fmt_us(tot["manifest"]),
                  _fmt_us(tot["fl"]), _fmt_us(tot["oracle"]), _x(m["manifest_vs_oracle"]),
                  _x(m["speedup_vs_fl"], 1.03),
                  *(_x(m["backend_vs_manifest"].get(i)) for i in impl_ids),
                  "—" if m["manifest_copy_share"] is None else f"{m['manifest_copy_share']:.0%}")
    console.print(t)
    g = doc["goals"]
    a = g["manifest_never_slower_beyond_noise"]
    b = g["workload_within_2pct_of_oracle"]
    c = g["share_of_copy_from_4096_tokens"]

    def ok(v):
        return "[green]met[/]" if v else ("—" if v is None else "[red]missed[/]")
    console.print(f"[bold]goals[/]: manifest never slower than FL / any backend beyond the noise: "
                  f"{ok(a['met'])} ({len(a['violations'])} of {a['bands_checked']} bands, "
                  f"{a['violations_vs_fl']} against FL)")
    console.print("       workload within 2 % of the oracle: " + ok(b["met"]) + " (" + ", ".join(
        f"{k} {('—' if v is None else f'{(v - 1):+.1%}')}" for k, v in b["manifest_vs_oracle"].items()) + ")")
    console.print(f"       ≥{GOAL_SHARE:.0%} of copy bandwidth from {GOAL_SHARE_FROM_TOKENS} tokens: "
                  f"{ok(c['met'])}" + ("" if c["min"] is None else f" (min {c['min']:.0%} over "
                                                                    f"{c['bands_checked']} bands)"))
