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
    the processes' means, the residual SD, sigma_p and the F test, all as % of log time.
    A run with several generations (``--generations``: new processes per block of
    repetitions) is read block by block, each an ANOVA of its own processes, and the blocks'
    sums of squares pooled (P and R: their totals)."""
    by = collections.defaultdict(lambda: collections.defaultdict(dict))
    for s in samples_by_process(samples):      # each process an arm: vanilla, vanilla.p2, ...
        if s.get(key):
            by[s["scenario"]][s.get("generation", 0)][(s["arm"], s["rep"])] = s[key]
    out = {}
    for sc, gens in by.items():
        ss_p = ss_r = df_p = df_r = 0.0
        n_p = n_r = n_g = 0
        rep_means, offsets = [], {}
        for m in gens.values():
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
            ss_p += r * sum((x - g) ** 2 for x in pm)
            ss_r += sum((y[i][j] - pm[i] - rm[j] + g) ** 2 for i in range(p) for j in range(r))
            df_p += p - 1
            df_r += (p - 1) * (r - 1)
            n_p, n_r, n_g = n_p + p, n_r + r, n_g + 1
            rep_means += [x - g for x in rm]
            offsets.update({a: round(100 * (v - g), 3) for a, v in zip(procs, pm)})
        if not df_p:
            continue
        r_bar = n_r / n_g                     # repetitions per generation, on average
        msp, msr = ss_p / df_p, ss_r / df_r
        f = msp / msr
        out[sc] = {"processes": n_p, "reps": n_r,
                   **({"generations": n_g} if len(gens) > 1 else {}),
                   "process_mean_sd_pct": 100 * math.sqrt(msp / r_bar),
                   "residual_sd_pct": 100 * math.sqrt(msr),
                   "sigma_p_pct": 100 * math.sqrt(max(0.0, (msp - msr) / r_bar)),
                   "F": f, "p_value": f_sf(f, int(df_p), int(df_r)),
                   "rep_effect_sd_pct": 100 * statistics.stdev(rep_means),
                   "offsets_pct": offsets}
    return out


def _rss(rows: list, y: list, factors: tuple) -> tuple:
    """(residual sum of squares, parameters) of y on an intercept and the dummy columns of
    ``factors`` (indices into each row; each factor's first level is the reference), least
    squares by the normal equations (small: a few processes and vCPUs)."""
    cols = []
    for f in factors:
        levels = sorted({r[f] for r in rows}, key=str)
        cols += [[1.0 if r[f] == lv else 0.0 for r in rows] for lv in levels[1:]]
    x = [[1.0] + [c[i] for c in cols] for i in range(len(rows))]
    k = len(x[0])
    a = [[sum(x[n][i] * x[n][j] for n in range(len(x))) for j in range(k)]
         + [sum(x[n][i] * y[n] for n in range(len(x)))] for i in range(k)]
    # Gauss-Jordan with partial pivoting; a column with no pivot (aliased) is dropped
    rank, piv_cols = 0, []
    for c in range(k):
        p = max(range(rank, k), key=lambda i: abs(a[i][c]), default=None)
        if p is None or abs(a[p][c]) < 1e-9:
            continue
        a[rank], a[p] = a[p], a[rank]
        for i in range(k):
            if i != rank and a[i][c]:
                f = a[i][c] / a[rank][c]
                a[i] = [u - f * v for u, v in zip(a[i], a[rank])]
        piv_cols.append(c)
        rank += 1
    beta = [0.0] * k
    for i, c in enumerate(piv_cols):
        beta[c] = a[i][k] / a[i][c]
    res = [y[n] - sum(b * v for b, v in zip(beta, x[n])) for n in range(len(x))]
    return sum(e * e for e in res), rank


def process_or_cpu(samples: list, key: str = "time_s") -> dict:
    """Per scenario: is a sample's offset the process's or the vCPU's it ran on? Each
    sample's log time less its repetition's mean, fitted on the process, on the vCPU (the
    one the worker's timed runs mostly ended on, ``host[].cpu``) and on both; the F test of
    each beside the other (nested least squares). Why: where the offset is the vCPU's,
    placing every measured process on the same cores (``--pinning measure``) removes it;
    where it is the process's, only more processes, or new ones (``--generations``), do."""
    out = {}
    by_sc = collections.defaultdict(lambda: collections.defaultdict(list))
    for s in samples_by_process(samples):
        cpus = [h.get("cpu") for h in s.get("host") or [] if h.get("cpu") is not None]
        if s.get(key) and cpus:
            cpu = collections.Counter(cpus).most_common(1)[0][0]
            by_sc[s["scenario"]][s["rep"]].append((s["arm"], cpu, math.log(s[key])))
    for sc, reps in by_sc.items():
        rows, y = [], []
        for xs in reps.values():
            if len(xs) < 2:
                continue
            m = statistics.fmean(v for *_, v in xs)
            rows += [(a, c) for a, c, _ in xs]
            y += [100 * (v - m) for *_, v in xs]
        procs, cpus = {r[0] for r in rows}, {r[1] for r in rows}
        if len(procs) < 2 or len(cpus) < 2:
            continue
        tot = sum((v - statistics.fmean(y)) ** 2 for v in y)
        (rp, kp), (rc, kc), (rb, kb) = (_rss(rows, y, f) for f in ((0,), (1,), (0, 1)))
        df = len(y) - kb

        def nested(r_small, k_small):
            d1 = kb - k_small
            if d1 < 1 or df < 1 or rb <= 0:
                return None, None, d1
            f = ((r_small - rb) / d1) / (rb / df)
            return round(f, 3), round(f_sf(f, d1, df), 4), d1
        fc, pc, dc = nested(rp, kp)
        fp, pp, dp = nested(rc, kc)
        out[sc] = {"samples": len(y), "processes": len(procs), "cpus": len(cpus),
                   "r2_process": round(1 - rp / tot, 3), "r2_cpu": round(1 - rc / tot, 3),
                   "r2_both": round(1 - rb / tot, 3),
                   "F_cpu_given_process": fc, "p_cpu_given_process": pc, "df_cpu": [dc, df],
                   "F_process_given_cpu": fp, "p_process_given_cpu": pp,
                   "df_process": [dp, df]}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--key", default="time_s", help="time_s (median run) or fast_s")
    ap.add_argument("--json")
    ap.add_argument("--by-cpu", action="store_true",
                    help="also: the process's offset against the vCPU's it ran on "
                         "(process_or_cpu)")
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
    by_cpu = process_or_cpu(raw["samples"], a.key) if a.by_cpu else None
    for sc, c in (by_cpu or {}).items():
        print(f"{sc:14s} {c['processes']} processes on {c['cpus']} vCPUs: R^2 process "
              f"{c['r2_process']:.2f}, vCPU {c['r2_cpu']:.2f}, both {c['r2_both']:.2f}; "
              f"vCPU beside the process F {c['F_cpu_given_process']} (p "
              f"{c['p_cpu_given_process']}), process beside the vCPU F "
              f"{c['F_process_given_cpu']} (p {c['p_process_given_cpu']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw": a.raw, "key": a.key, "scenarios": comp,
                       **({"process_or_cpu": by_cpu} if a.by_cpu else {})}, f, indent=1)


if __name__ == "__main__":
    main()
