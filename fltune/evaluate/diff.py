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

from ..store import CalibrationDB, DBError
from ..store.device import resolve_device

#: B/A winner-time ratios outside [1/(1+t), 1+t] are flagged as moved (informational)
DEFAULT_TIME_THRESHOLD = 0.05


def _side(path: str, spec: Optional[str], side: str) -> dict:
    db = CalibrationDB(path, create=False)
    try:
        # KEY | NAME[@DRIVER]; none given: the DB's only device, else this machine's
        dev = resolve_device(db, spec, flag=f"--device-{side}", sole=True)
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
