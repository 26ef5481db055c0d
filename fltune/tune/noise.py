"""Honest noise: how loud the machine is while it calibrates, and which bands that leaves
undecided.

Why: a calibration run beside another process that loaded both cores stored medians of
~8 ms for kernels that take 15–100 µs, with stored noise up to 0.99, picked winners from
that, and nothing said so. Two measurements make that visible:

- **the machine probe** (:func:`probe`): a fixed, cheap, deterministic reference kernel
  (an elementwise multiply on the calibration device, large enough to use torch's
  intra-op threads, which is what a loaded CPU hurts most) timed with the same timer the
  race uses, in a few short blocks spread over ~0.2 s; its spread is ``(p90 - p10) /
  median`` of all samples (the same measure as a candidate's ``noise``), next to the
  1-minute load average and the share of the machine's CPU time other processes took
  meanwhile (``/proc/stat``). Calibrate probes at the start, before each workload item,
  and at the end, stores every probe (``noise_probes``), and warns at once when the
  machine is loaded (:func:`loaded`).
- **undecided bands** (:func:`judge`, :func:`settle`): a band's noise is the largest
  timing spread among its winner and the two fastest candidates (the race interleaves
  them, so a loaded machine shows up there directly; the machine probe's spread is stored
  beside it, ``winners.machine_noise``, but one preempted probe block would otherwise
  condemn every band of a workload item). When that noise exceeds both
  the time gap between the two fastest candidates and the win margin, timing cannot tell
  them apart (below the margin the race's rule already picks on precision, so noise that
  small cannot change a pick). The band is then **undecided**: the winner is still
  chosen — among the candidates within the noise of the fastest, the most precise, then
  the first in the fixed FL order — and flagged, with the reason, in the DB.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from . import timing

#: a probe whose spread is above this is a loaded machine (a quiet one measures 0.02-0.3)
SPREAD_LIMIT = 0.5
#: other processes using more than this share of all cores' time is a loaded machine
BUSY_LIMIT = 0.5
PROBE_BLOCKS = 4
PROBE_ELEMENTS = 1 << 18


@dataclass
class Probe:
    device: str
    timer: str
    median_us: float
    spread: float
    n: int
    loadavg: Optional[float]
    cores: int
    busy_others: Optional[float]      # share of all cores' time other processes took

    def row(self) -> dict:
        return {"timer": self.timer, "median_us": self.median_us, "spread": self.spread,
                "n": self.n, "loadavg": self.loadavg, "cores": self.cores,
                "busy_others": self.busy_others}


def _cpu_jiffies():
    """(busy, total) jiffies of all cores from /proc/stat, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            parts = f.readline().split()
    except OSError:
        return None
    if not parts or parts[0] != "cpu":
        return None
    v = [int(x) for x in parts[1:9]]
    idle = v[3] + v[4]                 # idle + iowait
    return sum(v) - idle, sum(v)


def _reference_kernel(device: str):
    """A fixed deterministic kernel: ``y = x * 1.5`` over 256 Ki fp32 elements."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(PROBE_ELEMENTS, generator=gen).to(device)
    y = torch.empty_like(x)
    return lambda: torch.mul(x, 1.5, out=y)


def probe(device: str = "cpu", *, blocks: int = PROBE_BLOCKS, budget_s: float = 0.01,
          pause_s: float = 0.04) -> Probe:
    """Time the reference kernel in ``blocks`` short blocks ``pause_s`` apart, with the
    race's own timer (``timing.time_candidates``), and read the machine's load meanwhile."""
    fn = _reference_kernel(device)
    cores = os.cpu_count() or 1
    j0, own0 = _cpu_jiffies(), time.process_time()
    blocks_t, kind = [], None
    for b in range(blocks):
        if b:
            time.sleep(pause_s)
        t = timing.time_candidates({"probe": fn}, device, budget_s=budget_s)["probe"]
        if isinstance(t, Exception):
            raise t
        kind = t.timer.get("timer")
        blocks_t.append(t)
    j1, own1 = _cpu_jiffies(), time.process_time()
    busy = None
    if j0 and j1 and j1[1] > j0[1]:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        others = (j1[0] - j0[0]) - (own1 - own0) * hz
        busy = min(1.0, max(0.0, others / (j1[1] - j0[1])))
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        load = None
    # across blocks: a block that ran all slow (a core taken away for its whole length)
    # shows as its p90 far above another block's p10
    med = sorted(t.median_us for t in blocks_t)[len(blocks_t) // 2]
    lo, hi = min(t.p10_us for t in blocks_t), max(t.p90_us for t in blocks_t)
    spread = (hi - lo) / med if med else 0.0
    n = sum(t.n for t in blocks_t)
    return Probe(device, kind or "", med, spread, n, load, cores, busy)


def fmt_noise(v: Optional[float]) -> str:
    """A spread for people: a percentage up to 999 %, then a multiple of the median."""
    if v is None:
        return "—"
    return f"{v:.0%}" if v < 10 else f"{v:.0f}x"


def loaded(p: Probe) -> Optional[str]:
    """Why the machine counts as loaded (one clause per cause), or None when it is quiet."""
    why = []
    if p.spread > SPREAD_LIMIT:
        why.append(f"a reference kernel's timings spread {fmt_noise(p.spread)} around its "
                   f"{p.median_us:.1f} µs median")
    if p.busy_others is not None and p.busy_others > BUSY_LIMIT:
        why.append(f"other processes took {p.busy_others:.0%} of the CPU time")
    if p.loadavg is not None and p.loadavg > p.cores:
        why.append(f"load average {p.loadavg:.1f} on {p.cores} cores")
    return "; ".join(why) or None


def rerun_command(model: str, db_path, *, max_tokens: Optional[int] = None,
                  ops: Optional[list] = None, tp: Optional[int] = None) -> str:
    """``fltune calibrate ... --force`` that re-measures the same run (model, tp, token
    range, op subset), complete and runnable as printed."""
    from shlex import quote
    cmd = f"fltune calibrate --model {quote(str(model))} --db {quote(str(db_path))}"
    if tp and int(tp) != 1:
        cmd += f" --tp {int(tp)}"
    if max_tokens:
        cmd += f" --max-tokens {int(max_tokens)}"
    if ops:
        cmd += f" --ops {quote(','.join(ops))}"
    return cmd + " --force"


def warning(cause: str, db_path: str, model: str, max_tokens: Optional[int] = None,
            ops: Optional[list] = None, tp: Optional[int] = None) -> str:
    """The one line calibrate prints when the machine is loaded: the cause and the way out
    (commands that run as printed)."""
    from shlex import quote
    cmd = rerun_command(model, db_path, max_tokens=max_tokens, ops=ops, tp=tp)
    return (f"warning: this machine is loaded ({cause}): timings taken now are noise, and "
            f"bands whose noise exceeds their win margin are marked undecided. Stop the "
            f"other work or use a quieter machine, then rerun `{cmd}`; `fltune "
            f"verify --db {quote(str(db_path))}` re-measures the winners later")


# ---- undecided bands ----------------------------------------------------------------------

def judge(fastest_us: float, second_us: Optional[float], noise: float,
          margin: float) -> bool:
    """True when the band is undecided: its noise exceeds both the time gap between the
    two fastest candidates and the win margin (a lone candidate is always decided)."""
    if second_us is None or not fastest_us:
        return False
    gap = second_us / fastest_us - 1
    return noise > gap and noise > margin


def settle(verdict, margin: float, order: list):
    """The race's verdict, re-judged against the noise. Returns ``(verdict, undecided,
    noise)``: an undecided band gets a new winner — among the timed candidates within the
    noise of the fastest, the smallest measured error, then the earliest in ``order`` (impl
    ids in the fixed FL order) — and a reason that says so; a decided one comes back as is.
    """
    from .race import Verdict
    timed = [o for o in verdict.outcomes if o.outcome == "timed" and o.timing is not None]
    if verdict.winner is None or not timed:
        return verdict, False, None
    by_time = sorted(timed, key=lambda o: o.timing.median_us)
    fastest = by_time[0]
    noise = max(o.timing.noise for o in [verdict.winner, *by_time[:2]])
    second = by_time[1].timing.median_us if len(by_time) > 1 else None
    if not judge(fastest.timing.median_us, second, noise, margin):
        return verdict, False, noise
    pos = {iid: k for k, iid in enumerate(order)}
    limit = fastest.timing.median_us * (1 + max(noise, margin))
    inside = [o for o in by_time if o.timing.median_us <= limit]
    winner = min(inside, key=lambda o: (o.parity.rel_error, pos.get(o.impl.impl_id, len(pos)),
                                        o.timing.median_us))
    runner_up = next((o for o in by_time if o is not winner), None)
    gap = second / fastest.timing.median_us - 1
    reason = (f"undecided: noise {fmt_noise(noise)} exceeds the gap {gap:.1%} between "
              f"{fastest.impl.impl_id} and {by_time[1].impl.impl_id} (margin {margin:.0%}); "
              f"picked by precision, then FL order, among the {len(inside)} candidates "
              f"within the noise")
    return Verdict(verdict.outcomes, winner, runner_up, reason, verdict.bytes,
                   dict(verdict.extra)), True, noise


class Watch:
    """Calibrate's noise watch: probes the machine (at the start, before each workload
    item it measures, at the end), stores each probe, warns at once when the machine turns
    loaded, and holds the latest probe's spread for :func:`settle`."""

    def __init__(self, db, run_id: int, device: dict, torch_device: str, warn, db_path: str,
                 model: str, max_tokens: Optional[int] = None, ops: Optional[list] = None,
                 tp: Optional[int] = None):
        self.db, self.run_id, self.device = db, run_id, device
        self.torch_device, self.warn = torch_device, warn
        self.db_path, self.model, self.max_tokens = db_path, model, max_tokens
        self.ops, self.tp = ops, tp
        self.spread: Optional[float] = None
        self.probes = 0
        self.warnings: list = []
        self.undecided = 0
        self._loaded = False

    def probe(self, phase: str) -> Probe:
        p = probe(self.torch_device)
        cause = loaded(p)
        self.spread, self.probes = p.spread, self.probes + 1
        self.db.record_probe({"run_id": self.run_id, "device_key": self.device["device_key"],
                              "driver": self.device["driver"], "phase": phase, **p.row(),
                              "loaded": cause})
        if cause and not self._loaded:
            line = warning(cause, self.db_path, self.model, self.max_tokens, self.ops, self.tp)
            self.warnings.append(line)
            self.warn(line)
        self._loaded = cause is not None
        return p

    def as_dict(self) -> dict:
        return {"probes": self.probes, "last_spread": self.spread,
                "warnings": self.warnings, "undecided": self.undecided}


def band_noise(measured: list[dict], winner_impl: str) -> tuple:
    """``(noise, fastest_us, second_us)`` of one band from its stored measurement rows: the
    rule of :func:`settle` read back from the DB (a report on a DB written before the
    ``undecided`` column judges its bands with it)."""
    timed = sorted((m for m in measured if m.get("outcome") == "timed" and m.get("median_us")),
                   key=lambda m: m["median_us"])
    if not timed:
        return None, None, None

    def spread(m):
        if m.get("p90_us") is None or m.get("p10_us") is None:
            return 0.0
        return (m["p90_us"] - m["p10_us"]) / m["median_us"]
    mine = [m for m in timed if m["impl_id"] == winner_impl]
    noise = max(spread(m) for m in mine + timed[:2])
    return noise, timed[0]["median_us"], timed[1]["median_us"] if len(timed) > 1 else None
