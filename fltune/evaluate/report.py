"""The report: what won where, by how much, against the fixed FL order.

Reads only the DB (and the registry, for FL kinds and priorities). Per op and shape, one row
per band: the winner and its time, the runner-up and the gap, what the fixed FL order picks
and its time, the speedup of measured over fixed, the winner's parity, and the achieved
bandwidth (bytes the op must move / time). The summary weights every band by its op's
calls per forward step (from the workload), so an op called 48 times a step counts 48 times.
"""
from __future__ import annotations

import json
from collections import defaultdict
from typing import Optional

from .dispatch.policy import SelectionPolicy
from .store import CalibrationDB, band_key, resolve_device


def fl_pick(measured: list[dict], policy: SelectionPolicy, registry):
    """The candidate the fixed FL order runs: the first *qualified* one in policy order.
    FL does not check parity, so its pick may be one that fails it — reported as such."""
    by_id = {m["impl_id"]: m for m in measured}
    impls = [registry.get(m["op"], m["impl_id"]) for m in measured
             if m["impl_id"] in {i.impl_id for i in registry.get_implementations(m["op"])}]
    for impl in policy.order(measured[0]["op"], impls):
        m = by_id[impl.impl_id]
        if m["outcome"] != "unqualified":
            return m
    return None


def build(db_path: str, *, device: Optional[str] = None, op: Optional[str] = None,
          registry=None, policy: Optional[SelectionPolicy] = None) -> dict:
    if registry is None:
        from .dispatch.manager import get_default_manager
        registry = get_default_manager().registry
    policy = policy or SelectionPolicy()
    db = CalibrationDB(db_path, create=False)
    try:
        dev = resolve_device(db, device)
        winners = db.winners(dev["device_key"], dev["driver"], op)
        by_band = db.measurements_by_band(dev["device_key"], dev["driver"],
                                          **({"op": op} if op else {}))
        runs = [r for r in db.runs(dev["device_key"]) if r["driver"] == dev["driver"]]
    finally:
        db.close()
    rows = []
    for w in winners:
        ms = by_band.get(band_key(w), [])
        mine = next((m for m in ms if m["impl_id"] == w["impl_id"]), {})
        fl = fl_pick(ms, policy, registry) if ms else None
        fl_us = fl["median_us"] if fl and fl["outcome"] == "timed" else None
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
            "candidates": {m["impl_id"]: {"outcome": m["outcome"], "median_us": m["median_us"],
                                          "parity": m["parity_score"], "reason": m["reason"]}
                           for m in ms}})
    num = sum(r["weight"] * r["fl_us"] for r in rows if r["fl_us"])
    den = sum(r["weight"] * r["winner_us"] for r in rows if r["fl_us"])
    fl_bad = [r for r in rows if r["fl_outcome"] and r["fl_outcome"] != "timed"]
    last = runs[-1] if runs else {}
    models = sorted({(r["model"], r["dtype"], r["tp"]) for r in runs},
                    key=lambda m: tuple(map(str, m)))
    return {"device": dev, "run": {k: last.get(k) for k in ("id", "model", "dtype", "tp", "status",
                                                          "started", "finished")},
            # a DB often holds several models' calibrations; the rows cover all of them
            "models": [{"model": m, "dtype": d, "tp": t} for m, d, t in models],
            "stack": json.loads(last["stack"]) if last.get("stack") else {},
            "rows": rows,
            "summary": {"bands": len(rows),
                        "bands_where_measured_differs_from_fl": sum(
                            1 for r in rows if r["fl_pick"] != r["winner"]),
                        "bands_where_fl_pick_fails": len(fl_bad),
                        "weighted_speedup_vs_fl": (num / den) if den else None,
                        "max_speedup_vs_fl": max((r["speedup_vs_fl"] for r in rows
                                                  if r["speedup_vs_fl"]), default=None)}}


#: short display names, so a report fits a terminal
SHORT = {"reference.torch": "reference", "reference.torch_fused": "torch",
         "reference.inductor": "inductor", "vendor.vllm": "vllm", "default.flagos": "flaggems"}


def wide_console(width: int = 150):
    """A rich console for tables: the terminal's width when there is one, else ``width``
    (rich falls back to 80 columns when stdout is a pipe, which wraps every table)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=width)


def short(impl_id):
    return SHORT.get(impl_id, impl_id) if impl_id else "—"


def _us(v):
    return "—" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def render(rep: dict, console=None) -> None:
    from rich.markup import escape
    from rich.table import Table

    if console is None:
        console = wide_console(150)
    d = rep["device"]
    run = rep["run"]
    st = rep["stack"]
    console.print(f"[bold]fltune report[/] — {d['name']} [{d['device_key']}] cc {d['capability']}, "
                  f"{d['sms']} {'SMs' if d['device_type'] == 'cuda' else 'cores'}, driver {d['driver']}")
    console.print(f"run {run.get('id')}: model {run.get('model')} {run.get('dtype')} tp={run.get('tp')} "
                  f"({run.get('status')}); stack: " + ", ".join(f"{k} {v}" for k, v in st.items() if v))
    models = rep.get("models", [])
    if len(models) > 1:
        console.print("models calibrated in this DB for this device: " + ", ".join(
            f"{m['model']} {m['dtype']} tp={m['tp']}" for m in models))
    groups = defaultdict(list)
    for r in rep["rows"]:
        groups[(r["op"], r["signature"], r["dtype"])].append(r)
    for (op, sig, dt), rows in groups.items():
        # escape: rich would read "[eps=1e-06,hidden=64]" as markup and drop it
        t = Table(title=escape(f"{op}  [{sig}]  {dt}  ×{rows[0]['weight']}/step"),
                  title_justify="left")
        for col, just in (("tokens", "right"), ("winner", "left"), ("µs", "right"),
                          ("runner-up", "left"), ("gap", "right"), ("FL pick", "left"),
                          ("FL µs", "right"), ("vs FL", "right"), ("parity", "right"),
                          ("GB/s", "right")):
            t.add_column(col, justify=just)
        for r in rows:
            fl = short(r["fl_pick"])
            if r["fl_outcome"] and r["fl_outcome"] != "timed":
                fl += f" ({r['fl_outcome']})"
            sp = r["speedup_vs_fl"]
            sp_s = "—" if sp is None else (f"[green]{sp:.2f}x[/]" if sp > 1.03 else f"{sp:.2f}x")
            t.add_row(f"{r['band_lo']}–{r['band_hi']}" if r["band_lo"] != r["band_hi"] else str(r["band_hi"]),
                      short(r["winner"]), _us(r["winner_us"]), short(r["runner_up"]),
                      "—" if r["gap"] is None else f"{r['gap']:+.1%}", fl, _us(r["fl_us"]), sp_s,
                      "—" if r["parity"] is None else f"{r['parity']:.4f}",
                      "—" if r["gbps"] is None else f"{r['gbps']:.1f}")
        console.print(t)
    s = rep["summary"]
    ws = s["weighted_speedup_vs_fl"]
    console.print(f"[bold]summary[/]: {s['bands']} bands; measured pick differs from the fixed FL "
                  f"order in {s['bands_where_measured_differs_from_fl']}; FL's pick fails parity or "
                  f"raises in {s['bands_where_fl_pick_fails']}; workload-weighted speedup over the "
                  f"fixed FL order: " + ("—" if ws is None else f"[bold]{ws:.2f}x[/]") +
                  ("" if s["max_speedup_vs_fl"] is None else f" (max {s['max_speedup_vs_fl']:.2f}x)"))
