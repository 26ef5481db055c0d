"""Calibration's use of the race (``race.py``): the verdict of one band -> the DB rows.

The rule (flashrt's ``adjudicate()``) lives with the race loop in ``race.py``: the fastest
candidate wins, *except* that every candidate whose median is within the win margin
(default 3 %) of the fastest competes on precision, and the most precise of those wins.
Why: a 2 % timing difference is inside what a rerun moves, so picking on it is picking on
noise, while a precision difference is deterministic and real.

Every candidate's outcome is written — unqualified (reason), refused (raised; reason),
parity_failed (score), timed (stats) — because the DB keeps all of them: "why did X not
win here" must be answerable from the DB alone.
"""
from __future__ import annotations

import json

import torch

from ..ops.base import DTYPE_NAMES
from .bands import Band
from .race import (WIN_MARGIN, Outcome, Settings, Verdict, pick_winner,  # noqa: F401
                   race)

#: calibration's name for the race (kept: tests, notebooks and scripts call it so)
adjudicate = race


def rows_for_db(verdict: Verdict, *, device: dict, stack_key: str, op: str, signature: str,
                dims: dict, dtype: torch.dtype, band: Band, run_id: int, weight: int):
    """The measurement rows and the winner row this verdict writes."""
    dt = DTYPE_NAMES[dtype]
    base = {"device_key": device["device_key"], "driver": device["driver"],
            "stack_key": stack_key, "op": op, "signature": signature,
            "dims": json.dumps(dims, sort_keys=True), "dtype": dt, "band_lo": band.lo,
            "band_hi": band.hi, "tokens": band.tokens, "run_id": run_id,
            "bytes": verdict.bytes}
    rows = []
    for o in verdict.outcomes:
        t, p = o.timing, o.parity
        rows.append({**base, "impl_id": o.impl.impl_id, "kind": o.impl.kind.value,
                     "vendor": o.impl.vendor, "backend": o.impl.backend,
                     "outcome": o.outcome, "reason": o.reason,
                     "parity_score": p.score if p else None,
                     "rel_error": p.rel_error if p and p.rel_error != float("inf") else None,
                     "median_us": t.median_us if t else None, "p10_us": t.p10_us if t else None,
                     "p90_us": t.p90_us if t else None, "n": t.n if t else None,
                     "timer": json.dumps(t.timer) if t else None})
    win = None
    w = verdict.winner
    if w is not None:
        ru = verdict.runner_up
        win = {"device_key": device["device_key"], "driver": device["driver"], "op": op,
               "signature": signature, "dims": base["dims"], "dtype": dt,
               "band_lo": band.lo, "band_hi": band.hi, "impl_id": w.impl.impl_id,
               "kind": w.impl.kind.value, "vendor": w.impl.vendor,
               "median_us": w.timing.median_us,
               "runner_up": ru.impl.impl_id if ru else None,
               "runner_up_us": ru.timing.median_us if ru else None,
               "gap": (ru.timing.median_us / w.timing.median_us - 1) if ru else None,
               "noise": w.timing.noise, "reason": verdict.reason, "weight": weight,
               "stack_key": stack_key, "run_id": run_id}
    return rows, win
