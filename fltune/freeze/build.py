"""Freeze: calibration DB -> frozen dispatch manifest (a pure function of the DB rows for
one device and driver, and the policy).

Per op, one table per (dtype, signature): the ordered bands, adjacent bands with the same
winner merged, each with the implementation (impl_id, kind, vendor, callable path), its
measured time, the runner-up and the gap. The band rule, the policy and the software stack
are written in, and a sha256 fingerprint over the canonical JSON of all of it — the value
vLLM's compile-cache key receives, so a different choice can never reuse a compiled graph
built for another.

Where ``fltune refine`` stored a crossover between two adjacent bands' winners (and it still
holds: same winners, same stack), the edge between them is the refined token count instead
of the band edge; the manifest marks that band ``refined``. ``order="fl"`` ignores them.

The policy still applies to measured winners: a vendor the policy denies (a human
deny-list, like vllm-plugin-FL's nvidia.yaml) never wins; the fastest permitted candidate
measured for that band takes its place and the override is written into the manifest with
its reason.
"""
from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from typing import Optional

import torch

from . import device as devmod
from .dispatch.frozen import MANIFEST_FORMAT, ManifestError, fingerprint_of
from .dispatch.policy import SelectionPolicy
from .ops import get_op
from .store import CalibrationDB, DBError, band_key, resolve_device
from .tune.bands import BAND_RULE

log = logging.getLogger("fltune.freeze")


class StackMismatch(RuntimeError):
    pass


def key_shape(op: str, dims: dict):
    """(trailing shape of the key argument, rows per token) for an op at these dims."""
    spec = get_op(op)
    args = spec.make_inputs(1, dims, torch.float32, "cpu", torch.Generator().manual_seed(0))
    x = args[spec.key_arg]
    return list(x.shape[1:]), int(x.shape[0])


def stack_differences(recorded: dict, now: dict) -> list[str]:
    return [f"{k}: calibrated with {recorded.get(k)}, running {now.get(k)}"
            for k in sorted(set(recorded) | set(now))
            if k != "python" and recorded.get(k) != now.get(k)]


#: what a manifest's bands pick: the measured winner, or what the fixed FL order runs
ORDERS = ("measured", "fl")


def build_manifest(db_path: str, *, device: Optional[str] = None,
                   policy: Optional[SelectionPolicy] = None, registry=None,
                   strict: bool = False, check_stack: bool = True,
                   order: str = "measured") -> tuple[dict, list[str]]:
    """Returns (manifest, warnings). Raises DBError when there is nothing for the device,
    StackMismatch when ``strict`` and the stack changed since calibration.

    ``order="fl"`` freezes the *fixed FL order* instead of the measured winners: every band
    picks the first qualified candidate in the policy's order (what vllm-plugin-FL would
    run), over the same bands. It exists so that the end-to-end A/B serves the baseline
    through the very same seams and custom ops as the calibrated arm — the two arms then
    differ only in which implementation each band calls."""
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
    policy = policy or SelectionPolicy()
    db = CalibrationDB(db_path, create=False)
    try:
        dev = resolve_device(db, device)
        winners = db.winners(dev["device_key"], dev["driver"])
        if not winners:
            raise DBError(f"{db_path} has no winners for {dev['name']} [{dev['device_key']}] "
                          f"driver {dev['driver']}; run `fltune calibrate --db {db_path}`")
        warnings = []
        stacks = db.stacks_of_winners(dev["device_key"], dev["driver"])
        if check_stack:
            now = devmod.stack()
            for sk, st in stacks.items():
                diff = stack_differences(st, now)
                if diff:
                    msg = (f"software stack changed since calibration ({'; '.join(diff)}): the "
                           f"measured winners may no longer be the fastest; re-run `fltune "
                           f"calibrate --db {db_path}` (or `fltune verify`)")
                    if strict:
                        raise StackMismatch(msg)
                    warnings.append(msg)
        overrides = []
        rows = []
        # one read of the device's measurements serves the FL picks, the native compiled
        # times and the launch floor below
        by_band = db.measurements_by_band(dev["device_key"], dev["driver"])
        if order == "fl":
            winners = _fl_rows(by_band, winners, policy, registry)
        for w in winners:
            impl_ok = _permitted(w, policy)
            if not impl_ok:
                alt = _best_permitted(db, dev, w, policy)
                if alt is None:
                    overrides.append({"op": w["op"], "signature": w["signature"],
                                      "band_hi": w["band_hi"], "denied": w["impl_id"],
                                      "replacement": None,
                                      "reason": "denied by policy; no permitted candidate "
                                                "was measured"})
                    continue
                overrides.append({"op": w["op"], "signature": w["signature"],
                                  "band_hi": w["band_hi"], "denied": w["impl_id"],
                                  "replacement": alt["impl_id"],
                                  "reason": f"vendor {w['vendor']} denied by policy"})
                log.warning("fltune: %s %s band <=%s: %s denied by policy, using %s",
                            w["op"], w["signature"], w["band_hi"], w["impl_id"], alt["impl_id"])
                w = {**w, "impl_id": alt["impl_id"], "kind": alt["kind"],
                     "vendor": alt["vendor"], "median_us": alt["median_us"],
                     "runner_up": None, "runner_up_us": None, "gap": None,
                     "reason": "policy override"}
            rows.append(w)
        # measured with the software stack the winners were: an older stack's rows are not
        # evidence about this one
        stack_keys = set(stacks)
        timed = [m for ms in by_band.values() for m in ms
                 if m["outcome"] == "timed" and m.get("stack_key") in stack_keys]
        native = {band_key(m): m["median_us"] for m in timed if m["impl_id"] == NATIVE_COMPILED}
        # refined edges (``fltune refine``) move the boundary between two measured winners;
        # the fixed FL order's bands are not what was refined, so they keep the band edges
        crossovers = ({(c["op"], c["signature"], c["dtype"], c["lower_hi"]): c
                       for c in db.crossovers(dev["device_key"], dev["driver"])}
                      if order == "measured" else {})
        ops = _tables(rows, registry, native, crossovers)
        floor = min((m["median_us"] for m in timed if m["median_us"]), default=None)
        manifest = {
            "format": MANIFEST_FORMAT,
            "device": {k: dev[k] for k in ("device_key", "device_type", "name", "capability",
                                           "sms", "memory_bytes")},
            "driver": dev["driver"],
            "stack": sorted(stacks.values(), key=lambda s: json.dumps(s, sort_keys=True)),
            "policy": policy.to_dict(),
            "order": order,
            # order "fl": bands where FL's pick could not be served (it failed parity or was
            # never timed), so the measured winner stands in: the baseline is not pure FL there
            "fl_substitutions": [{"op": w["op"], "signature": w["signature"],
                                  "band_hi": w["band_hi"], "reason": w["reason"]}
                                 for w in rows if order == "fl" and str(w.get("reason", ""))
                                 .endswith("measured winner kept")],
            "band_rule": BAND_RULE,
            "source_db": {"path": str(db_path),
                          "runs": [r["id"] for r in db.runs(dev["device_key"])]},
            "ops": ops,
            "overrides": overrides,
            "launch_floor_us": floor,
        }
        manifest["fingerprint"] = fingerprint_of(manifest)
        return manifest, warnings
    finally:
        db.close()


def _fl_rows(by_band: dict, winners, policy, registry) -> list[dict]:
    """The winner rows rewritten to the fixed FL order's pick in each band (kept as the
    measured winner where FL's pick was never timed, e.g. it failed parity, so that the
    baseline never serves an implementation known to be wrong)."""
    from .dispatch.manager import get_default_manager
    from .report import fl_pick

    registry = registry or get_default_manager().registry
    out = []
    for w in winners:
        ms = by_band.get(band_key(w))
        fl = fl_pick(ms, policy, registry) if ms else None
        if fl is not None and fl["impl_id"] == w["impl_id"]:
            out.append(w)
            continue
        if fl is None or fl["outcome"] != "timed":
            # never serve a pick known to fail; say so in the band, so the arm is auditable
            why = (f"FL pick {fl['impl_id']} not usable ({fl['outcome']}); measured winner "
                   f"kept" if fl else "no FL pick measured; measured winner kept")
            out.append({**w, "reason": why})
            continue
        out.append({**w, "impl_id": fl["impl_id"], "kind": fl["kind"], "vendor": fl["vendor"],
                    "median_us": fl["median_us"], "runner_up": None, "runner_up_us": None,
                    "gap": None, "reason": "fixed FL order"})
    return out


def _permitted(w: dict, policy: SelectionPolicy) -> bool:
    v = w.get("vendor")
    if v is None:
        return True
    if v in policy.deny_vendors:
        return False
    return not policy.allow_vendors or v in policy.allow_vendors


def _best_permitted(db, dev, w, policy):
    rows = db.measurements(dev["device_key"], dev["driver"], op=w["op"],
                           signature=w["signature"], dtype=w["dtype"], band_hi=w["band_hi"],
                           outcome="timed")
    rows = [r for r in rows if _permitted(r, policy)]
    return min(rows, key=lambda r: r["median_us"]) if rows else None


def _callable(registry, op, impl_id):
    if registry is None:
        return None
    try:
        return registry.get(op, impl_id).callable_path
    except KeyError:
        return None


#: the candidate that stands for vLLM's own compiled path: an op left native is lowered by
#: Inductor inside vLLM's graph, as this candidate lowers it alone
NATIVE_COMPILED = "reference.inductor"


def _refined_edge(crossovers: dict, prev: Optional[dict], w: dict) -> Optional[dict]:
    """The stored crossover between the winner rows ``prev`` and ``w`` of two adjacent
    bands, if it still holds: the same two winners (after policy overrides), the same
    stack as both, the edge inside ``[prev.hi, w.hi)``."""
    if not crossovers or prev is None or prev["band_hi"] + 1 != w["band_lo"]:
        return None
    from .tune.crossover import crossover_valid
    c = crossovers.get((w["op"], w["signature"], w["dtype"], prev["band_hi"]))
    return c if c is not None and crossover_valid(c, prev, w) else None


def _tables(rows: list[dict], registry, native: Optional[dict] = None,
            crossovers: Optional[dict] = None) -> dict:
    """Per op, its tables of merged bands. Each table also keeps ``points``: every measured
    band before merging, as [lo, hi, winner, winner µs, native-compiled µs or None]. The
    vLLM plugin needs them to weigh a win against the fusion a routed op gives up (an
    opaque custom op cannot be fused by Inductor with its neighbours; see
    ``integrations/vllm/plugin.py``), and merged bands would hide the small-token end.

    Where a valid refined crossover (``crossovers``, from ``fltune refine``) sits between
    two differing winners, the lower band's ``hi`` becomes the crossover's edge — tokens
    ``<= edge`` go to the lower winner, as the band rule reads ``(edge[i-1], edge[i]]`` and
    ``FrozenDispatch.select`` bisects — and the upper band's ``lo`` becomes edge + 1; the
    lower band records ``refined``, its ``coarse_hi`` and the ``crossover_probes``."""
    native = native or {}
    by_table = defaultdict(list)
    for w in rows:
        by_table[(w["op"], w["dtype"], w["signature"])].append(w)
    ops: dict = {}
    for (op, dtype, sig), ws in sorted(by_table.items()):
        ws.sort(key=lambda r: r["band_hi"])
        dims = json.loads(ws[0]["dims"])
        trailing, rpt = key_shape(op, dims)
        bands = []
        prev_row = None
        for w in ws:
            entry = {"lo": w["band_lo"], "hi": w["band_hi"], "impl_id": w["impl_id"],
                     "kind": w["kind"], "vendor": w["vendor"],
                     "callable": _callable(registry, op, w["impl_id"]),
                     "median_us": w["median_us"], "runner_up": w["runner_up"],
                     "runner_up_us": w["runner_up_us"], "gap": w["gap"], "merged": 1}
            if bands and bands[-1]["impl_id"] == entry["impl_id"] and bands[-1]["hi"] + 1 == entry["lo"]:
                prev = bands[-1]
                prev["hi"] = entry["hi"]
                prev["merged"] += 1
                prev["median_us"] = entry["median_us"]      # time at the (new) top edge
                prev["runner_up"], prev["runner_up_us"], prev["gap"] = (
                    entry["runner_up"], entry["runner_up_us"], entry["gap"])
            else:
                c = _refined_edge(crossovers, prev_row, w) if bands else None
                if c is not None:
                    bands[-1].update({"hi": c["edge_tokens"], "refined": True,
                                      "coarse_hi": prev_row["band_hi"],
                                      "crossover_probes": c["probes"]})
                    entry["lo"] = c["edge_tokens"] + 1
                bands.append(entry)
            prev_row = w
        weight = max(w["weight"] or 0 for w in ws)
        points = [[w["band_lo"], w["band_hi"], w["impl_id"], w["median_us"],
                   native.get((op, sig, dtype, w["band_hi"]))] for w in ws]
        table = {"dtype": dtype, "signature": sig, "dims": dims, "trailing": trailing,
                 "rows_per_token": rpt, "weight": weight, "bands": bands, "points": points}
        ops.setdefault(op, {"tables": [], "shadowed": []})["tables"].append(table)
    for op, entry in ops.items():
        # Two signatures can share one runtime key (q_norm and k_norm: same head_dim and
        # dtype, different rows per token). The runtime sees only (dtype, trailing shape),
        # so the table of the more-called signature serves that key; the other is listed.
        keep: dict = {}
        for t in sorted(entry["tables"], key=lambda t: -t["weight"]):
            k = (t["dtype"], tuple(t["trailing"]))
            if k in keep:
                entry["shadowed"].append({"signature": t["signature"], "dtype": t["dtype"],
                                          "served_by": keep[k]["signature"]})
            else:
                keep[k] = t
        entry["tables"] = sorted(keep.values(), key=lambda t: (t["dtype"], t["signature"]))
        votes = defaultdict(int)
        for t in entry["tables"]:
            for b in t["bands"]:
                votes[b["impl_id"]] += t["weight"] * b["merged"]
        entry["fallback"] = max(sorted(votes), key=lambda i: votes[i])
        entry["native_everywhere"] = all(b["kind"] == "reference" for t in entry["tables"]
                                         for b in t["bands"])
    return ops


def check_device(manifest: dict) -> Optional[str]:
    """None if the manifest was measured on this machine's device and driver, else why not."""
    d = manifest.get("device", {})
    if d.get("device_type") == "cuda" and not torch.cuda.is_available():
        return (f"manifest is for {d.get('name')} [{d.get('device_key')}], a CUDA device; "
                f"this machine has none")
    me = devmod.current(d.get("device_type") if d.get("device_type") in ("cpu", "cuda") else None)
    if d.get("device_key") != me["device_key"]:
        return (f"manifest is for {d.get('name')} [{d.get('device_key')}], this machine is "
                f"{devmod.label(me)} [{me['device_key']}]")
    if manifest.get("driver") != me["driver"]:
        return f"manifest is for driver {manifest.get('driver')}, this machine has {me['driver']}"
    return None


def manifest_for_this_device(db_path: str, *, strict: bool = False, policy=None,
                             registry=None) -> tuple[dict, list[str]]:
    """What serving uses with ``FLTUNE_DB``: freeze the DB for this machine's device."""
    return build_manifest(db_path, policy=policy, strict=strict, registry=registry)


def write_manifest(manifest: dict, path: str) -> None:
    import os
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, path)   # atomic: a reader never sees half a manifest
