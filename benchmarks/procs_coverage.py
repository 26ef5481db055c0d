"""How honest is the e2e instrument's CI when each process has an offset of its own? (issue 11)

    python3 benchmarks/procs_coverage.py [--sims 300] [--json OUT]

A simulation (CPU; no GPU figure): an A/A run — two arms of one engine, so the true ratio is
1 — where every worker process sits at a level of its own (an offset drawn once per process,
SD ``sigma_p``, the same in every repetition), every repetition has a level the host gives
all processes alike (paired away), and every sample its own noise (SD ``sigma_e``). For each
design it counts how often the 95 % CI holds 1 (coverage; 95 % is honest) and how wide it is:

- ``one process, reps bootstrap``: the instrument before ``--procs`` (one process per arm,
  :func:`fltune.evaluate.e2e.bootstrap_ci` over repetitions);
- ``K processes, reps bootstrap``: K processes per arm averaged, the process level ignored;
- ``K processes, hierarchical``: :func:`fltune.evaluate.e2e.hierarchical_ci`, what
  ``fltune bench --e2e --procs K`` computes (with ``--generations G``: the repetitions in
  G blocks, each with new processes, as ``fltune bench --e2e --generations G`` runs them).

The defaults are the bound session 34 read off the loaded A/A runs of sessions 28 and 33
(``sigma_p`` 0.68 %) and a per-repetition noise at the fast level of about 1 %; README,
"the process as a level of the CI".
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fltune.evaluate.e2e import bootstrap_ci, hierarchical_ci  # noqa: E402


def simulate(k: int, reps: int, sigma_p: float, sigma_e: float, rng: random.Random,
             generations: int = 1) -> tuple:
    """(base, arm) tables of one simulated A/A: repetition -> {process -> seconds}. With
    ``generations`` G > 1 the repetitions fall in G consecutive blocks, each with new
    processes (new offsets), keyed ``(generation, replica)`` as ``rep_table`` keys a run
    with ``--generations``."""
    tables: dict = {"base": {}, "arm": {}}
    off: dict = {}
    for r in range(reps):
        g = r * generations // reps
        if g not in off:
            off[g] = {side: [rng.gauss(0.0, sigma_p) for _ in range(k)] for side in tables}
        level = rng.gauss(0.0, 0.05)             # the host's level: shared, paired away
        for side in tables:
            tables[side][r] = {((g, j + 1) if generations > 1 else j + 1):
                               1e-3 * math.exp(level + off[g][side][j]
                                               + rng.gauss(0.0, sigma_e))
                               for j in range(k)}
    return tables["base"], tables["arm"]


def run(k: int, reps: int, sigma_p: float, sigma_e: float, sims: int, resamples: int,
        seed: int = 0, generations: int = 1) -> dict:
    rng = random.Random(seed)
    out = {name: {"covered": 0, "half_width_pct": []}
           for name in ("one process, reps bootstrap", "K processes, reps bootstrap",
                        "K processes, hierarchical")}

    def count(name, lo, hi):
        out[name]["covered"] += int(lo <= 1.0 <= hi)
        out[name]["half_width_pct"].append(50.0 * (hi - lo))

    for i in range(sims):
        base, arm = simulate(k, reps, sigma_p, sigma_e, rng, generations)
        first = {r: min(t) for r, t in base.items()}     # each repetition's first process
        one = [base[r][first[r]] / arm[r][first[r]] for r in base]
        count("one process, reps bootstrap", *bootstrap_ci(one, resamples=resamples,
                                                           seed=i)[1:])
        _, lo, hi, ratios = hierarchical_ci(base, arm, resamples=resamples, seed=i)
        count("K processes, reps bootstrap", *bootstrap_ci(ratios, resamples=resamples,
                                                           seed=i)[1:])
        count("K processes, hierarchical", lo, hi)
    return {name: {"coverage": round(v["covered"] / sims, 3),
                   "half_width_pct_median": round(statistics.median(v["half_width_pct"]), 2)}
            for name, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sims", type=int, default=300)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--procs", default="1,2,3,4", help="comma-separated K")
    ap.add_argument("--generations", type=int, default=1,
                    help="fresh processes this many times in the run (`fltune bench --e2e "
                         "--generations`): the repetitions in as many blocks")
    ap.add_argument("--sigma-p", type=float, default=0.0068, help="a process's offset SD")
    ap.add_argument("--sigma-e", type=float, default=0.01, help="a sample's own noise SD")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    rows = []
    for k in [int(x) for x in a.procs.split(",")]:
        res = run(k, a.reps, a.sigma_p, a.sigma_e, a.sims, a.resamples,
                  generations=a.generations)
        for name, v in res.items():
            if k == 1 and a.generations == 1 and name != "one process, reps bootstrap":
                continue          # one process a side: all three are the same CI
            rows.append({"procs": k, "generations": a.generations, "design": name, **v})
            print(f"K={k} G={a.generations}  {name:<30} coverage {v['coverage']:.3f}  "
                  f"CI half-width {v['half_width_pct_median']:.2f} % (median)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"sims": a.sims, "reps": a.reps, "generations": a.generations, "sigma_p": a.sigma_p,
                       "sigma_e": a.sigma_e, "resamples": a.resamples,
                       "command": "python3 benchmarks/procs_coverage.py "
                                  + " ".join(argv if argv is not None else sys.argv[1:]),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
