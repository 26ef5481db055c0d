"""``fltune verify``: is the DB still right for this device, now?

For every winner the DB holds for this device (or the one named, which must be this
machine's device: measuring needs the hardware), the winner and its runner-up are raced
again, interleaved, on fresh inputs at the band's measured size, with the timer mode the
calibration used (CUDA graph or cold-L2 eager, from the winner's stored timer). The winner
is parity-checked again too.

A band has **drifted** when
- the winner is not available now (not registered, no longer qualifies, raises), or fails
  parity now;
- the runner-up now beats the winner by more than both the win margin the calibration used
  and the noise (a *different winner*);
- the winner's time moved (either way) by more than the noise, i.e. the ratio now / DB
  lies outside [1/(1+t), 1+t].

The noise t is the largest of: the spread this run measured for the candidates compared
((p90 - p10) / median, as the calibration stores it), the spread the calibration stored
for the winner, and ``--noise-floor`` (default 10 %: on a GPU, clocks move replayed times
by a few percent between processes; on a shared CPU far more — raise it there).

A DB with any drifted band is stale: ``fltune verify`` exits with status 1.
"""
from __future__ import annotations

import json
import math
import time
from typing import Callable, Optional

import torch

from . import device as devmod
from .dispatch.types import QualifyContext
from .freeze import stack_differences
from .ops import clone_args, dtype_from_name, get_op
from .store import CalibrationDB
from .tune import parity, timing
from .tune.adjudicate import WIN_MARGIN
from .tune.bands import Band

DEFAULT_NOISE_FLOOR = 0.10


def run_verify(db_path: str, *, device: Optional[str] = None, ops: Optional[list] = None,
               noise_floor: float = DEFAULT_NOISE_FLOOR, reps: int = 0, budget_s: float = 0.05,
               graph_calls: int = 20, manager=None, seed: int = 0,
               progress: Optional[Callable] = None) -> dict:
    from .bench import device_row_for_this_machine
    from .dispatch.manager import get_default_manager

    t0 = time.perf_counter()
    registry = (manager or get_default_manager()).registry
    db = CalibrationDB(db_path, create=False)
    try:
        # which device type: the one of the DB's row that names this machine
        me_default = devmod.current()
        dtype_guess = me_default["device_type"]
        if device is not None:
            rows = [r for r in db.devices() if r["device_key"].startswith(device.split("@")[0])
                    or device.lower() in r["name"].lower()]
            if rows and rows[0]["device_type"] in ("cpu", "cuda"):
                dtype_guess = rows[0]["device_type"]
        row, me, notes = device_row_for_this_machine(db, dtype_guess, device)
        winners = db.winners(row["device_key"], row["driver"])
        if ops:
            winners = [w for w in winners if w["op"] in ops]
        meas = {(m["op"], m["signature"], m["dtype"], m["band_hi"], m["impl_id"]): m
                for m in db.measurements(row["device_key"], row["driver"])}
        runs = {r["id"]: r for r in db.runs(row["device_key"])}
        stacks = db.stacks_of_winners(row["device_key"], row["driver"])
        models = sorted({r["model"] for r in runs.values() if r["driver"] == row["driver"]})
    finally:
        db.close()
    now_stack = devmod.stack()
    for st in stacks.values():
        diff = stack_differences(st, now_stack)
        if diff:
            notes.append("software stack changed since calibration: " + "; ".join(diff))
    dev = row["device_type"]
    cap = torch.cuda.get_device_capability() if dev == "cuda" else None
    if progress:
        progress("start", total=len(winners))
    bands_out = []
    for w in winners:
        run = runs.get(w["run_id"]) or {}
        try:
            margin = json.loads(run.get("settings") or "{}").get("margin", WIN_MARGIN)
        except ValueError:
            margin = WIN_MARGIN
        rec = verify_band(w, meas, registry, dev, cap, margin=margin, noise_floor=noise_floor,
                          reps=reps, budget_s=budget_s, graph_calls=graph_calls, seed=seed)
        bands_out.append(rec)
        if progress:
            progress("band", record=rec)
    stale = [b for b in bands_out if b["status"] != "ok"]
    counts: dict = {}
    for b in bands_out:
        counts[b["status"]] = counts.get(b["status"], 0) + 1
    return {"format": "fltune.verify/1", "db": str(db_path), "device": me, "db_device": row,
            "stack": now_stack, "models": models, "notes": notes, "noise_floor": noise_floor,
            "bands": bands_out, "counts": counts, "stale": bool(stale),
            "stale_bands": len(stale), "checked": len(bands_out),
            "wall_s": round(time.perf_counter() - t0, 3)}


def verify_band(w: dict, meas: dict, registry, dev: str, cap, *, margin: float,
                noise_floor: float, reps: int, budget_s: float, graph_calls: int,
                seed: int = 0) -> dict:
    op, sig, dt_name, hi = w["op"], w["signature"], w["dtype"], w["band_hi"]
    rec = {"op": op, "signature": sig, "dtype": dt_name, "band_lo": w["band_lo"],
           "band_hi": hi, "winner": w["impl_id"], "winner_db_us": w["median_us"],
           "runner_up": w["runner_up"], "runner_up_db_us": w["runner_up_us"],
           "winner_us": None, "runner_up_us": None, "ratio": None, "runner_up_ratio": None,
           "noise": None, "status": "ok", "reasons": []}
    spec = get_op(op)
    dims = json.loads(w["dims"])
    dtype = dtype_from_name(dt_name)
    ctx = QualifyContext(dev, dtype, cap)
    band = Band(w["band_lo"], hi)
    args = spec.make_inputs(band.tokens, dims, dtype, dev, torch.Generator().manual_seed(seed))
    ref = parity.reference_outputs(spec, args)
    calls, impls = {}, {}
    for role, impl_id in (("winner", w["impl_id"]), ("runner_up", w["runner_up"])):
        if impl_id is None:
            continue
        try:
            impl = registry.get(op, impl_id)
        except KeyError:
            rec["reasons"].append(f"{role} {impl_id} is not registered now")
            continue
        why = impl.qualify(ctx)
        if why is not None:
            rec["reasons"].append(f"{role} {impl_id} does not qualify now: {why}")
            continue
        p = parity.check(spec, impl.fn, args, dtype, reference=ref)
        if not p.passed:
            rec["reasons"].append(f"{role} {impl_id} fails parity now: {p.reason}")
            if role == "winner":
                rec["status"] = "parity_failed"
            continue
        impls[role] = impl
        calls[impl_id] = (lambda fn=impl.fn, a=clone_args(args): fn(*a))
    del ref
    if "winner" not in impls:
        if rec["status"] == "ok":
            rec["status"] = "unavailable"
        return rec
    timer = {}
    m = meas.get((op, sig, dt_name, hi, w["impl_id"]))
    if m and m.get("timer"):
        try:
            timer = json.loads(m["timer"])
        except ValueError:
            timer = {}
    if timer.get("timer") == "cuda-graph" and timer.get("calls_per_graph"):
        graph_calls = int(timer["calls_per_graph"])
    times = timing.time_candidates(calls, dev, reps=reps, budget_s=budget_s,
                                   graph_calls=graph_calls, cold_l2=bool(timer.get("cold_l2")))
    tw = times.get(w["impl_id"])
    if not isinstance(tw, timing.Timing):
        rec["status"] = "unavailable"
        rec["reasons"].append(f"winner {w['impl_id']} raised while timing: {tw}")
        return rec
    rec["winner_us"] = tw.median_us
    rec["timer"] = tw.timer
    noise = max(noise_floor, tw.noise, w["noise"] or 0.0)
    tr = times.get(w["runner_up"]) if w["runner_up"] else None
    if isinstance(tr, timing.Timing):
        rec["runner_up_us"] = tr.median_us
        if rec["runner_up_db_us"]:
            rec["runner_up_ratio"] = tr.median_us / rec["runner_up_db_us"]
        noise = max(noise, tr.noise)
    rec["noise"] = noise
    rec["ratio"] = tw.median_us / w["median_us"] if w["median_us"] else math.inf
    if isinstance(tr, timing.Timing) and tr.median_us > 0:
        lead = tw.median_us / tr.median_us - 1       # > 0: the runner-up is faster now
        rec["runner_up_lead"] = lead
        if lead > max(margin, noise):
            rec["status"] = "changed"
            rec["reasons"].append(f"runner-up {w['runner_up']} is now {lead:.1%} faster than "
                                  f"winner {w['impl_id']} (margin {margin:.0%}, noise "
                                  f"{noise:.1%})")
    r = rec["ratio"]
    if not (1 / (1 + noise) <= r <= 1 + noise):
        if rec["status"] == "ok":
            rec["status"] = "moved"
        rec["reasons"].append(f"winner {w['impl_id']} time moved {_fmt_ratio(r)} "
                              f"({_us(w['median_us'])} -> {_us(tw.median_us)} µs; noise "
                              f"{noise:.1%})")
    return rec


def _fmt_ratio(r):
    if not math.isfinite(r):
        return "from 0"
    return f"{r - 1:+.1%}" if 0.5 <= r <= 2 else f"{r:.3g}x"


def _us(v):
    return "—" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.3g}")


def render(doc: dict, console=None, all_bands: bool = False) -> None:
    from rich.markup import escape
    from rich.table import Table

    from .report import short, wide_console

    if console is None:
        console = wide_console(160)
    d = doc["db_device"]
    console.print(f"[bold]fltune verify[/] — {doc['db']}: {d['name']} [{d['device_key']}] driver "
                  f"{d['driver']}; noise floor {doc['noise_floor']:.0%}")
    for n in doc["notes"]:
        console.print(f"[yellow]note:[/] {escape(n)}")
    rows = doc["bands"] if all_bands else [b for b in doc["bands"] if b["status"] != "ok"]
    if rows:
        t = Table(title="drifted bands" if not all_bands else "bands", title_justify="left")
        for c in ("op", "signature", "tokens", "status", "winner", "DB µs", "now µs", "now/DB",
                  "runner-up", "now µs ", "noise", "why"):
            t.add_column(c, justify="right" if "µs" in c or c in ("tokens", "now/DB", "noise")
                         else "left")
        for b in rows:
            st = b["status"]
            t.add_row(b["op"], b["signature"], str(b["band_hi"]),
                      st if st == "ok" else f"[red]{st}[/]", short(b["winner"]),
                      _us(b["winner_db_us"]), _us(b["winner_us"]),
                      "—" if b["ratio"] is None else _fmt_ratio(b["ratio"]),
                      short(b["runner_up"]), _us(b["runner_up_us"]),
                      "—" if b["noise"] is None else f"{b['noise']:.0%}",
                      escape("; ".join(b["reasons"])))
        console.print(t)
    counts = ", ".join(f"{v} {k}" for k, v in sorted(doc["counts"].items()))
    if doc["stale"]:
        console.print(f"[bold red]stale[/]: {doc['stale_bands']} of {doc['checked']} bands drifted "
                      f"({counts}); re-measure with `fltune calibrate --model "
                      f"{(doc.get('models') or ['MODEL'])[-1]} --db {doc['db']} --force`")
    else:
        console.print(f"[bold green]ok[/]: {doc['checked']} bands re-measured, none drifted "
                      f"({counts}), {doc['wall_s']:.1f} s")
