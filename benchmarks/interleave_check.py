"""Does the host's slow second land on every arm when the runs are interleaved? (issue 11)

    python3 benchmarks/interleave_check.py RUN/e2e-raw.json[.gz] [--json OUT]

Reads an instrument run whose repetitions interleaved the arms' runs (``--interleave runs``,
the default since session 31: each run carries ``host[i].t_mono``, its start on the host's
one monotonic clock) and prints, per scenario and arm against the baseline:

- the paired ratio four ways, median [95 % bootstrap CI] over repetitions: the
  repetition's median run (``step_estimate``: the instrument's ``ratio_median``), its
  fastest run (session 31's ``fast_ratio_median``), its fast level (``fast_level_estimate``:
  ``fast_ratio_median`` since session 33; for prefill the fastest run), and the median over
  the repetition's rounds of the ratio of the two runs of one round (the runs closest in
  time);
- how alike neighbours are: put every run of the scenario on one time line, each divided by
  its arm's median run (its "slowness"), and take the rank correlation of the slowness of
  consecutive runs of *different* arms, and their distance in time. A correlation near 1
  means a slow second covers neighbouring runs whatever their arm (interleaving pairs it
  away); near 0, each run's slowness is its own (no schedule pairs it away).

- where the run has several A/A arms (arms whose environment is the baseline's, e.g.
  ``--arm aa=vanilla --arm aa2=vanilla --arm aa3=vanilla``: ``PROCS=4`` of
  ``benchmarks/h200_s7.sh`` linbench), the spread of their fast-level medians per scenario:
  the offset between *processes* of one and the same engine, which more repetitions do
  not shrink (session 33: at the fast level one A/A arm read 0.8-1.8 % faster than
  vanilla at all three points of one run).

Why: on the H200 machine whole runs move between two host-speed levels in periods of about
a second (benchmarks/results/RUNS.md, "Why the wall time cannot see 1 % there"); with each arm's runs back to
back one arm's three runs could sit in one slow period while the next arm's missed it
(session 28). This says whether the interleaved schedule and the fastest-run estimate pair
the levels away, and what the wall A/A becomes then.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fltune.evaluate.e2e import (Scenario, baseline_process, bootstrap_ci,  # noqa: E402
                                 compute_points, fast_level_estimate, run_estimates,
                                 samples_by_process, split_generation, step_estimate)
from fltune.evaluate.results_file import ResultsFileError, read_json  # noqa: E402


def ranks(xs: list) -> list:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for k, i in enumerate(order):
        r[i] = float(k)
    return r


def spearman(a: list, b: list) -> float | None:
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return num / den if den else None


def ci(ratios: list) -> dict | None:
    if not ratios:
        return None
    med, lo, hi = bootstrap_ci(ratios)
    return {"median": round(med, 4), "ci": [round(lo, 4), round(hi, 4)],
            "half_width_pct": round(50 * (hi - lo) / med, 2), "n": len(ratios)}


def analyse(raw: dict) -> list:
    base = raw.get("baseline", "vanilla")
    out = []
    # every process read against the baseline's first one of its generation
    samples = samples_by_process(raw["samples"])
    for sd in raw["scenarios"]:
        sc = Scenario(**sd)
        smp = [s for s in samples if s["scenario"] == sc.name]
        if not smp:
            continue
        arms = list(dict.fromkeys(s["arm"] for s in smp))
        # the time line: (start, arm, run time) of every run of this scenario
        line = []
        for s in smp:
            for est, h in zip(run_estimates(sc, s), s.get("host") or []):
                if h.get("t_mono") is not None:
                    line.append((h["t_mono"], s["arm"], est))
        line.sort()
        med = {a: statistics.median([t for _, arm, t in line if arm == a] or [1.0]) for a in arms}
        slow = [(t0, a, t / med[a]) for t0, a, t in line]
        pairs = [(x[2], y[2], y[0] - x[0]) for x, y in zip(slow, slow[1:]) if x[1] != y[1]]
        by = {(s["arm"], s["rep"]): s for s in smp}
        for arm in arms:
            mine = baseline_process(arm, base)
            if arm == mine:
                continue
            reps = sorted(r for a, r in by if a == arm and (mine, r) in by)
            med_r, fast_r, level_r, round_r = [], [], [], []
            for r in reps:
                b, x = by[(mine, r)], by[(arm, r)]
                med_r.append(step_estimate(sc, b) / step_estimate(sc, x))
                eb, ex = run_estimates(sc, b), run_estimates(sc, x)
                if eb and ex:
                    fast_r.append(min(eb) / min(ex))
                lb, lx = fast_level_estimate(sc, b), fast_level_estimate(sc, x)
                if lb and lx:
                    level_r.append(lb / lx)
                per_round = [p / q for p, q in zip(eb, ex) if q]
                if per_round:
                    round_r.append(statistics.median(per_round))
            out.append({"scenario": sc.name, "arm": arm, "baseline": mine,
                        "median_run": ci(med_r), "fastest_run": ci(fast_r),
                        "fast_level": ci(level_r),
                        "round_pairs": ci(round_r),
                        "neighbours": {
                            "pairs": len(pairs),
                            "spearman": (None if len(pairs) < 3 else
                                         round(spearman([p[0] for p in pairs],
                                                        [p[1] for p in pairs]), 3)),
                            "gap_s_median": (round(statistics.median(p[2] for p in pairs), 3)
                                             if pairs else None),
                            "slow_share": round(sum(1 for _, _, v in slow if v > 1.15)
                                                / max(1, len(slow)), 3)}})
    return out


def process_spread(raw: dict, rows: list) -> list:
    """Per scenario, the fast-level medians of the A/A arms (environment equal to the
    baseline's) and their spread: (max - min) and the sample SD, in % of 1. With one A/A
    arm the spread is its distance from 1; the SD needs two or more."""
    base = raw.get("baseline", "vanilla")
    env = {n: a.get("env") for n, a in (raw.get("arms") or {}).items()}
    replicas = [n for n in env if n != base and env[n] == env.get(base)]

    def a_replica(process):       # a later generation's processes too (aa.p2@g1)
        return split_generation(process)[0] in replicas
    out = []
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        meds = {r["arm"]: r["fast_level"]["median"] for r in rows
                if r["scenario"] == sc and a_replica(r["arm"]) and r.get("fast_level")}
        if not meds:
            continue
        # the baseline's own process reads 1, once per generation (each its own baseline)
        gens = {split_generation(r["arm"])[1] for r in rows if r["scenario"] == sc}
        xs = [1.0] * len(gens) + list(meds.values())
        out.append({"scenario": sc, "replicas": meds,
                    "range_pct": round(100 * (max(xs) - min(xs)), 2),
                    "sd_pct": round(100 * statistics.stdev(xs), 2) if len(xs) > 2 else None})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", help="e2e-raw.json or e2e-raw.json.gz of an instrument run")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    try:
        raw = read_json(a.raw)
    except ResultsFileError as e:
        print(f"interleave_check: {e}", file=sys.stderr)
        return 2
    rows = analyse(raw)
    if not rows:
        print("no paired samples in", a.raw)
        return 1

    def fmt(c):
        return "—" if c is None else f"{c['median']:.3f} [{c['ci'][0]:.3f}, {c['ci'][1]:.3f}] ±{c['half_width_pct']:.1f}%"
    for r in rows:
        nb = r["neighbours"]
        print(f"{r['scenario']:>14} {r['arm']:>11}  median run {fmt(r['median_run'])}  "
              f"fastest run {fmt(r['fastest_run'])}  fast level {fmt(r['fast_level'])}  "
              f"round pairs {fmt(r['round_pairs'])}  "
              f"neighbours rho {nb['spearman']} ({nb['pairs']} pairs, {nb['gap_s_median']} s "
              f"apart), runs >1.15x slow {nb['slow_share']:.0%}")
    spread = process_spread(raw, rows)
    for sp in spread:
        print(f"{sp['scenario']:>14} processes of the baseline's engine at the fast level: "
              + ", ".join(f"{k} {v:.3f}" for k, v in sp["replicas"].items())
              + f"  range {sp['range_pct']:.1f} %"
              + (f", SD {sp['sd_pct']:.1f} %" if sp["sd_pct"] is not None else ""))
    # with several processes per arm, the instrument's own points (the CI resamples them)
    procs = int(raw.get("procs") or 1)
    arm_points = []
    if procs > 1:
        names = list(dict.fromkeys(s["arm"] for s in raw["samples"]))
        scs = [Scenario(**sd) for sd in raw["scenarios"]]
        by_name = {sc.name: sc for sc in scs}
        # each repetition's main figure read with today's step_estimate, as the rows above
        smp = [{**s, "time_s": step_estimate(by_name[s["scenario"]], s)}
               for s in raw["samples"] if s["scenario"] in by_name]
        arm_points = compute_points(smp, scs, names, raw.get("baseline", "vanilla"))
        for p in arm_points:
            off = p.get("process_offsets_pct") or {}
            def fig(m, lo, hi):
                if p.get(m) is None:
                    return "—"
                return (f"{p[m]:.3f} [{p[lo]:.3f}, {p[hi]:.3f}] "
                        f"±{50 * (p[hi] - p[lo]) / p[m]:.1f}%")
            print(f"{p['scenario']:>14} {p['arm']:>11}  {procs} processes a side: median run "
                  f"{fig('ratio_median', 'ci_low', 'ci_high')}  fast level "
                  f"{fig('fast_ratio_median', 'fast_ci_low', 'fast_ci_high')}"
                  f"  process offsets (median run) arm {off.get('arm')} baseline "
                  f"{off.get('vanilla')} %")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"points": rows, "process_spread": spread,
                       "arm_points": [{k: v for k, v in p.items()
                                       if k not in ("ratios", "fast_ratios")}
                                      for p in arm_points]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
