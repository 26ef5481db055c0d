"""``fltune calibrate --ray``: calibration across the GPUs and hosts
of a Ray cluster (Ray is what vLLM itself runs on across hosts), into the one DB.

Why: a fleet has many GPUs of a few kinds. Each *kind* — a device key under one driver and
one software stack, the key every DB row has — must be measured once, not once per card and
not by hand per host; and one GPU of a kind measuring a whole model is slow when the others
sit idle.

**Actors.** One calibrating actor per GPU (``num_gpus=1``: Ray hands each its own card, so
torch's device 0 is that card and ``device.current()`` describes it). Where the cluster has
no GPU (or ``--device cpu``), ``num_cpus=1`` actors stand in: the same class, the same
calls, the same driver — which is what the CPU tests run. (Ray runs such an actor's torch on
one thread, ``OMP_NUM_THREADS=1``, so its CPU timings are not those of a whole-machine
``fltune calibrate``: CPU actors exercise the distribution, GPU actors are the point.)
Each actor reports its device record and stack; actors with the same (device key, driver,
stack key) form a **group** that shares that kind's work; different groups get their own
``devices`` row, ``runs`` row and rows of results, exactly as separate calibrations on each
machine would.

**The work unit is one band** of one (op, shape, dtype) table — ``calibrate``'s unit: one
race (every candidate interleaved on one input size), one verdict settled against its
noise, one transaction. A band is never split: its candidates must be timed side by side on
one GPU, or their comparison means nothing. Bands of one table *prefer* the actor that
started the table, because that actor holds the table's compiled graphs (Inductor, CUDA
graphs) and its race worker warm; an actor with nothing left takes a whole unstarted table,
and when none is left it takes over the later half of the busiest peer's remaining bands
(so the last table does not run on one GPU while the others idle).

**Writes.** Actors never touch the DB (it is one SQLite file on the driver's host; other
hosts cannot reach it, and SQLite over a network file system is not safe). They run
``calibrate.measure_band`` — the race in their supervised worker (``worker.py``), the
noise settlement, the rows — and return plain rows. The driver alone writes them, each
band in its own ``BEGIN IMMEDIATE`` transaction through ``CalibrationDB.record_band``, and
asks ``has_band`` before scheduling a band, as ``calibrate`` does: so a killed actor loses
only its band in flight (the driver gives that band, and the rest of the actor's table, to
a live actor of the same group), a killed driver loses only the bands in flight, and the
same command rerun measures exactly what is missing. When every actor of a group has died,
that group's run is stored ``incomplete`` and the command says to rerun.

**GPU-to-GPU spread.** Two cards of one kind are not identical (clocks, thermals, the
host's PCIe and NUMA placement). Where a group has two or more live actors, a sample of
bands (every ``spread_every``-th band of each table, decode and prefill sizes both) is
raced again on a second card; the relative difference of the winner's median between the
two cards is stored as noise: folded into ``winners.noise`` (the band's noise, which
``fltune verify`` takes as its drift threshold: a difference between cards is not drift)
and kept as a ``noise_probes`` row (phase ``peer-spread …``, beside the machine probes of
that run), in the same transaction as the band. The sampled band is written once, when
both cards have measured it (or the second could not). The undecided flag stays the first
card's judgement; the spread does not re-pick a winner. The cost: the second card compiles
(or loads from Inductor's cache) the sampled band's table too; ``--ray-spread-every 0`` turns
the sampling off.

``fltune verify --ray`` (``evaluate/ray_verify.py``) joins the cluster with :func:`connect`
and pins one verifying actor to each node.

Ray is optional (``pip install 'fltune[ray]'``): nothing here imports it at module level,
and :func:`import_ray` turns its absence into one line naming the way out.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

#: the way to install Ray that every error here names
INSTALL_HINT = "pip install 'fltune[ray]'"
#: seconds the driver waits for actors to start (import torch, vLLM, discover backends)
READY_TIMEOUT_S = 900
#: every n-th band of a table is also raced on a second card of its kind (0: none)
SPREAD_EVERY = 4


class RayError(RuntimeError):
    """Ray missing, the cluster unreachable or unable to host the actors: one line naming
    the problem and the way out."""


def import_ray():
    """``ray``, or :class:`RayError` naming how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RayError(f"--ray needs Ray, which is not installed in this Python ({e}); "
                       f"install it with `{INSTALL_HINT}`, or leave --ray out to work on this "
                       f"machine alone") from None
    return ray


def connect(address: Optional[str] = None):
    """Join (or start) a Ray cluster. ``address``: None or ``"local"`` is Ray's own rule
    (``RAY_ADDRESS``, else the cluster running on this host, else a new local one),
    ``"auto"`` an existing cluster only, else ``HOST:PORT`` or ``ray://HOST:PORT``. Returns
    ``(ray, started)``: ``started`` when this call initialised Ray (the caller shuts it down
    again). An already initialised Ray (a test's, a notebook's) is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    target = address if address not in (None, "", "local") else os.environ.get("RAY_ADDRESS")
    if target and target != "auto":
        _reachable(target)
    import logging
    kw = {"include_dashboard": False, "log_to_driver": False,
          "logging_level": logging.WARNING}
    try:
        if address in (None, "", "local"):
            ray.init(**kw)
        else:
            ray.init(address=address, **kw)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"at {address}" if address not in (None, "", "local") else "locally"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RayError(f"cannot start or reach a Ray cluster {where} ({first}); start one with "
                       f"`ray start --head` and pass its address (--ray HOST:6379, or --ray "
                       f"auto on a node of it), or use --ray alone for a local cluster") from None
    return ray, True


def _reachable(address: str, timeout_s: float = 10.0) -> None:
    """:class:`RayError` unless something accepts a TCP connection at ``address``
    (``HOST:PORT`` or ``ray://HOST:PORT``). Why: Ray retries an address where nothing
    listens for ever (a typo in --ray hangs the command with a log line every 30 s)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise RayError(f"--ray {address!r}: expected HOST:PORT (the head's GCS port, 6379 by "
                       f"default), ray://HOST:PORT, auto, or nothing for a local cluster")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RayError(f"--ray {address}: nothing answers there ({e.strerror or e}); start "
                       f"the cluster with `ray start --head` on its head node and pass the "
                       f"address it prints, or use --ray alone for a local cluster") from None


# ---- the actors ------------------------------------------------------------------------------

class Calibrator:
    """One calibrating actor: one GPU (or one CPU stand-in), its own supervised race worker
    and registry, warm across the bands it is given. Plain data in, plain rows out."""

    def __init__(self, device: str, isolate: bool, candidate_timeout: float):
        from ..dispatch.manager import OpManager
        from ..store import device as devmod
        from .worker import racer

        self.device = device
        self.manager = OpManager()
        self.pool = racer(isolate, candidate_timeout)
        self.dev = dict(devmod.current(device))
        self.stack = devmod.stack()
        self.skey = devmod.stack_key(self.stack)
        self.item = None
        self.spread = None

    def info(self) -> dict:
        import ray
        ctx = ray.get_runtime_context()
        return {"device": self.dev, "stack": self.stack, "stack_key": self.skey,
                "node_id": ctx.get_node_id(), "host": socket.gethostname(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "pid": os.getpid()}

    def probe(self, phase: str) -> dict:
        """The machine probe of ``noise.py`` on this actor's device (stored by the driver)."""
        from . import noise as noisemod
        p = noisemod.probe(self.device)
        self.spread = p.spread
        return {"phase": phase, **p.row(), "loaded": noisemod.loaded(p)}

    def band(self, job: dict) -> dict:
        """Measure one band (``calibrate.measure_band``); a probe first when the band starts
        a new (op, shape, dtype), as ``calibrate`` probes before each workload item."""
        from ..ops import dtype_from_name
        from .bands import Band
        from .calibrate import measure_band
        from .race import Settings

        probes = []
        key = (job["op"], job["signature"], job["dtype"])
        # a second card's re-race of a sampled band (``peer``) is an interruption, not a new
        # workload item: no probe for it, and none when this actor returns to its own table
        if not job.get("peer") and self.item != key:
            if self.item is not None:
                probes.append(self.probe(f"before {job['op']}"))
            self.item = key
        rows, win, undecided = measure_band(
            self.pool, self.manager, job["op"], job["dims"], job["signature"],
            dtype_from_name(job["dtype"]), Band(job["lo"], job["hi"]), device=self.dev,
            stack_key=self.skey, run_id=job["run_id"], weight=job["weight"],
            settings=Settings(**job["settings"]), machine_noise=self.spread)
        return {"rows": rows, "win": win, "undecided": bool(undecided), "probes": probes,
                "restarts": self.pool.restarts}

    def close(self) -> bool:
        self.pool.close()
        return True


# ---- choosing the actors -----------------------------------------------------------------

def plan(ray, device: Optional[str], actors: Optional[int]) -> tuple[str, int, dict]:
    """``(device type, number of actors, actor options)`` for this cluster: one actor per
    GPU (``num_gpus=1``) when it has GPUs, else (or with ``device="cpu"``) one ``num_cpus=1``
    stand-in per node. ``actors`` caps (GPU) or sets (CPU) the number."""
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    cpus = int(res.get("CPU", 0))
    if device == "cuda" and not gpus:
        raise RayError(f"--device cuda: the Ray cluster has no GPU (resources: "
                       f"{_resources(res)}); use --device cpu for CPU actors, or join a "
                       f"cluster with GPUs")
    kind = device or ("cuda" if gpus else "cpu")
    if kind == "cuda":
        n = gpus if actors is None else actors
        if n > gpus:
            raise RayError(f"--ray-actors {n}: the Ray cluster has {gpus} GPU(s), and each "
                           f"actor takes one; use --ray-actors {gpus} or fewer")
        return kind, n, {"num_gpus": 1, "num_cpus": 1}
    nodes = [x for x in ray.nodes() if x.get("Alive")]
    n = actors if actors is not None else max(1, len(nodes))
    if n > cpus:
        raise RayError(f"--ray-actors {n}: the Ray cluster has {cpus} CPU(s), and each CPU "
                       f"actor takes one; use --ray-actors {max(cpus, 1)} or fewer")
    return kind, n, {"num_cpus": 1, "num_gpus": 0, "scheduling_strategy": "SPREAD"}


def _resources(res: dict) -> str:
    keep = {k: v for k, v in res.items() if k in ("CPU", "GPU", "memory")}
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items())) or "none"


def _start(ray, cls, n: int, opts: dict, args: tuple, tag: str) -> tuple[list, list[dict]]:
    """``n`` named actors of ``cls`` (no restarts: a dead actor's band goes to a live one),
    and their :meth:`Calibrator.info`, or :class:`RayError` when they cannot start."""
    remote = ray.remote(cls)
    names = [f"fltune-{tag}-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    handles = [remote.options(name=names[i], max_restarts=0, max_task_retries=0,
                              **opts).remote(*args) for i in range(n)]
    try:
        infos = ray.get([h.info.remote() for h in handles], timeout=READY_TIMEOUT_S)
    except Exception as e:
        for h in handles:
            ray.kill(h)
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RayError(f"the Ray actors did not start ({type(e).__name__}: {first}); every "
                       f"node needs this fltune installed (`{INSTALL_HINT}`) and the "
                       f"resources asked ({opts.get('num_gpus', 0)} GPU, "
                       f"{opts.get('num_cpus', 1)} CPU each)") from None
    for name, inf in zip(names, infos):
        inf["name"] = name
    return handles, infos


def _stop(ray, handles) -> None:
    """Close the actors' race workers, then end the actors."""
    live = []
    for h in handles:
        try:
            live.append(h.close.remote())
        except Exception:
            pass
    try:
        ray.wait(live, num_returns=len(live), timeout=30)
    except Exception:
        pass
    for h in handles:
        try:
            ray.kill(h)
        except Exception:
            pass


# ---- calibrate -----------------------------------------------------------------------------

@dataclass
class Group:
    """The actors of one device key, driver and stack: one ``runs`` row, shared work."""
    device: dict
    stack: dict
    stack_key: str
    members: list                                   # actor indices
    run_id: int = 0
    measured: int = 0
    skipped: int = 0
    undecided: int = 0
    tables: deque = field(default_factory=deque)    # unstarted tables: deques of jobs
    peers: deque = field(default_factory=deque)     # (primary actor, job) to re-race
    left: dict = field(default_factory=dict)        # table key -> bands not yet written
    spreads: list = field(default_factory=list)     # {"op", ..., "spread"} per sample
    warned: bool = False
    status: str = "running"

    @property
    def key(self) -> tuple:
        return (self.device["device_key"], self.device["driver"], self.stack_key)

    def as_dict(self, infos) -> dict:
        sp = [s["spread"] for s in self.spreads if s["spread"] is not None]
        return {"device": {k: self.device[k] for k in ("device_key", "name", "driver")},
                "stack_key": self.stack_key, "run_id": self.run_id, "status": self.status,
                "actors": [_where(infos[i]) for i in self.members],
                "measured": self.measured, "skipped": self.skipped,
                "undecided": self.undecided, "missing": sum(self.left.values()),
                "spread_samples": self.spreads,
                "spread_max": max(sp) if sp else None,
                "spread_median": sorted(sp)[len(sp) // 2] if sp else None}


def _where(info: dict) -> str:
    g = ",".join(info.get("gpu_ids") or [])
    return f"{info['host']}" + (f" gpu {g}" if g else f" pid {info['pid']}")


@dataclass
class RayCalibrationResult:
    db_path: str
    model: str
    tp: int
    dtype: str
    device_type: str
    actors: list                  # per actor: where, device key, bands measured, alive
    groups: list                  # Group.as_dict per device kind
    wall_s: float = 0.0
    incomplete: bool = False
    warnings: list = field(default_factory=list)

    @property
    def measured(self) -> int:
        return sum(g["measured"] for g in self.groups)

    @property
    def skipped(self) -> int:
        return sum(g["skipped"] for g in self.groups)

    def as_dict(self) -> dict:
        return {"db": self.db_path, "model": self.model, "tp": self.tp, "dtype": self.dtype,
                "device_type": self.device_type, "measured": self.measured,
                "skipped": self.skipped, "incomplete": self.incomplete,
                "wall_s": round(self.wall_s, 3), "actors": self.actors,
                "groups": self.groups, "warnings": self.warnings}


def calibrate_ray(model: str, db_path: str, *, address: Optional[str] = None,
                  device: Optional[str] = None, actors: Optional[int] = None, tp: int = 1,
                  dtype: Optional[str] = None, max_tokens: Optional[int] = None,
                  settings=None, ops: Optional[list] = None, force: bool = False,
                  isolate: bool = True, candidate_timeout: float = 120.0,
                  spread_every: int = SPREAD_EVERY, progress: Optional[Callable] = None,
                  warn: Optional[Callable[[str], None]] = None) -> RayCalibrationResult:
    """Calibrate ``model`` on the actors of a Ray cluster into ``db_path`` (see the module
    docstring). ``settings`` (a ``race.Settings``) gives the race's knobs; its device is set
    from the actors. ``progress(event, **kw)``: ``start`` (total, actors: their names and
    places), ``band`` / ``skip`` (op, band, winner, signature, dtype, last, actor) — the
    events of ``calibrate``'s progress, so the same renderer draws them."""
    from .workload import derive

    t0 = time.perf_counter()
    warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
    import_ray()                                      # the way out before anything is done
    workload = derive(model, tp=tp, dtype=dtype)      # validates before anything starts
    if ops:
        workload.restrict(ops)
    ray, started = connect(address)
    try:
        s = _resolve_settings(ray, device=device, actors=actors, settings=settings,
                              max_tokens=max_tokens, ops=ops, force=force, isolate=isolate,
                              candidate_timeout=candidate_timeout, spread_every=spread_every)
    except BaseException:
        if started:                                   # nothing else has started yet
            ray.shutdown()
        raise
    return _RayCalibration(ray, started, workload, db_path, s, tp=tp, progress=progress,
                           warn=warn, t0=t0).run()


@dataclass(frozen=True)
class _RaySettings:
    """:func:`calibrate_ray`'s settings, resolved against the cluster and checked by
    :func:`_resolve_settings` before the DB is opened or any actor starts: the actors'
    device type, number and Ray options (:func:`plan`), the race's settings on that device,
    and the bands every table is cut into."""
    device_type: str
    actors: int
    actor_options: dict
    race: object                    # a race.Settings, its device the actors'
    max_tokens: int
    bands: list
    ops: Optional[list]
    force: bool
    isolate: bool
    candidate_timeout: float
    spread_every: int

    def recorded(self) -> dict:
        """What each group's ``runs`` row stores as its settings: ``calibrate``'s (the
        actors of the group are added beside them)."""
        return {**self.race.recorded(), "max_tokens": self.max_tokens,
                **({"ops": sorted(self.ops)} if self.ops else {})}


def _resolve_settings(ray, *, device: Optional[str], actors: Optional[int], settings,
                      max_tokens: Optional[int], ops: Optional[list], force: bool,
                      isolate: bool, candidate_timeout: float,
                      spread_every: int) -> _RaySettings:
    """:func:`calibrate_ray`'s arguments resolved into :class:`_RaySettings`. A cluster
    that cannot host the actors asked (:class:`RayError`, from :func:`plan`) is refused
    here, as ``max_tokens_for`` refuses a negative ``max_tokens`` (0 or None: the
    device's default): actors take minutes to start on a GPU node."""
    from dataclasses import replace

    from .bands import bands, max_tokens_for
    from .race import Settings

    kind, n, opts = plan(ray, device, actors)
    race = replace(settings or Settings(), device=kind)
    max_tokens = max_tokens_for(kind, max_tokens)
    return _RaySettings(device_type=kind, actors=n, actor_options=opts, race=race,
                        max_tokens=max_tokens, bands=bands(max_tokens), ops=ops,
                        force=force, isolate=isolate, candidate_timeout=candidate_timeout,
                        spread_every=spread_every)


def _band_key(job: dict) -> tuple:
    """A band's key among the sampled bands held for a second card (``held``)."""
    return (job["op"], job["signature"], job["dtype"], job["hi"])


class _RayCalibration:
    """One call of :func:`calibrate_ray`, from the actors' start to its result: the actors
    (``handles``, ``infos``, ``alive``, ``busy``), their groups (:class:`Group`), the bands
    each actor holds of its table (``own``), the bands in flight (``inflight``), the sampled
    bands waiting for a second card (``held``), and the DB the driver alone writes.

    Why a class: the stages (start the actors and group them, lay out each group's tables,
    hand out bands and collect them, write each band, end) share that state; as methods each
    stage reads it by name and can be read on its own, where as one function they were
    closures over ~25 local variables. ``run()`` calls them in order and, however it ends,
    writes every held band, finishes each group's run and stops the actors (:meth:`close`)."""

    def __init__(self, ray, started: bool, workload, db_path: str, settings: _RaySettings, *,
                 tp: int, progress: Optional[Callable], warn: Callable[[str], None],
                 t0: float):
        self.ray, self.started = ray, started
        self.workload, self.db_path, self.s = workload, db_path, settings
        self.tp = tp
        self.progress, self.warn, self.t0 = progress, warn, t0
        self.db = None
        self.handles: list = []
        self.infos: list = []
        self.groups: list[Group] = []
        self.group_of: dict = {}        # actor index -> its Group
        self.held: dict = {}            # band key -> (group, primary result, job) awaiting a peer
        self.inflight: dict = {}        # ObjectRef -> (actor index, job, is_peer)
        self.status = "failed"
        self.failure: Optional[str] = None      # the first band that failed, in words
        self.total = 0
        self.skips: list = []
        # what --cold-weights met, as calibrate keeps it (``race.cold_weights_unused``)
        self.raced: list = []
        self.rotated = 0
        n = settings.actors
        self.alive = set(range(n))
        self.own: dict = {i: deque() for i in range(n)}      # the bands of an actor's table
        self.busy: set = set()
        self.counts = {i: 0 for i in range(n)}
        self.loaded_seen: set = set()
        self.warnings: list = []

    def run(self) -> RayCalibrationResult:
        try:
            self.start_actors()
            self.lay_out_tables()
            if self.progress:
                self.progress("start", total=self.total,
                              actors=[inf["name"] for inf in self.infos],
                              places=[_where(inf) for inf in self.infos])
                for kw in self.skips:
                    self.progress("skip", **kw)
            self.start_probes()
            self.measure()
            self.end_probes()
            if self.failure:
                raise RayError(self.failure + "; every band that finished is saved: rerun "
                                              "the same command to resume")
            self.finish()
        except BaseException as e:
            if isinstance(e, KeyboardInterrupt):
                self.status = "interrupted"
            self.close(after_error=True)
            raise
        self.close(after_error=False)
        return self.result()

    # ---- start: the DB, the actors, their groups and tables ----

    def start_actors(self) -> None:
        """The actors, grouped by (device key, driver, stack key): each group one kind."""
        from ..store import CalibrationDB

        s = self.s
        # a DB that cannot be used is refused before any actor starts (minutes on a GPU node)
        self.db = CalibrationDB(self.db_path)
        self.handles, self.infos = _start(self.ray, Calibrator, s.actors, s.actor_options,
                                          (s.device_type, s.isolate, s.candidate_timeout),
                                          "cal")
        by_key: dict = {}
        for i, inf in enumerate(self.infos):
            k = (inf["device"]["device_key"], inf["device"]["driver"], inf["stack_key"])
            if k not in by_key:
                by_key[k] = Group(inf["device"], inf["stack"], inf["stack_key"], [])
                self.groups.append(by_key[k])
            by_key[k].members.append(i)
        self.group_of = {i: g for g in self.groups for i in g.members}

    def lay_out_tables(self) -> None:
        """Each group's ``devices`` and ``runs`` rows, and its tables: one deque of jobs per
        workload item, in the workload's order."""
        recorded = self.s.recorded()
        for g in self.groups:
            self.db.upsert_device(g.device)
            g.run_id = self.db.start_run(
                g.device, self.workload.model, self.workload.dtype, self.tp,
                {**recorded, "ray": {"actors": [_where(self.infos[i]) for i in g.members]}},
                g.stack, g.stack_key)
            for item in self.workload.items:
                table = self.table(g, item)
                if table:
                    g.tables.append(table)
                    g.left[(item.op, item.signature, item.dtype)] = len(table)

    def table(self, g: Group, item) -> deque:
        """``item``'s bands for group ``g``, as jobs for its actors: each band up to the
        item's own ``max_tokens``, counted in ``total``; a band the DB already holds (for this
        kind, stack and timing regime) is skipped unless ``force``, as ``calibrate`` resumes,
        and every ``spread_every``-th band is marked for a second card."""
        from ..ops import get_op
        from .race import timing_regime

        s = self.s
        dk, drv, skey = g.key
        tkey = (item.op, item.signature, item.dtype)
        skipped_before = g.skipped
        table: deque = deque()
        for idx, band in enumerate(s.bands):
            if item.max_tokens is not None and band.lo > item.max_tokens:
                continue
            self.total += 1
            if not s.force and self.db.has_band(dk, drv, skey, item.op, item.signature,
                                                item.dtype, band.hi,
                                                timing_regime(get_op(item.op), band, s.race),
                                                get_op(item.op).context(item.dims_dict)):
                g.skipped += 1
                self.skips.append({"op": item.op, "band": band, "signature": item.signature,
                                   "dtype": item.dtype, "last": False})
                continue
            table.append({"op": item.op, "dims": item.dims_dict,
                          "signature": item.signature, "dtype": item.dtype,
                          "lo": band.lo, "hi": band.hi, "run_id": g.run_id,
                          "weight": item.calls, "settings": s.race.as_dict(),
                          "sample": bool(s.spread_every) and idx % s.spread_every == 0,
                          "table": tkey})
        if not table and g.skipped > skipped_before:
            # every band of the table cached: its last skip ends the table on the progress
            # bar, as calibrate's does (a measured band's "last" does so otherwise)
            self.skips[-1]["last"] = True
        return table

    # ---- the bands: handed out, collected, written ----

    def measure(self) -> None:
        """Hand a band to every idle actor, then write what comes back, one result at a
        time, until nothing is in flight. After a band has failed no new band is handed out:
        those in flight are still awaited and written."""
        while True:
            if self.failure is None:
                for i in sorted(self.alive - self.busy):
                    job, is_peer = self.next_job(i)
                    if job is None:
                        continue
                    ref = self.handles[i].band.remote({**job, "peer": True} if is_peer
                                                      else job)
                    self.inflight[ref] = (i, job, is_peer)
                    self.busy.add(i)
            if not self.inflight:
                break
            ready, _ = self.ray.wait(list(self.inflight), num_returns=1)
            for ref in ready:
                self.collect(ref)
            self.release_unpaired()

    def next_job(self, i: int) -> tuple:
        """``(job, is_peer)`` for actor ``i``, or ``(None, False)`` when its group has
        nothing for it: first another card's sampled band to race again, then the rest of
        its own table, then an unstarted table, then the later half of the busiest peer's."""
        g = self.group_of[i]
        own = self.own
        for k, (primary, job) in enumerate(g.peers):
            if primary != i:
                del g.peers[k]
                return job, True
        if own[i]:
            return own[i].popleft(), False
        if g.tables:
            own[i] = g.tables.popleft()
            return own[i].popleft(), False
        # steal the later half of the busiest peer's remaining bands
        donor = max((j for j in g.members if j != i and j in self.alive), default=None,
                    key=lambda j: len(own[j]))
        if donor is not None and len(own[donor]) >= 2:
            half = len(own[donor]) // 2
            taken = deque(list(own[donor])[-half:])
            for _ in range(half):
                own[donor].pop()
            own[i] = taken
            return own[i].popleft(), False
        return None, False

    def collect(self, ref) -> None:
        """One finished band: written, held for a second card (a sampled band, while its
        group has another live actor), or, where it failed, handed on or noted."""
        i, job, is_peer = self.inflight.pop(ref)
        self.busy.discard(i)
        g = self.group_of[i]
        try:
            res = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as e:
            self.actor_died(i, job, is_peer, e)
            return
        except self.ray.exceptions.RayTaskError as e:
            self.failure = self.failure or (
                f"measuring {job['op']} [{job['signature']}] band <= {job['hi']} on "
                f"{_where(self.infos[i])} failed: {str(e).strip().splitlines()[-1][:400]}")
            if is_peer:
                self.write(*self.held.pop(_band_key(job)))
            return
        res["actor"] = _where(self.infos[i])
        self.counts[i] += 1
        self.record_probes(i, res.get("probes") or [])
        if is_peer:
            self.write(*self.held.pop(_band_key(job)), peer=res)
        elif job["sample"] and len([j for j in g.members if j in self.alive]) > 1 \
                and res["win"] is not None:
            self.held[_band_key(job)] = (g, res, job)
            g.peers.append((i, job))
        else:
            self.write(g, res, job)

    def start_probes(self) -> None:
        """Every actor's start probe, before its first band (calibrate's "start"). An actor
        that died since it started (a node lost meanwhile) is one the run goes on without,
        as when it dies mid-band: it holds no band yet, so there is nothing to hand on."""
        for i in range(self.s.actors):
            try:
                probe = self.ray.get(self.handles[i].probe.remote("start"))
            except self.ray.exceptions.RayActorError as e:
                self.lose_actor(i, e)
                continue
            self.record_probes(i, [probe])

    def lose_actor(self, i: int, e: Exception) -> None:
        """Actor ``i`` is dead: no band goes to it again, and the user is told why."""
        self.alive.discard(i)
        why = str(e).strip().splitlines()[0] if str(e).strip() else "died"
        self.warn(f"warning: actor {_where(self.infos[i])} died ({why[:200]}); its bands go "
                  f"to the live actors of its kind")

    def actor_died(self, i: int, job: dict, is_peer: bool, e: Exception) -> None:
        """Actor ``i`` died with ``job`` in flight: a second card's re-race leaves its band
        written as the first card measured it; its own band, then the rest of its table, go
        back to the front of its group's tables for a live actor of the same kind."""
        self.lose_actor(i, e)
        if is_peer:
            self.write(*self.held.pop(_band_key(job)))
        else:
            g = self.group_of[i]
            self.own[i].appendleft(job)          # the band in flight, then the rest
            if self.own[i]:
                g.tables.appendleft(self.own[i])
            self.own[i] = deque()
            # a sample waiting for this actor as its primary is still waiting
            # for a peer; nothing to do

    def release_unpaired(self) -> None:
        """A sample whose only possible peer died waits no longer: written as its first
        card measured it."""
        for g in self.groups:
            live = [j for j in g.members if j in self.alive]
            for primary, job in list(g.peers):
                if not any(j != primary for j in live):
                    g.peers.remove((primary, job))
                    self.write(*self.held.pop(_band_key(job)))

    def write(self, g: Group, res: dict, job: dict, peer: Optional[dict] = None) -> None:
        """One band (and its peer spread, when measured) in one transaction."""
        from .bands import Band
        from .race import rotated_weights

        win = res["win"]
        spread_row = None
        if peer is not None and win is not None:
            win, spread_row = self.peer_spread(g, win, job, peer)
        with self.db.transaction():
            self.db.record_band(res["rows"], win)
            if spread_row:
                self.db.record_probe(spread_row)
        g.measured += 1
        g.undecided += bool(res["undecided"])
        self.raced.append((job["op"], Band(job["lo"], job["hi"])))
        self.rotated += rotated_weights(res["rows"])
        g.left[job["table"]] -= 1
        if self.progress:
            self.progress("band", op=job["op"], band=Band(job["lo"], job["hi"]), winner=win,
                          signature=job["signature"], dtype=job["dtype"],
                          last=g.left[job["table"]] == 0, actor=res.get("actor"))

    def peer_spread(self, g: Group, win: dict, job: dict, peer: dict) -> tuple:
        """``(win, spread row)``: the first card's winner, its noise raised to the relative
        difference of its median on the second card (``peer``), and that difference as a
        ``noise_probes`` row. Where the second card timed no such winner the spread is
        unknown: kept in ``g.spreads`` as None, the winner as it was, and no row."""
        a = win["median_us"]
        # the second card's row of that winner: its median, timer and n read from the one row
        row = next((r for r in peer["rows"] if r["impl_id"] == win["impl_id"]
                    and r["outcome"] == "timed" and r["median_us"]), None)
        b = row["median_us"] if row else None
        spread = abs(a - b) / min(a, b) if a and b else None
        g.spreads.append({"op": job["op"], "signature": job["signature"],
                          "dtype": job["dtype"], "band_hi": job["hi"],
                          "winner": win["impl_id"], "us": a, "peer_us": b,
                          "spread": spread})
        if spread is None:
            return win, None
        win = {**win, "noise": max(win.get("noise") or 0.0, spread)}
        return win, {"run_id": g.run_id, "device_key": g.device["device_key"],
                     "driver": g.device["driver"],
                     "phase": f"peer-spread {job['op']} [{job['signature']}] "
                              f"{job['dtype']} <={job['hi']} {win['impl_id']}",
                     "timer": _timer_name(row.get("timer")), "median_us": b,
                     "spread": spread, "n": row.get("n"), "loadavg": None,
                     "cores": None, "busy_others": None, "loaded": None}

    def record_probes(self, i: int, probes: list) -> None:
        """Actor ``i``'s machine probes into its group's run; a loaded machine is warned of
        once until a probe finds it quiet again."""
        from . import noise as noisemod

        g = self.group_of[i]
        for p in probes:
            self.db.record_probe({"run_id": g.run_id, "device_key": g.device["device_key"],
                                  "driver": g.device["driver"], **p})
            if p.get("loaded") and i not in self.loaded_seen:
                self.loaded_seen.add(i)
                line = (f"{_where(self.infos[i])}: " + noisemod.warning(
                    p["loaded"], self.db_path, self.workload.model, self.s.max_tokens,
                    self.s.ops, self.tp).replace("--force", "--force --ray"))
                self.warnings.append(line)
                self.warn(line)
            elif not p.get("loaded"):
                self.loaded_seen.discard(i)

    # ---- end ----

    def end_probes(self) -> None:
        """The end probe of every live actor (calibrate's "end"); one that fails is dead."""
        for i in sorted(self.alive):
            try:
                self.record_probes(i, [self.ray.get(self.handles[i].probe.remote("end"))])
            except self.ray.exceptions.RayError:
                self.alive.discard(i)

    def finish(self) -> None:
        """Each group ``done``, or ``incomplete`` where bands are missing (every actor of
        its kind died); the --cold-weights line where the switch changed nothing."""
        from .race import cold_weights_unused

        for g in self.groups:
            g.status = "done" if not sum(g.left.values()) else "incomplete"
        self.status = "done"
        note = cold_weights_unused(self.s.race, self.raced,
                                   [(kw["op"], kw["band"]) for kw in self.skips], self.rotated)
        if note:
            self.warnings.append(note)
            self.warn(note)

    def close(self, after_error: bool) -> None:
        """However the run ended: every held band written (a finished primary is never
        lost), each group's run finished (with the run's status where it did not end
        ``done``), the DB closed, then, whatever those did, the actors stopped and Ray shut
        down where this call started it. ``after_error``: the run is already ending with
        an error, so a DB step that fails too (the DB itself broken: disk full, locked) is
        warned of and the rest goes on; raising it would hide the error that ended the run."""
        try:
            if self.db is not None:
                for what, step in self.closing_steps():
                    if not after_error:
                        step()
                        continue
                    try:
                        step()
                    except Exception as e:      # noqa: BLE001 - the run's own error first
                        self.warn(f"warning: {what}: {e}")
        finally:
            if self.handles:
                _stop(self.ray, self.handles)
            if self.started:
                self.ray.shutdown()

    def closing_steps(self) -> list:
        """:meth:`close`'s DB steps, in order, each ``(what a failure lost, call)``."""
        steps = [(f"band {key[0]} [{key[1]}] {key[2]} <= {key[3]} was measured but could "
                  f"not be saved", lambda held_band=held_band: self.write(*held_band))
                 for key, held_band in list(self.held.items())]
        for g in self.groups:
            if g.run_id:
                g.status = g.status if self.status == "done" else self.status
                steps.append((f"run {g.run_id} could not be marked {g.status}",
                              lambda g=g: self.db.finish_run(g.run_id, g.status)))
        return steps + [("the DB could not be closed", self.db.close)]

    def result(self) -> RayCalibrationResult:
        infos = self.infos
        res = RayCalibrationResult(
            str(self.db_path), self.workload.model, self.tp, self.workload.dtype,
            self.s.device_type,
            [{"actor": _where(inf), "name": inf["name"],
              "device_key": inf["device"]["device_key"], "bands": self.counts[i],
              "alive": i in self.alive} for i, inf in enumerate(infos)],
            [g.as_dict(infos) for g in self.groups], warnings=self.warnings)
        res.incomplete = any(g["status"] != "done" for g in res.groups)
        res.wall_s = time.perf_counter() - self.t0
        return res


def _timer_name(timer) -> Optional[str]:
    if not timer:
        return None
    try:
        return json.loads(timer).get("timer")
    except (TypeError, ValueError, AttributeError):
        return None
