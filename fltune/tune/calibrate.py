"""``fltune calibrate``: workload -> adjudication per (op, shape, dtype, band) -> DB.

Resumable by construction: each finished (op, band) is one transaction, and before
measuring a band the calibrator asks the DB whether it is already measured for this
device, driver and stack — so a killed run, rerun, measures only what is missing, and a
warm rerun measures nothing. ``force=True`` re-measures (rows are replaced, not added).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..dispatch.manager import OpManager
from ..ops import dtype_from_name, get_op
from ..store import CalibrationDB
from ..store import device as devmod
from . import noise as noisemod
from .adjudicate import rows_for_db
from .bands import bands, max_tokens_for
from .race import Settings, cold_weights_unused, rotated_weights, timing_regime
from .worker import racer
from .workload import Workload, derive


@dataclass
class CalibrationResult:
    db_path: str
    run_id: int
    device: dict
    workload: Workload
    measured: int = 0          # (op, band) adjudicated in this run
    skipped: int = 0           # already in the DB for this device/driver/stack
    winners: list = field(default_factory=list)
    wall_s: float = 0.0
    worker_restarts: int = 0
    noise: dict = field(default_factory=dict)   # the machine-noise watch (tune/noise.py)
    #: lines about the run's switches the user should read, printed as they are found
    #: (``--cold-weights`` that changed nothing: ``race.cold_weights_unused``)
    notes: list = field(default_factory=list)

    def as_dict(self):
        return {"db": self.db_path, "run_id": self.run_id,
                "device": {k: self.device[k] for k in ("device_key", "name", "driver")},
                "model": self.workload.model, "tp": self.workload.tp,
                "dtype": self.workload.dtype, "measured": self.measured,
                "skipped": self.skipped, "wall_s": round(self.wall_s, 3),
                "worker_restarts": self.worker_restarts,
                "noise": self.noise, "undecided": self.noise.get("undecided", 0),
                "notes": self.notes, "winners": self.winners}


def measure_band(pool, manager: OpManager, op: str, dims: dict, signature: str, dtype,
                 band, *, device: dict, stack_key: str, run_id: int, weight: int,
                 settings: Settings, machine_noise: Optional[float]):
    """One band as calibrate stores it: the race (in ``pool``: a supervised worker or this
    process) over every registered candidate, the verdict settled against its noise
    (``noise.settle``), and the rows it writes. Returns ``(measurements, winner,
    undecided)``; nothing is written here, so the caller commits the band in one
    transaction — calibrate itself, or the Ray driver (``ray_calibrate.py``), whose actors
    run this same function on their GPUs."""
    impls = manager.registry.get_implementations(op)
    verdict = pool.race(op, dims, dtype, band, impls, settings)
    verdict, undecided, _ = noisemod.settle(
        verdict, settings.margin, [i.impl_id for i in manager.policy.order(op, impls)])
    rows, win = rows_for_db(verdict, device=device, stack_key=stack_key, op=op,
                            signature=signature, dims=dims, dtype=dtype, band=band,
                            run_id=run_id, weight=weight)
    if win:
        win.update(undecided=int(undecided), machine_noise=machine_noise)
    return rows, win, bool(undecided)


def calibrate(model: str, db_path: str, *, tp: int = 1, dtype: Optional[str] = None,
              max_tokens: Optional[int] = None, settings: Optional[Settings] = None,
              ops: Optional[list] = None, force: bool = False,
              manager: Optional[OpManager] = None,
              progress: Optional[Callable] = None, isolate: bool = False,
              candidate_timeout: float = 120.0,
              warn: Optional[Callable[[str], None]] = None) -> CalibrationResult:
    """``isolate=True`` runs every race in a supervised worker process (``tune/worker.py``):
    a candidate that crashes, hangs or poisons the CUDA context is recorded as refused
    and the calibration goes on. The CLI turns it on by default.

    The machine's own noise is probed at the start, before each workload item and at the
    end (``tune/noise.py``); ``warn(line)`` (default: stderr) gets one line at once when
    the machine is loaded, and a band whose noise exceeds its win margin is stored
    undecided (``winners.undecided``)."""
    t0 = time.perf_counter()
    settings = settings or Settings()
    workload = derive(model, tp=tp, dtype=dtype)       # validates before anything is written
    if ops:
        workload.restrict(ops)
    max_tokens = max_tokens_for(settings.device, max_tokens)
    band_list = bands(max_tokens)
    manager = manager or OpManager()
    dev = devmod.current(settings.device)
    stack = devmod.stack()
    skey = devmod.stack_key(stack)
    db = CalibrationDB(db_path)
    db.upsert_device(dev)
    run_id = db.start_run(dev, workload.model, workload.dtype, tp,
                          {**settings.recorded(), "max_tokens": max_tokens,
                           **({"ops": sorted(ops)} if ops else {})}, stack, skey)
    result = CalibrationResult(db_path, run_id, dev, workload)
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    watch = noisemod.Watch(db, run_id, dev, settings.device, warn, db_path, workload.model,
                           max_tokens, ops, tp)
    # what --cold-weights met: the (op, band) pairs raced and skipped, and the raced bands
    # whose timers rotated copies of the weights (``race.cold_weights_unused``)
    raced, cached, rotated = [], [], 0
    probed_item = None
    # an item capped below the top band (the LM head: sampled rows only) skips the bands
    # above its cap; its table's last band then serves anything larger
    tasks = [(item, band) for item in workload.items for band in band_list
             if item.max_tokens is None or band.lo <= item.max_tokens]
    last_of = {id(item): band for item, band in tasks}
    if progress:
        progress("start", total=len(tasks))
    status = "failed"
    pool = racer(isolate, candidate_timeout)
    try:
        watch.probe("start")
        for item, band in tasks:
            dims = item.dims_dict
            sig = item.signature
            dt = dtype_from_name(item.dtype)
            spec = get_op(item.op)
            if not force and db.has_band(dev["device_key"], dev["driver"], skey, item.op, sig,
                                         item.dtype, band.hi, timing_regime(spec, band, settings),
                                         spec.context(dims)):
                result.skipped += 1
                cached.append((item.op, band))
                if progress:
                    progress("skip", op=item.op, band=band, signature=sig, dtype=item.dtype,
                             last=band is last_of[id(item)])
                continue
            if probed_item is not item:
                if probed_item is not None:
                    watch.probe(f"before {item.op}")
                probed_item = item
            rows, win, undecided = measure_band(
                pool, manager, item.op, dims, sig, dt, band, device=dev, stack_key=skey,
                run_id=run_id, weight=item.calls, settings=settings,
                machine_noise=watch.spread)
            watch.undecided += undecided
            db.record_band(rows, win)
            result.measured += 1
            raced.append((item.op, band))
            rotated += rotated_weights(rows)
            if win:
                result.winners.append({k: win[k] for k in ("op", "signature", "dtype", "band_lo",
                                                           "band_hi", "impl_id", "median_us",
                                                           "undecided")})
            if progress:
                progress("band", op=item.op, band=band, winner=win, signature=sig,
                         dtype=item.dtype, last=band is last_of[id(item)])
        watch.probe("end")
        status = "done"
        note = cold_weights_unused(settings, raced, cached, rotated)
        if note:
            result.notes.append(note)
            warn(note)
    except KeyboardInterrupt:
        status = "interrupted"      # every finished band is saved; a rerun resumes
        raise
    finally:
        result.noise = watch.as_dict()
        result.worker_restarts = pool.restarts
        pool.close()
        db.finish_run(run_id, status)
        db.close()
    result.wall_s = time.perf_counter() - t0
    return result
