"""``fltune diff``: two calibrations side by side — which winners changed, and by how much.

Either two DB files (``fltune diff A.db B.db``; each side's device is the only one its DB
holds, or this machine's, or the one ``--device-a`` / ``--device-b`` names), or two devices
of one DB (``fltune diff X.db --device-a K1 --device-b K2``). A device is named by key
prefix or name substring, optionally ``@DRIVER`` to pick one driver of a device.

Bands are matched on (op, shape signature, dtype, band top edge). For each band: A's and
B's winner and time, B/A of the winner times, and — where the winner changed — what the
other side's choice costs: B's own measured time of A's winner over B's winner time (how
much slower B would run with A's table), and the same the other way round. Reads only the
DBs; nothing is measured.
"""
from __future__ import annotations

from typing import Optional

from .store import CalibrationDB, DBError

#: B/A winner-time ratios outside [1/(1+t), 1+t] are flagged as moved (informational)
DEFAULT_TIME_THRESHOLD = 0.05


def _pick_device(db: CalibrationDB, spec: Optional[str], side: str) -> dict:
    from . import device as devmod
    rows = db.devices()
    have = "; ".join(f"{r['name']} [{r['device_key']}] driver {r['driver']}" for r in rows) or "none"
    if spec is None:
        if len(rows) == 1:
            return rows[0]
        me = devmod.current()
        mine = [r for r in rows if r["device_key"] == me["device_key"] and
                r["driver"] == me["driver"]]
        if len(mine) == 1:
            return mine[0]
        raise DBError(f"{db.path} holds {len(rows)} devices; name one with --device-{side} "
                      f"(key prefix or name, optionally @DRIVER). Devices: {have}")
    key, _, driver = spec.partition("@")
    hits = [r for r in rows if (r["device_key"].startswith(key) or
                                key.lower() in r["name"].lower()) and
            (not driver or r["driver"] == driver)]
    if len(hits) != 1:
        raise DBError(f"--device-{side} {spec!r} matches {len(hits)} devices in {db.path} "
                      f"(add @DRIVER to choose a driver); devices: {have}")
    return hits[0]


def _side(path: str, spec: Optional[str], side: str) -> dict:
    db = CalibrationDB(path, create=False)
    try:
        dev = _pick_device(db, spec, side)
        winners = db.winners(dev["device_key"], dev["driver"])
        timed = {(m["op"], m["signature"], m["dtype"], m["band_hi"], m["impl_id"]): m["median_us"]
                 for m in db.measurements(dev["device_key"], dev["driver"], outcome="timed")}
    finally:
        db.close()
    return {"db": str(path), "device": dev,
            "winners": {(w["op"], w["signature"], w["dtype"], w["band_hi"]): w for w in winners},
            "timed": timed}


def run_diff(a_path: str, b_path: Optional[str] = None, *, device_a: Optional[str] = None,
             device_b: Optional[str] = None,
             threshold: float = DEFAULT_TIME_THRESHOLD) -> dict:
    if b_path is None:
        if not (device_a and device_b):
            raise DBError("diff of one DB compares two of its devices: name them with "
                          "--device-a and --device-b (or give two DB files)")
        b_path = a_path
    a = _side(a_path, device_a, "a")
    b = _side(b_path, device_b, "b")
    rows = []
    for key in sorted(set(a["winners"]) | set(b["winners"])):
        op, sig, dt, hi = key
        wa, wb = a["winners"].get(key), b["winners"].get(key)
        row = {"op": op, "signature": sig, "dtype": dt, "band_hi": hi,
               "band_lo": (wa or wb)["band_lo"],
               "a": None if wa is None else {"impl_id": wa["impl_id"], "us": wa["median_us"],
                                              "runner_up": wa["runner_up"], "gap": wa["gap"]},
               "b": None if wb is None else {"impl_id": wb["impl_id"], "us": wb["median_us"],
                                              "runner_up": wb["runner_up"], "gap": wb["gap"]},
               "weight": (wa or wb)["weight"]}
        if wa is None or wb is None:
            row["status"] = "only_b" if wa is None else "only_a"
            rows.append(row)
            continue
        row["status"] = "changed" if wa["impl_id"] != wb["impl_id"] else "same"
        ratio = (wb["median_us"] / wa["median_us"]) if wa["median_us"] else None
        row["time_ratio"] = ratio
        row["time_moved"] = ratio is not None and not (1 / (1 + threshold) <= ratio <= 1 + threshold)
        if row["status"] == "changed":
            a_on_b = b["timed"].get((*key, wa["impl_id"]))
            b_on_a = a["timed"].get((*key, wb["impl_id"]))
            row["a_pick_on_b"] = (a_on_b / wb["median_us"]) if a_on_b and wb["median_us"] else None
            row["b_pick_on_a"] = (b_on_a / wa["median_us"]) if b_on_a and wa["median_us"] else None
        rows.append(row)

    def pub(s):
        return {"db": s["db"], "device": s["device"]}
    changed = [r for r in rows if r["status"] == "changed"]
    both = [r for r in rows if r["status"] in ("same", "changed")]
    num = sum(r["weight"] * r["b"]["us"] for r in both)
    den = sum(r["weight"] * r["a"]["us"] for r in both)
    return {"format": "fltune.diff/1", "a": pub(a), "b": pub(b), "threshold": threshold,
            "rows": rows, "changed": changed,
            "summary": {"bands_a": len(a["winners"]), "bands_b": len(b["winners"]),
                        "common": len(both), "changed": len(changed),
                        "time_moved": sum(1 for r in both if r["time_moved"]),
                        "only_a": sum(1 for r in rows if r["status"] == "only_a"),
                        "only_b": sum(1 for r in rows if r["status"] == "only_b"),
                        "weighted_time_ratio_b_over_a": (num / den) if den else None}}


def _us(v):
    return "—" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.3g}")


def _x(v):
    return "—" if v is None else f"{v:.2f}x"


def render(doc: dict, console=None, all_bands: bool = False) -> None:
    from rich.table import Table

    from .report import short, wide_console

    if console is None:
        console = wide_console(160)

    def lab(s):
        d = s["device"]
        return f"{s['db']}: {d['name']} [{d['device_key']}] driver {d['driver']}"
    console.print(f"[bold]fltune diff[/]\n  A = {lab(doc['a'])}\n  B = {lab(doc['b'])}")
    rows = doc["rows"] if all_bands else [r for r in doc["rows"]
                                          if r["status"] != "same" or r["time_moved"]]
    if rows:
        t = Table(title="all bands" if all_bands else "bands that differ", title_justify="left")
        for c in ("op", "signature", "dtype", "tokens", "status", "A winner", "A µs", "B winner",
                  "B µs", "B/A", "A's pick on B", "B's pick on A"):
            t.add_column(c, justify="right" if ("µs" in c or c in ("tokens", "B/A") or
                                                "pick on" in c) else "left")
        for r in rows:
            st = r["status"]
            a, b = r["a"] or {}, r["b"] or {}
            ratio = r.get("time_ratio")
            t.add_row(r["op"], r["signature"], r["dtype"],
                      f"{r['band_lo']}–{r['band_hi']}" if r["band_lo"] != r["band_hi"] else str(r["band_hi"]),
                      f"[yellow]{st}[/]" if st != "same" else ("moved" if r["time_moved"] else st),
                      short(a.get("impl_id")), _us(a.get("us")), short(b.get("impl_id")),
                      _us(b.get("us")), _x(ratio), _x(r.get("a_pick_on_b")),
                      _x(r.get("b_pick_on_a")))
        console.print(t)
    s = doc["summary"]
    w = s["weighted_time_ratio_b_over_a"]
    console.print(f"[bold]summary[/]: {s['common']} bands in both; winner changed in "
                  f"[bold]{s['changed']}[/]; winner time moved beyond "
                  f"{doc['threshold']:.0%} in {s['time_moved']}; only in A {s['only_a']}, only "
                  f"in B {s['only_b']}; workload-weighted winner time B/A "
                  + ("—" if w is None else f"{w:.2f}x"))
