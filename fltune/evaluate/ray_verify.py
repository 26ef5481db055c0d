"""``fltune verify --ray``: re-time every node's winners on that node, and name the nodes that
drifted.

Why: ``fltune verify`` re-times the DB's winners on the machine it runs on; in a fleet the
question is *which* machine no longer matches its calibration (a driver update on one host, a
card that throttles, a node whose stack changed). So one actor is pinned to each live node of
the Ray cluster (``NodeAffinitySchedulingStrategy``, one GPU of it — or one CPU on a cluster
without GPUs, or with ``--device cpu``), shipped the DB's winners (the DB stays on the driver's
host: other hosts cannot open it), and each races the winners of *its own* device key against
their runner-ups with ``verify.verify_band`` — the same race and the same drift rules as
``fltune verify``, with the margin each winner's run used. A node whose device the DB does not
hold is named as uncalibrated rather than silently passed. Nothing is written.

Ray stays optional: the actor class is plain Python, wrapped by ``ray.remote`` only here, at
run time (``tune/ray_calibrate.py``: :func:`connect`, :func:`import_ray`).
"""
from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from ..tune.ray_calibrate import RayError, _resources, _stop, connect


class Verifier:
    """One verifying actor on one node: its own race worker and registry."""

    def __init__(self, device: str, isolate: bool, candidate_timeout: float):
        from ..dispatch.manager import OpManager
        from ..store import device as devmod
        from ..tune.worker import racer

        self.device = device
        self.registry = OpManager().registry
        self.pool = racer(isolate, candidate_timeout)
        self.dev = dict(devmod.current(device))

    def info(self) -> dict:
        import ray
        return {"host": socket.gethostname(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def verify(self, payload: dict) -> dict:
        """Re-time the DB's winners for this actor's device (``verify.verify_band``)."""
        return _verify_here(self.dev, self.device, self.pool, self.registry, payload)

    def close(self) -> bool:
        self.pool.close()
        return True


def _verify_here(me: dict, device: str, pool, registry, payload: dict) -> dict:
    """The winners of ``me``'s device key (same driver, else its newest calibration, with a
    note) raced again; a ``fltune.verify/1``-shaped document."""
    from ..tune.race import WIN_MARGIN
    from .verify import verify_band

    t0 = time.perf_counter()
    rows = [d for d in payload["devices"] if d["device_key"] == me["device_key"]]
    out = {"device": me, "db_device": None, "notes": [], "bands": [], "counts": {},
           "stale": False, "stale_bands": 0, "checked": 0}
    if not rows:
        out["status"] = "uncalibrated"
        return out
    same = [r for r in rows if r["driver"] == me["driver"]]
    row = same[0] if same else max(rows, key=lambda r: r.get("last_run") or 0)
    if not same:
        out["notes"].append(f"driver changed: calibrated with {row['driver']}, running "
                            f"{me['driver']}")
    out["db_device"] = row
    key = f"{row['device_key']}|{row['driver']}"
    meas = {tuple(m[:5]): m[5] for m in payload["meas"].get(key, [])}
    margins = {int(k): v for k, v in payload["margins"].items()}
    for w in payload["winners"].get(key, []):
        rec = verify_band(w, meas, registry, device, pool=pool,
                          margin=margins.get(w["run_id"], WIN_MARGIN),
                          noise_floor=payload["noise_floor"], reps=payload["reps"],
                          budget_s=payload["budget_s"], graph_calls=payload["graph_calls"],
                          seed=payload.get("seed", 0))
        out["bands"].append(rec)
        out["counts"][rec["status"]] = out["counts"].get(rec["status"], 0) + 1
    out["checked"] = len(out["bands"])
    out["stale_bands"] = sum(b["status"] != "ok" for b in out["bands"])
    out["stale"] = bool(out["stale_bands"])
    out["unconfirmed"] = sum(1 for b in out["bands"] if b.get("unconfirmed"))
    out["status"] = "drifted" if out["stale"] else "ok"
    out["wall_s"] = round(time.perf_counter() - t0, 3)
    return out




def verify_ray(db_path: str, *, address: Optional[str] = None, device: Optional[str] = None,
               ops: Optional[list] = None, noise_floor: float = 0.10, reps: int = 0,
               budget_s: float = 0.05, graph_calls: int = 20, isolate: bool = True,
               candidate_timeout: float = 120.0, seed: int = 0) -> dict:
    """Re-time every node's winners: one actor pinned to each live node (one of its GPUs;
    CPU nodes with ``device="cpu"`` or on a cluster without GPUs), each racing the winners
    the DB holds for its own device key against their runner-ups (``verify.verify_band``).
    Returns a document with one ``fltune.verify/1``-shaped entry per node and the names of
    the nodes that drifted (``drifted_nodes``) or whose device the DB does not hold
    (``uncalibrated_nodes``)."""
    from ..store import CalibrationDB
    from ..store.hints import calibrate_command

    t0 = time.perf_counter()
    db = CalibrationDB(db_path, create=False)
    try:
        devices = db.devices()
        winners, meas = {}, {}
        for d in devices:
            key = f"{d['device_key']}|{d['driver']}"
            ws = db.winners(d["device_key"], d["driver"])
            winners[key] = [w for w in ws if not ops or w["op"] in ops]
            meas[key] = [[m["op"], m["signature"], m["dtype"], m["band_hi"], m["impl_id"],
                          {"timer": m["timer"]}]
                         for m in db.measurements(d["device_key"], d["driver"])
                         if m.get("timer")]
        runs = {r["id"]: r for r in db.runs()}
    finally:
        db.close()
    margins = {}
    for rid, r in runs.items():
        try:
            m = json.loads(r.get("settings") or "{}").get("margin")
        except ValueError:
            m = None
        if m is not None:
            margins[str(rid)] = m
    payload = {"devices": devices, "winners": winners, "meas": meas, "margins": margins,
               "noise_floor": noise_floor, "reps": reps, "budget_s": budget_s,
               "graph_calls": graph_calls, "seed": seed}
    ray, started = connect(address)
    handles = []
    try:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        res = ray.cluster_resources()
        kind = device or ("cuda" if res.get("GPU") else "cpu")
        if kind == "cuda" and not res.get("GPU"):
            raise RayError(f"--device cuda: the Ray cluster has no GPU (resources: "
                           f"{_resources(res)}); use --device cpu")
        nodes = [x for x in ray.nodes() if x.get("Alive")]
        need = "GPU" if kind == "cuda" else "CPU"
        usable = [x for x in nodes if x.get("Resources", {}).get(need, 0) >= 1]
        skipped = [x.get("NodeManagerHostname") or x.get("NodeManagerAddress")
                   for x in nodes if x not in usable]
        remote = ray.remote(Verifier)
        for x in usable:
            opts = {"num_gpus": 1, "num_cpus": 1} if kind == "cuda" else {"num_cpus": 1}
            handles.append(remote.options(
                max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    x["NodeID"], soft=False), **opts).remote(kind, isolate, candidate_timeout))
        refs = [h.verify.remote(payload) for h in handles]
        infos = [h.info.remote() for h in handles]
        out_nodes = []
        for x, ref, iref in zip(usable, refs, infos):
            name = x.get("NodeManagerHostname") or x.get("NodeManagerAddress")
            try:
                doc = ray.get(ref)
                inf = ray.get(iref)
                name = f"{inf['host']} ({x.get('NodeManagerAddress')})"
            except ray.exceptions.RayError as e:
                doc = {"status": "failed", "error": str(e).strip().splitlines()[-1][:400],
                       "bands": [], "counts": {}, "stale": False, "checked": 0,
                       "stale_bands": 0, "notes": [], "device": None, "db_device": None}
            doc.update({"node": name, "node_id": x["NodeID"], "db": str(db_path),
                        "noise_floor": noise_floor, "format": "fltune.verify/1"})
            doc.setdefault("wall_s", 0.0)
            if doc.get("db_device"):
                rid = next((w["run_id"] for w in winners.get(
                    f"{doc['db_device']['device_key']}|{doc['db_device']['driver']}", [])
                    if w["run_id"] in runs), None)
                doc["recalibrate"] = [calibrate_command(db_path, runs[rid], force=True)
                                      + " --ray"] if rid else []
            out_nodes.append(doc)
    finally:
        if handles:
            _stop(ray, handles)
        if started:
            ray.shutdown()
    drifted = [d["node"] for d in out_nodes if d["status"] == "drifted"]
    return {"format": "fltune.verify-ray/1", "db": str(db_path), "device_type": kind,
            "nodes": out_nodes, "drifted_nodes": drifted,
            "uncalibrated_nodes": [d["node"] for d in out_nodes
                                   if d["status"] == "uncalibrated"],
            "failed_nodes": [d["node"] for d in out_nodes if d["status"] == "failed"],
            "skipped_nodes": skipped, "stale": bool(drifted),
            "checked": sum(d["checked"] for d in out_nodes),
            "wall_s": round(time.perf_counter() - t0, 3)}
