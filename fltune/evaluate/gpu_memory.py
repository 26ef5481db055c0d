"""How many more engines fit on the card: the instrument's memory preflight for its
second start wave.

Why: ``run_e2e`` starts every arm's first engine in one wave and all the engines that load
what the first compiled (A/A arms, ``--procs`` replicas) together in a second
(:func:`fltune.evaluate.e2e.start_waves`). vLLM checks at each engine's start that its
``gpu_memory_utilization`` share of the card is free; engines spawned together all pass that
check on the same nearly empty card, then allocate side by side. So a second wave larger
than the card fails *late*: one or several workers die in the middle of their CUDA-graph
capture with an out-of-memory error in their logs, and which ones is a race. Four arms of
four processes of ~9.4 GiB each (session 35's H100 footprint) would ask 150 GiB of an
80 GiB card. The first wave tells what an engine really takes (the card's use before and
after it, per engine started); from that, before the second wave, the preflight keeps the
engines that fit and leaves the rest unstarted, said in each one's ``error`` and in a
note, keeping every arm's process count equal (replicas dropped a whole level at a time,
from the top index down), so the run still measures, on fewer processes, instead of losing the call.

The card is read with ``nvidia-smi`` (the parent process does not touch CUDA: a context
there would take memory of its own and hold the card for the run's whole length); where it
cannot be read (no ``nvidia-smi``, tensor parallelism across cards), nothing is planned and
every engine starts as before.
"""
from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass, field

#: kept free beside the measured footprint (MiB): an engine's use grows a little after its
#: start (the sampler's and the profiler's buffers), and the card's reading is a moment's
MARGIN_MIB = 2048


def card_index() -> str:
    """The card the workers run on: the first of ``CUDA_VISIBLE_DEVICES`` (the workers
    inherit it), else card 0."""
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    return visible or "0"


def read_card(index: str | None = None, run=subprocess.run) -> tuple[int, int] | None:
    """(used, free) MiB of the card, or None where ``nvidia-smi`` cannot say (not
    installed: the spawn's ``FileNotFoundError``)."""
    try:
        r = run(["nvidia-smi", f"--id={index or card_index()}",
                 "--query-gpu=memory.used,memory.free", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    try:
        used, free = (int(float(x)) for x in r.stdout.strip().splitlines()[0].split(","))
    except (ValueError, IndexError):
        return None
    return (used, free) if r.returncode == 0 else None


@dataclass
class WavePlan:
    """What the preflight decided for a wave: the arms to start, the ones left out, and
    the sentence that says why (empty where all fit)."""
    start: list
    left_out: list
    per_engine_mib: float
    free_mib: int
    message: str = ""
    #: replica levels (2, 3, ...) left out whole: an engine of such a level that already
    #: runs (a fresh-cache arm's replicas start in the first wave) is to be stopped, so the
    #: arms keep equal process counts
    levels_left_out: list = field(default_factory=list)


def plan_wave(wave: list, *, engines_up: int, used_before_mib: int, used_now_mib: int,
              free_now_mib: int, replica_of: dict, margin_mib: int = MARGIN_MIB) -> WavePlan:
    """Which arms of ``wave`` (objects with ``.name``) to start, from the footprint the
    ``engines_up`` engines already started measured (card use now minus before any start,
    per engine). ``replica_of``: {name: (arm, replica index)}. What is left out goes by
    replica level, highest first and a whole level at a time (every arm's process 3, say),
    so that the arms keep equal process counts (an uneven cut would leave the CI's process
    level unbalanced; ``complete_processes`` would drop the extra ones anyway). The first
    processes in the wave (A/A arms: level 1) are distinct arms and go one by one, in the
    wave's order."""
    per_engine = max(used_now_mib - used_before_mib, 0) / max(engines_up, 1)
    room = free_now_mib - margin_mib
    if per_engine <= 0 or len(wave) * per_engine <= room:
        return WavePlan(list(wave), [], per_engine, free_now_mib)
    fit = max(0, math.floor(room / per_engine))
    levels: dict = {}
    for i, a in enumerate(wave):
        levels.setdefault(replica_of.get(a.name, (a.name, 1))[1], []).append(i)
    keep: list = []
    for level in sorted(levels):
        members = levels[level]
        if level <= 1:
            keep += members[:fit - len(keep)]
        elif len(keep) + len(members) <= fit:
            keep += members
        else:
            break                         # a level that does not fit whole: none above it
    kept = set(keep)
    start = [a for i, a in enumerate(wave) if i in kept]
    left = [a for i, a in enumerate(wave) if i not in kept]
    dropped = sorted(level for level in levels if level > 1 and not set(levels[level]) & kept)
    msg = (f"GPU memory: {len(wave)} more engines at {per_engine / 1024:.1f} GiB each "
           f"(measured on the {engines_up} started) need {len(wave) * per_engine / 1024:.1f} "
           f"GiB, {free_now_mib / 1024:.1f} GiB free less a {margin_mib / 1024:.0f} GiB margin: "
           f"{len(start)} started, not started {', '.join(a.name for a in left)}; to measure "
           f"them all, fewer processes per arm (--procs) or arms, or a smaller KV cache "
           f"(kv_cache_memory_bytes in --engine)")
    return WavePlan(start, left, per_engine, free_now_mib, msg, dropped)
