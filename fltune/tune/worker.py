"""Run the race (``race.py``) in a supervised worker process, so a bad candidate cannot take
the calibration — or a bench, verify or refine run — down with it.

Kernels crash. A Triton kernel with a bad index corrupts the CUDA context (every later
call in that process fails), a C++ kernel can segfault or abort, and a kernel can hang.
None of that may cost the calibration, or the rows already measured. So the race runs in
a child process (spawned: a fresh CUDA context, no inherited locks) that reports which
candidate it is about to run; the supervisor here watches it:

- the child dies (signal, abort, ``os._exit``) -> the candidate it was running is recorded
  as **refused** with the cause (e.g. "killed by SIGSEGV during parity"), the child is
  replaced, and the band is adjudicated again without that candidate;
- no progress for ``timeout_s`` -> the child is killed and the candidate recorded as
  refused ("hung: ..."), same recovery;
- a candidate raises a CUDA error (the context is now poisoned) -> the child says so and
  exits on purpose, same recovery;
- the child dies during the interleaved race, where no single candidate is known: the band
  is retried once, then refused for all remaining candidates.

The child builds its own registry through the same discovery as the parent (built-ins,
entry points, ``FLTUNE_PLUGIN_MODULES``), and answers with plain data, never objects.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
from dataclasses import asdict
from typing import Optional

from ..ops.base import DTYPE_NAMES
from . import parity, timing
from .race import Outcome, Settings, Verdict, race
from .bands import Band

READY_TIMEOUT_S = 600
CUDA_FAULT_EXIT = 70
_CUDA_FAULT_MARKERS = ("CUDA error", "illegal memory access", "device-side assert",
                       "CUDA_ERROR")


def _to_wire(v: Verdict) -> dict:
    return {"outcomes": [{"impl_id": o.impl.impl_id, "outcome": o.outcome, "reason": o.reason,
                          "parity": o.parity.as_dict() if o.parity else None,
                          "timing": asdict(o.timing) if o.timing else None}
                         for o in v.outcomes],
            "winner": v.winner.impl.impl_id if v.winner else None,
            "runner_up": v.runner_up.impl.impl_id if v.runner_up else None,
            "reason": v.reason, "bytes": v.bytes}


def _from_wire(w: dict, impls: dict) -> Verdict:
    outs = []
    for d in w["outcomes"]:
        p = parity.ParityResult(**d["parity"]) if d["parity"] else None
        t = timing.Timing(**d["timing"]) if d["timing"] else None
        outs.append(Outcome(impls[d["impl_id"]], d["outcome"], d["reason"], p, t))
    by_id = {o.impl.impl_id: o for o in outs}
    return Verdict(outs, by_id.get(w["winner"]), by_id.get(w["runner_up"]), w["reason"],
                   w["bytes"])


def _worker_main(conn, env: dict):
    # Ctrl-C reaches the whole process group: the supervisor handles it (kills this
    # worker, says what was saved); the worker itself must neither die on it mid-message
    # nor print a traceback of its own
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the supervisor stopping it after Ctrl-C) exits through Python's cleanup,
    # so what the race created (semaphores of compile pools, ...) is released, not leaked
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    os.environ.update(env)
    from ..dispatch.manager import OpManager
    from ..ops import dtype_from_name

    registry = OpManager().registry
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        op, dims, dtype_name, lo, hi, impl_ids, settings = msg
        impls = []
        for iid in impl_ids:
            impl = registry.get(op, iid)
            impls.append(_guarded(impl, conn))

        def progress(phase, name, allowance_s=None):
            conn.send(("progress", phase, name, allowance_s))
        try:
            v = race(op, dims, dtype_from_name(dtype_name), Band(lo, hi), impls,
                     Settings(**settings), progress)
            conn.send(("done", _to_wire(v)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def _guarded(impl, conn):
    """A copy of ``impl`` whose fn exits the worker after a CUDA fault: once the context is
    poisoned every later candidate in this process would fail too, wrongly."""
    import copy

    def guard(fn):
        def guarded(*args):
            try:
                return fn(*args)
            except Exception as e:
                text = f"{type(e).__name__}: {e}"
                if any(m in text for m in _CUDA_FAULT_MARKERS):
                    conn.send(("fault", impl.impl_id, text.splitlines()[0][:300]))
                    os._exit(CUDA_FAULT_EXIT)
                raise
        return guarded
    g = copy.copy(impl)
    g.fn = guard(impl.fn)
    if impl.timed is not None:          # the call the race times (OpImpl.timed)
        g.timed = guard(impl.timed)
    return g


def _describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class WorkerPool:
    """One supervised worker, reused across bands (so compiled kernels stay warm) and
    replaced whenever a candidate kills it."""

    def __init__(self, timeout_s: float = 120.0, env: Optional[dict] = None):
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.proc = None
        self.conn = None
        self.restarts = 0
        self.casualties: list = []      # (op, band_hi, impl_id, reason), for reports/tests
        # a candidate that killed the worker once is not run again in this calibration
        # (one crash per band would cost a process start each time)
        self.known_bad: dict = {}       # (op, dtype, impl_id) -> reason

    def _start(self):
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.env), daemon=True,
                           name="fltune-worker")
        # the child starts with SIGINT ignored (an ignored signal stays ignored across
        # exec, and Python then installs no KeyboardInterrupt handler): a Ctrl-C while it
        # imports torch would otherwise print its traceback
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            proc.start()
        finally:
            signal.signal(signal.SIGINT, old)
        child.close()
        try:
            if not parent.poll(READY_TIMEOUT_S):
                proc.kill()
                raise RuntimeError("fltune worker did not start within "
                                   f"{READY_TIMEOUT_S} s")
            parent.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"fltune worker failed to start ({_describe_exit(proc.exitcode)})")
        except KeyboardInterrupt:
            proc.kill()
            proc.join(10)
            parent.close()
            raise
        self.proc, self.conn = proc, parent

    def _kill(self):
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def _stop(self, grace_s: float = 10.0):
        """Stop the worker now, through its own exit (SIGTERM) when it takes one within
        ``grace_s``, else killed."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(grace_s)
        self._kill()

    def close(self):
        if self.conn is not None and self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
                self.proc.join(10)
            except (BrokenPipeError, OSError):
                pass
        self._kill()

    def adjudicate(self, op, dims, dtype, band: Band, impls, settings: Settings) -> Verdict:
        try:
            return self._adjudicate(op, dims, dtype, band, impls, settings)
        except KeyboardInterrupt:
            self._stop()        # Ctrl-C: the worker ignores it; do not wait for its race
            raise

    def _adjudicate(self, op, dims, dtype, band: Band, impls, settings: Settings) -> Verdict:
        by_id = {i.impl_id: i for i in impls}
        refused: dict = {}
        for i in impls:
            bad = self.known_bad.get((op, dtype, i.impl_id))
            if bad:
                refused[i.impl_id] = f"{bad} (in an earlier band of this run; not run again)"
        remaining = [i.impl_id for i in impls if i.impl_id not in refused]
        race_failures = 0
        while True:
            if self.proc is None or not self.proc.is_alive():
                self._kill()
                self._start()
            self.conn.send((op, dims, DTYPE_NAMES[dtype], band.lo, band.hi, remaining,
                            settings.as_dict()))
            current = (None, None)
            verdict, cause = None, None
            wait_s = self.timeout_s
            while True:
                try:
                    ready = self.conn.poll(wait_s)
                except (EOFError, OSError):
                    ready = True
                if not ready:
                    cause = f"hung: no progress for {wait_s:.0f} s" + (
                        " (its first-call allowance)" if current[0] == "first_call" else "")
                    self._kill()
                    break
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):
                    self.proc.join(10)
                    cause = _describe_exit(self.proc.exitcode)
                    self._kill()
                    break
                kind = msg[0]
                if kind == "progress":
                    current = (msg[1], msg[2])
                    # a declared first call (JIT build, autotune) gets its own allowance
                    allowance = msg[3] if len(msg) > 3 else None
                    wait_s = max(self.timeout_s, allowance) if allowance else self.timeout_s
                elif kind == "fault":
                    current = ("call", msg[1])
                    cause = f"poisoned the CUDA context: {msg[2]}"
                    self.proc.join(10)
                    self._kill()
                    break
                elif kind == "done":
                    verdict = _from_wire(msg[1], by_id)
                    break
                elif kind == "error":
                    raise RuntimeError(f"adjudication of {op} band <= {band.hi} failed in the "
                                       f"worker: {msg[1]}")
            if verdict is not None:
                for iid, why in refused.items():
                    verdict.outcomes.append(Outcome(by_id[iid], "refused", why))
                return verdict
            self.restarts += 1
            phase, name = current
            if phase in ("first_call", "parity", "warmup", "call") and name in remaining:
                why = f"{cause} during {phase}; the worker was replaced"
                refused[name] = why
                remaining.remove(name)
                self.casualties.append((op, band.hi, name, why))
                self.known_bad[(op, dtype, name)] = why
                continue
            race_failures += 1
            if race_failures < 2:
                continue
            why = f"{cause} during the interleaved race (twice); no single candidate known"
            for iid in remaining:
                refused[iid] = why
                self.casualties.append((op, band.hi, iid, why))
            v = Verdict([Outcome(by_id[i], "refused", w) for i, w in refused.items()],
                        None, None, why, 0)
            return v

    race = adjudicate

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class InProcess:
    """The race in this process (``--no-isolate``, or a caller's own registry of
    candidates the worker could not rebuild): the same interface as :class:`WorkerPool`."""

    restarts = 0
    casualties: list = []

    def race(self, op, dims, dtype, band: Band, impls, settings: Settings) -> Verdict:
        return race(op, dims, dtype, band, impls, settings)

    adjudicate = race

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def racer(isolate: bool, timeout_s: float = 120.0):
    """Where a command's races run: a supervised :class:`WorkerPool` (``isolate``; a
    candidate that crashes, hangs or poisons the CUDA context is recorded as refused and
    the run goes on), or :class:`InProcess`. Use as a context manager."""
    return WorkerPool(timeout_s) if isolate else InProcess()
