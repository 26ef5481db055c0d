"""Does the host speedometer see the slow periods? (issue 11: the wall A/A.)

    python benchmarks/probe_check.py DIR/e2e-raw.json [--slow 1.15]

Reads an ``fltune bench --e2e`` raw file whose samples carry ``probe_us`` (a fixed Python
loop timed right before and after each run: ``e2e_worker.host_probe_us``) and prints:

1. per scenario, the rank correlation between a run's slowness (its time over its arm's
   median for that scenario) and its probe's slowness (the slower of its two probes over
   that worker's speed floor: the gate's own ``floor_us`` where the run was gated, else the
   10th percentile of its recorded probes, as ``e2e_worker.SpeedFloor``) — near 0: the probe does not see what slows the runs;
2. the A/A and every other arm's ratio to the baseline as the instrument computes it, then
   with every repetition dropped in which any arm's probe read more than ``--slow`` times
   its worker's floor (all arms of the repetition go, so the pairing holds).

3. with ``--gate F`` (default 1.25, the instrument's), the ratios again from only the *runs* whose two probes
   read within F times their worker's floor (each sample's estimate from its kept runs;
   a sample with none is left out, and its repetition's pair with it): what the
   instrument's probe gate (``fltune bench --e2e --probe-gate``, ``e2e_worker.gated_runs``)
   would have kept, short of the retakes it adds.

If (1) is high and (2)/(3) narrow the A/A, the instrument can re-take samples taken while
the host ran slow; if not, the slow level is not the CPU's speed at plain Python work.
Reads partial raw files (``e2e-raw.partial.json``, a run cut by its time limit) too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from fltune.evaluate.e2e import (Scenario, baseline_process, bootstrap_ci,
                                 samples_by_process, step_estimate)
from fltune.evaluate.results_file import ResultsFileError, read_json
from fltune.integrations.vllm.e2e_worker import SpeedFloor


def ranks(xs):
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    for k, i in enumerate(order):
        r[i] = float(k)
    return r


def spearman(a, b):
    if len(a) < 3:
        return None
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--slow", type=float, default=1.15,
                    help="a probe this many times its worker's floor marks a slow period")
    ap.add_argument("--gate", type=float, default=1.25,
                    help="keep only runs whose probes read within this factor (per run)")
    a = ap.parse_args(argv)
    try:   # plain or gzipped (committed raw files are: benchmarks/results/README.md)
        raw = read_json(a.raw)
    except ResultsFileError as e:
        sys.exit(f"probe_check: {e}")
    base = raw["baseline"]
    scen = {s["name"]: Scenario(**s) for s in raw["scenarios"]}
    # each worker process its own arm (``--procs``: vanilla, vanilla.p2, ...)
    samples = [s for s in samples_by_process(raw["samples"])
               if all("probe_us" in h for h in s.get("host", []))]
    if not samples:
        sys.exit("no sample carries probe_us (a raw file from before the probe)")
    floors = {}
    for s in samples:
        for h in s["host"]:
            for p in h["probe_us"]:
                floors.setdefault(s["arm"], SpeedFloor()).add(p)
    fastest = {arm: f.us for arm, f in floors.items()}   # (its last 400, as in the worker)

    def floor_of(s):
        """The floor the worker gated this sample against (its account's ``floor_us``,
        which also saw the seed and the retaken runs' probes), else the arm's floor from
        the recorded probes (an ungated run)."""
        return (s.get("gate") or {}).get("floor_us") or fastest[s["arm"]]
    out = {"slow": a.slow, "scenarios": {}}
    for name, sc in scen.items():
        mine = [s for s in samples if s["scenario"] == name]
        t = {(s["arm"], s["rep"]): step_estimate(sc, s) for s in mine}
        gated = {}
        for s in mine:
            keep = [run for run, h in zip(s["runs"], s["host"])
                    if max(h["probe_us"]) <= a.gate * floor_of(s)]
            if keep:
                gated[(s["arm"], s["rep"])] = step_estimate(sc, {"runs": keep})
        med = {arm: statistics.median(v for (x, _), v in t.items() if x == arm)
               for arm in {s["arm"] for s in mine}}
        slowness = [t[(s["arm"], s["rep"])] / med[s["arm"]] for s in mine]
        probe = [max(max(h["probe_us"]) for h in s["host"]) / floor_of(s) for s in mine]
        bad_reps = {s["rep"] for s, p in zip(mine, probe) if p > a.slow}
        reps = sorted({s["rep"] for s in mine})
        row = {"spearman": spearman(slowness, probe), "reps": len(reps),
               "reps_dropped": len(bad_reps), "arms": {}}
        for arm in med:
            beside = baseline_process(arm, base)   # the baseline beside it, its generation's
            if arm == beside:
                continue
            for label, keep, tt in (("all", reps, t),
                                    ("probe_ok", [r for r in reps if r not in bad_reps], t),
                                    ("gated", reps, gated)):
                ratios = [tt[(beside, r)] / tt[(arm, r)] for r in keep
                          if (beside, r) in tt and (arm, r) in tt]
                m, lo, hi = bootstrap_ci(ratios) if ratios else (None, None, None)
                row["arms"].setdefault(arm, {})[label] = {"n": len(ratios), "median": m,
                                                          "ci": [lo, hi]}
        out["scenarios"][name] = row
        rho = row["spearman"]
        print(f"{name}: run slowness vs probe slowness, Spearman "
              f"{'n/a' if rho is None else f'{rho:+.2f}'}; reps with a slow probe "
              f"{len(bad_reps)}/{len(reps)}")
        for arm, v in row["arms"].items():
            def fmt(x):
                return ("n/a" if x["median"] is None else
                        f"{x['median']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}] n={x['n']}")
            print(f"  {arm:12} all {fmt(v['all'])}   probe-ok {fmt(v['probe_ok'])}   "
                  f"gated runs {fmt(v['gated'])}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
