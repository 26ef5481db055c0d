"""Where each arm's host work runs while the in-context instrument measures it.

Why this matters. At decode the engine step is host-bound (on the H200 machine, wall time
1.2-3x the GPU kernel time), so the step takes as long as the host CPU that runs the
engine's Python takes. That machine is a KVM guest whose vCPUs do not all run at one speed,
and a process stays on its vCPU for long stretches (session 5's telemetry: "the process
never leaves its CPU"). What that does to an A/B, measured three times:

- one fixed core per arm (the first version): each arm inherited its core's speed for the
  whole run, and the A/A read 2-5 % apart with CIs clear of 1 (2026-11-30, s5);
- one shared set for every arm (``shared``, the default since): the scheduler places each
  arm's processes on vCPUs of its own choosing and they stay there, so the A/A still read
  up to 14 % apart with CIs clear of 1 at TP=2 (2026-12-01, s8), and SGLang's arms
  (s9) ran each ``generate`` call at one of two speeds (~100 or ~130 ms) for several
  repetitions in a row, a different arm slow at a time.

``measure`` takes the other way out: the arms run one at a time anyway, so the arm being
measured is moved, process tree and every thread, onto one small **measurement set** of
cores just before its call and back onto the **park set** right after. Every arm's every
repetition then runs on the same vCPUs, seconds apart, and a vCPU's speed is no longer an
arm's property. Idle arms (SGLang's schedulers and vLLM's multiprocess engine cores
busy-poll) spin on the park set, away from the measured one. The measurement set is the
fastest ``k`` cores of a short spin test (:func:`core_speeds`, also recorded, so a run
says how unequal its vCPUs were). The first core is left to the parent in every mode.

Not yet measured on the GPU machine (written 2026-12-01 after s9): the next A/A says
whether it closes the gap; ``shared`` stays the default until it does.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

MODES = ("shared", "measure", "off")


def process_tree(pid: int, *, scan: bool | None = None) -> list:
    """``pid`` and every descendant alive now. Read from ``/proc/PID/task/TID/children``
    (Linux with CONFIG_PROC_CHILDREN); where the kernel has no such file, or with
    ``scan=True``, from every process's parent in ``/proc/*/stat``."""
    if scan is None:
        scan = not os.path.exists(f"/proc/{pid}/task/{pid}/children")
    kids = _children_by_scan() if scan else None
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        if kids is not None:
            todo.extend(kids.get(p, ()))
            continue
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return out


def _children_by_scan() -> dict:
    """parent pid -> child pids, from field 4 of every ``/proc/PID/stat``."""
    kids: dict = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def threads_of(pid: int) -> list:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def pin_tree(pid: int, cpus) -> int:
    """Set the CPU affinity of every thread of ``pid`` and its descendants to ``cpus``.
    Per thread, because ``sched_setaffinity(pid)`` moves only that one thread and threads
    started later inherit from the thread that starts them. A thread or process that ends
    meanwhile is skipped. Returns how many threads were moved."""
    cpus = set(cpus)
    n = 0
    for p in process_tree(pid):
        for tid in threads_of(p):
            try:
                os.sched_setaffinity(tid, cpus)
                n += 1
            except (ProcessLookupError, PermissionError, OSError):
                pass
    return n


def core_speeds(cpus, *, seconds: float = 0.02, rounds: int = 3) -> dict:
    """cpu -> spin-loop iterations per millisecond (the best of ``rounds``), this thread
    pinned on each core in turn and then restored. A plain Python loop, because the host
    work that sets a decode step is the engine's Python."""
    keep = os.sched_getaffinity(0)
    out = {}
    try:
        for c in cpus:
            os.sched_setaffinity(0, {c})
            best = 0.0
            for _ in range(rounds):
                n, t0 = 0, time.perf_counter()
                end = t0 + seconds
                while True:
                    for _ in range(1000):
                        n += 1
                    if time.perf_counter() >= end:
                        break
                best = max(best, n / ((time.perf_counter() - t0) * 1e3))
            out[c] = round(best, 1)
    finally:
        os.sched_setaffinity(0, keep)
    return out


@dataclass
class Pinning:
    """How the instrument places arms: ``start`` is every worker's affinity from its start;
    with ``mode == "measure"``, :func:`measuring` moves one arm to ``measure`` for a call."""
    mode: str
    start: frozenset
    measure: frozenset = frozenset()
    park: frozenset = frozenset()
    speeds: dict = field(default_factory=dict)
    #: the instrument's own thread (its reader threads start from it) for the run, in
    #: ``measure`` mode, so that even the parent stays off the measurement set
    parent: frozenset = frozenset()

    def describe(self) -> dict:
        return {"mode": self.mode, "start": sorted(self.start),
                "measure": sorted(self.measure), "park": sorted(self.park),
                "parent": sorted(self.parent),
                "core_speeds": {str(k): v for k, v in sorted(self.speeds.items())}}


def measure_set_size(n_usable: int) -> int:
    """Cores of the measurement set: room for an engine's busy threads (vLLM's loop, a
    multiprocess engine core, SGLang's scheduler, tokenizer manager and detokenizer: up to
    ~4), at most half of what is usable so the parked arms keep the rest."""
    return max(1, min(4, n_usable // 2))


def plan_pinning(mode: str, cpus=None, *, measure_n: int | None = None,
                 speeds: dict | None = None) -> Pinning | None:
    """The placement for ``mode`` over ``cpus`` (default: this process's affinity), or None
    when there is nothing to place (mode ``off``, or fewer than two cores besides the
    first). ``measure`` needs at least one core for each of the two sets. ``speeds``
    (cpu -> speed) picks the measurement set; measured here when not given."""
    if mode not in MODES:
        raise ValueError(f"pinning must be one of {', '.join(MODES)}, got {mode!r}")
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    usable = cpus[1:]
    if mode == "off" or len(usable) < 2:
        return None
    if mode == "shared":
        return Pinning("shared", frozenset(usable))
    k = measure_n or measure_set_size(len(usable))
    if not 1 <= k < len(usable):
        raise ValueError(f"a measurement set of {k} cores leaves none to park the other "
                         f"arms on ({len(usable)} usable)")
    speeds = core_speeds(usable) if speeds is None else speeds
    fastest = sorted(usable, key=lambda c: (-speeds.get(c, 0.0), c))[:k]
    measure = frozenset(fastest)
    park = frozenset(usable) - measure
    return Pinning("measure", park, measure, park, dict(speeds), frozenset(cpus[:1]))


@contextmanager
def measuring(pin: Pinning | None, pid: int):
    """Around one timed or profiled call of the arm whose worker is ``pid``: in ``measure``
    mode its process tree is on the measurement set for the call and back on the park set
    after it (also when the call fails); with any other placement, or none, nothing moves."""
    moves = pin is not None and pin.mode == "measure"
    if moves:
        pin_tree(pid, pin.measure)
    try:
        yield
    finally:
        if moves:
            pin_tree(pid, pin.park)
