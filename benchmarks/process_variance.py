"""How much of an e2e run's spread belongs to the worker process: a two-way analysis of
variance (process x repetition, log time, no interaction) over every process of every arm of
an A/A run (``fltune bench --e2e --procs K`` with only vanilla-like arms).

Why: the hierarchical CI (``e2e.hierarchical_ci``) resamples processes because an offset that
belongs to one process is the same in every repetition; the simulation
(``benchmarks/procs_coverage.py``) showed it is needlessly wide where there is no such
offset. This reads the process component (sigma_p) off a real run: the spread of the
processes' means beyond what their repetitions' noise puts there,
sigma_p^2 = (MS_process - MS_residual) / R, with the F test of "no process offset".

    python3 benchmarks/process_variance.py RAW.json[.gz] [--json OUT]
"""
import argparse
import collections
import json
import math
import statistics
import sys

from fltune.evaluate.e2e import samples_by_process
from fltune.evaluate.results_file import ResultsFileError, read_json


def f_sf(f: float, d1: int, d2: int) -> float:
    """P(F > f) for F(d1, d2) by the regularised incomplete beta (no scipy here)."""
    x = d2 / (d2 + d1 * f)
    a, b = d2 / 2, d1 / 2
    # continued fraction (Numerical Recipes' betacf), enough for these degrees of freedom
    def betacf(a, b, x):
        qab, qap, qam = a + b, a + 1, a - 1
        c, d = 1.0, 1 - qab * x / qap
        d = 1 / (d if abs(d) > 1e-30 else 1e-30)
        h = d
        for m in range(1, 300):
            m2 = 2 * m
            aa = m * (b - m) * x / ((qam + m2) * (a + m2))
            d = 1 + aa * d; d = 1 / (d if abs(d) > 1e-30 else 1e-30)
            c = 1 + aa / c; c = c if abs(c) > 1e-30 else 1e-30
            h *= d * c
            aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
            d = 1 + aa * d; d = 1 / (d if abs(d) > 1e-30 else 1e-30)
            c = 1 + aa / c; c = c if abs(c) > 1e-30 else 1e-30
            de = d * c; h *= de
            if abs(de - 1) < 1e-12:
                break
        return h
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    front = math.exp(lbeta + a * math.log(x) + b * math.log(1 - x))
    if x < (a + 1) / (a + b + 2):
        return front * betacf(a, b, x) / a
    return 1 - front * betacf(b, a, 1 - x) / b


def components(samples: list, key: str = "time_s") -> dict:
    """Per scenario: processes P, repetitions R (those every process has), the spread of
    the processes' means, the residual SD, sigma_p and the F test, all as % of log time."""
    by = collections.defaultdict(dict)
    for s in samples_by_process(samples):      # each process an arm: vanilla, vanilla.p2, ...
        if s.get(key):
            by[s["scenario"]][(s["arm"], s["rep"])] = s[key]
    out = {}
    for sc, m in by.items():
        procs = sorted({a for a, _ in m})
        reps = sorted(k for k in {k for _, k in m} if all((a, k) in m for a in procs))
        if len(procs) < 2 or len(reps) < 2:
            continue
        # (plain Python: the project declares no numpy)
        y = [[math.log(m[(a, k)]) for k in reps] for a in procs]
        p, r = len(procs), len(reps)
        g = statistics.fmean(v for row in y for v in row)
        pm = [statistics.fmean(row) for row in y]
        rm = [statistics.fmean(col) for col in zip(*y)]
        ss_p = sum((x - g) ** 2 for x in pm)
        msp = r * ss_p / (p - 1)
        msr = sum((y[i][j] - pm[i] - rm[j] + g) ** 2
                  for i in range(p) for j in range(r)) / ((p - 1) * (r - 1))
        f = msp / msr
        out[sc] = {"processes": p, "reps": r,
                   "process_mean_sd_pct": 100 * math.sqrt(ss_p / (p - 1)),
                   "residual_sd_pct": 100 * math.sqrt(msr),
                   "sigma_p_pct": 100 * math.sqrt(max(0.0, (msp - msr) / r)),
                   "F": f, "p_value": f_sf(f, p - 1, (p - 1) * (r - 1)),
                   "rep_effect_sd_pct": 100 * statistics.stdev(rm),
                   "offsets_pct": {a: round(100 * (v - g), 3) for a, v in zip(procs, pm)}}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--key", default="time_s", help="time_s (median run) or fast_s")
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        raw = read_json(a.raw, require=("samples",))
    except ResultsFileError as e:
        sys.exit(f"process_variance: {e}")
    comp = components(raw["samples"], a.key)
    for sc, c in comp.items():
        print(f"{sc:14s} {c['processes']} processes x {c['reps']} reps: process means spread "
              f"{c['process_mean_sd_pct']:.2f} %, residual {c['residual_sd_pct']:.2f} %, "
              f"sigma_p {c['sigma_p_pct']:.2f} % (F {c['F']:.2f}, p {c['p_value']:.3f}), "
              f"repetition effect {c['rep_effect_sd_pct']:.2f} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw": a.raw, "key": a.key, "scenarios": comp}, f, indent=1)


if __name__ == "__main__":
    main()
