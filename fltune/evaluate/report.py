"""The report: what won where, by how much, against the fixed FL order.

Reads only the DB (and the registry, for FL kinds and priorities). Per op and shape, one row
per band: the winner and its time, the runner-up and the gap, what the fixed FL order picks
and its time, the speedup of measured over fixed, the winner's parity, and the achieved
bandwidth (bytes the op must move / time). The summary weights every band by its op's
calls per forward step (from the workload), so an op called 48 times a step counts 48 times.

Honest noise: each row carries its band's noise (the largest timing spread among the winner
and the two fastest candidates) and whether the band is **undecided** — its noise exceeds
both the time gap between the two fastest and the win margin, so the pick rests on
precision and the FL order, not on timing (``tune/noise.py``). A DB written before schema
3 has no stored flag; the same rule is applied to its stored measurements
(``undecided_source: "derived"``). The document ends with the undecided bands, the machine
probes of the newest run, and the way out.

Routing decided by model-step measurement (schema 4, ``evaluate/model_step.py``): the
document's ``route_decisions`` lists, per model and op, whether the plugin routes it or
leaves vLLM's path, the reason and rule, and the evidence summary (per scenario: the ratio
of throughputs to vanilla vLLM, median and 95 % CI, and the kernel times per step).

Engine-wide picks (schema 5, ``evaluate/engine_pick.py``): ``engine_picks`` lists, per model
and engine-wide vLLM setting, the value picked (or vLLM's default kept), the reason, and
per value measured its verdict and points.
"""
from __future__ import annotations

import json
from typing import Optional

from ..dispatch.manifest import as_served_summary
from ..dispatch.policy import SelectionPolicy
from ..freeze import build_manifest, fl_pick_row
from ..store import CalibrationDB, band_key
from ..store.device import resolve_device
from ..tune import noise as noisemod
from ..tune.race import WIN_MARGIN


#: kept for callers of the old name: the FL pick of one band's measurement rows
fl_pick = fl_pick_row


def build(db_path: str, *, device: Optional[str] = None, op: Optional[str] = None,
          registry=None, policy: Optional[SelectionPolicy] = None) -> dict:
    if registry is None:
        from ..dispatch.manager import get_default_manager
        registry = get_default_manager().registry
    policy = policy or SelectionPolicy()
    db = CalibrationDB(db_path, create=False)
    try:
        dev = resolve_device(db, device)
        winners = db.winners(dev["device_key"], dev["driver"], op)
        by_band = db.measurements_by_band(dev["device_key"], dev["driver"],
                                          **({"op": op} if op else {}))
        runs = [r for r in db.runs(dev["device_key"]) if r["driver"] == dev["driver"]]
        probes = db.noise_probes(dev["device_key"], dev["driver"],
                                 runs[-1]["id"] if runs else None)
        decisions = route_decisions_doc(db.route_decisions(dev["device_key"], dev["driver"]))
        engine_picks = engine_picks_doc(db.engine_picks(dev["device_key"], dev["driver"]))
        if decisions and winners:       # (no winners: no manifest, and nothing it drops)
            # a decision measured with picks a later calibration changed still sits in the
            # DB, but freeze leaves it out (the op stays on vLLM's path until
            # re-adjudicated): the report must not show it as in force (freeze's own
            # judgement, on the DB already open)
            stale: dict = {}
            build_manifest(db_path, device=device, registry=registry, policy=policy,
                           check_stack=False, stale_out=stale, db=db)
            for d in decisions:
                d["stale"] = stale.get((d["model_key"], d["op"]))
    finally:
        db.close()
    margins = {r["id"]: json.loads(r["settings"] or "{}").get("margin", WIN_MARGIN)
               for r in runs}
    rows = []
    for w in winners:
        ms = by_band.get(band_key(w), [])
        mine = next((m for m in ms if m["impl_id"] == w["impl_id"]), {})
        fl = fl_pick_row(ms, policy, registry) if ms else None
        fl_us = fl["median_us"] if fl and fl["outcome"] == "timed" else None
        band_noise, fastest_us, second_us = noisemod.band_noise(ms, w["impl_id"])
        if w.get("undecided") is not None:
            undecided, source = bool(w["undecided"]), "stored"
        else:                                 # a DB before schema 3: the same rule, read back
            undecided = noisemod.judge(fastest_us, second_us, band_noise or 0.0,
                                       margins.get(w["run_id"], WIN_MARGIN))
            source = "derived"
        rows.append({
            "op": w["op"], "signature": w["signature"], "dtype": w["dtype"],
            "band_lo": w["band_lo"], "band_hi": w["band_hi"], "winner": w["impl_id"],
            "winner_us": w["median_us"], "runner_up": w["runner_up"],
            "runner_up_us": w["runner_up_us"], "gap": w["gap"], "reason": w["reason"],
            "fl_pick": fl["impl_id"] if fl else None,
            "fl_outcome": fl["outcome"] if fl else None, "fl_us": fl_us,
            "speedup_vs_fl": (fl_us / w["median_us"]) if fl_us else None,
            "parity": mine.get("parity_score"), "rel_error": mine.get("rel_error"),
            "gbps": (mine["bytes"] / (w["median_us"] * 1e-6) / 1e9) if mine.get("bytes") else None,
            "weight": w["weight"] or 1, "noise": w["noise"],
            "band_noise": band_noise, "machine_noise": w.get("machine_noise"),
            "undecided": undecided, "undecided_source": source,
            "candidates": {m["impl_id"]: {"outcome": m["outcome"], "median_us": m["median_us"],
                                          "parity": m["parity_score"], "reason": m["reason"]}
                           for m in ms}})
    num = sum(r["weight"] * r["fl_us"] for r in rows if r["fl_us"])
    den = sum(r["weight"] * r["winner_us"] for r in rows if r["fl_us"])
    fl_bad = [r for r in rows if r["fl_outcome"] and r["fl_outcome"] != "timed"]
    undecided = [r for r in rows if r["undecided"]]
    last = runs[-1] if runs else {}
    models = sorted({(r["model"], r["dtype"], r["tp"]) for r in runs},
                    key=lambda m: tuple(map(str, m)))
    return {"device": dev, "run": {k: last.get(k) for k in ("id", "model", "dtype", "tp", "status",
                                                          "started", "finished")},
            # a DB often holds several models' calibrations; the rows cover all of them
            "models": [{"model": m, "dtype": d, "tp": t} for m, d, t in models],
            "stack": json.loads(last["stack"]) if last.get("stack") else {},
            "rows": rows,
            "undecided": [{k: r[k] for k in ("op", "signature", "dtype", "band_lo", "band_hi",
                                             "winner", "gap", "band_noise")}
                          for r in undecided],
            "noise_probes": probes,
            "route_decisions": [d for d in decisions if op is None or d["op"] == op],
            "engine_picks": engine_picks,
            "way_out": noise_way_out(db_path, last) if undecided else None,
            "summary": {"bands": len(rows),
                        "bands_where_measured_differs_from_fl": sum(
                            1 for r in rows if r["fl_pick"] != r["winner"]),
                        "bands_where_fl_pick_fails": len(fl_bad),
                        "bands_undecided": len(undecided),
                        "machine_loaded_probes": sum(1 for p in probes if p.get("loaded")),
                        "weighted_speedup_vs_fl": (num / den) if den else None,
                        "max_speedup_vs_fl": max((r["speedup_vs_fl"] for r in rows
                                                  if r["speedup_vs_fl"]), default=None)}}


def route_decisions_doc(rows: list) -> list:
    """DB rows (``CalibrationDB.route_decisions``) as the report's entries: per model, op and
    token range (``min_tokens``..``max_tokens``, None: no bound; 1..None unless the op was
    decided per range), the decision, the reason, the rule and the evidence summary (per scenario: ratio median
    and CI)."""
    out = []
    for r in rows:
        ev = r.get("evidence") or {}
        out.append({"model": r.get("model_name") or r["model"], "model_key": r["model"],
                    "op": r["op"], "min_tokens": r.get("min_tokens") or 1,
                    "max_tokens": r.get("max_tokens"),
                    "decision": r["decision"], "reason": r["reason"],
                    "rule": r["rule"], "stack_key": r.get("stack_key"),
                    "decided_at": r.get("created_at"), "reps": ev.get("reps"),
                    "routed_impls": ev.get("routed_impls") or [],
                    "command": ev.get("command"),
                    "points": [{k: p.get(k) for k in ("scenario", "n", "ratio_median", "ci_low",
                                                      "ci_high", "kernel_us_arm",
                                                      "kernel_us_vanilla")}
                               for p in ev.get("points") or []],
                    # the split's as-served confirmation, which it was kept (or undone) on
                    "as_served": as_served_summary(ev.get("as_served"))})
    return out



def engine_picks_doc(rows: list) -> list:
    """DB rows (``CalibrationDB.engine_picks``) as the report's entries: per model and
    choice, the decision and value, the reason, the rule and vLLM version, and per value
    measured its verdict and points (ratio median and CI per scenario)."""
    out = []
    for r in rows:
        ev = r.get("evidence") or {}
        out.append({"model": r.get("model_name") or r["model"], "model_key": r["model"],
                    "choice": r["choice"], "decision": r["decision"], "value": r["value"],
                    "reason": r["reason"], "rule": r["rule"], "vllm": r.get("vllm"),
                    "decided_at": r.get("created_at"), "reps": ev.get("reps"),
                    "command": ev.get("command"),
                    "values": {v: {"verdict": e.get("verdict"),
                                   # measured by an earlier run (engine_pick.carried_values)
                                   "carried_from": (e.get("carried") or {}).get("created_at"),
                                   "points": [{k: p.get(k) for k in (
                                       "scenario", "n", "ratio_median", "ci_low", "ci_high",
                                       "kernel_us_arm", "kernel_us_vanilla")}
                                       for p in e.get("points") or []]}
                               for v, e in (ev.get("values") or {}).items()}})
    return out


def noise_way_out(db_path: str, run: dict) -> str:
    """What to do about undecided bands (the report's last line names it): commands that
    run as printed, repeating the newest run's model and token range."""
    from shlex import quote
    try:
        st = json.loads(run.get("settings") or "{}")
    except (TypeError, ValueError):
        st = {}
    cmd = noisemod.rerun_command(run.get("model") or "Qwen3.5-0.8B", db_path,
                                 max_tokens=st.get("max_tokens"), ops=st.get("ops"),
                                 tp=run.get("tp"))
    return (f"re-measure on a quieter machine (stop other work first) with `{cmd}`, "
            f"or check the winners now with `fltune verify --db {quote(db_path)}`")
