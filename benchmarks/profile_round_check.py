"""Does the kernel profile's first round read like its later ones? (issue 11, session 40.)

    python benchmarks/profile_round_check.py DIR/e2e-raw.json [--json OUT] [--tol 0.5]

Since session 40 the first round of the kernel profile (round 0 of every scenario) runs
after the first warm-up repetition, the later rounds after the timed repetitions
(``fltune.evaluate.e2e.run_e2e``: what the first round cost is what the time limit keeps for
each later one). That placement is an assumption to check on the first GPU run: a round
taken while an engine is still settling (a workspace grown, an allocator warming, clocks)
could read its kernels slower or faster than the rounds after hundreds of timed runs.

Per scenario and arm (``kernels[scenario][arm]["rounds_us"]``), every round's
leave-one-out deviation: its kernel µs per step over the median of the other rounds, in
percent. Round 0's is the offset in question; the later rounds' are the yardstick, what a
round taken like the others deviates by chance. The same for the paired ratio the
instrument reports per round (baseline / arm, :func:`fltune.evaluate.e2e.compute_points`),
where an offset both arms share cancels: the part of an offset that could move a figure.

Verdict, for kernel time (over all points) and for the ratio (per arm, over its
scenarios: an offset of one arm moves that arm's figures alone) alike: round 0 is
*systematically off* when it leans one way at ``--share`` of the points (default 0.8) and its median deviation exceeds
both ``--tol`` % (default 0.5) and twice the later rounds' median absolute deviation; then
move the first round later (e.g. after the second warm-up repetition). Also printed: the
run's ``host.profile_cost`` (what the first round cost, what the limit reserved, what a
later round took on average, what the rounds spent), so that a reservation far from what
the later rounds took shows.

Raw files from before session 40 (round 0 after the timed runs, no ``profile_cost``)
read too: they give the rounds' spread when all rounds are taken alike, the yardstick.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fltune.evaluate.results_file import ResultsFileError, read_json  # noqa: E402


def _loo(xs: list) -> list:
    """Each value's deviation from the median of the others, in percent (leave-one-out):
    the same yardstick for round 0 and for each later round."""
    out = []
    for i, x in enumerate(xs):
        rest = xs[:i] + xs[i + 1:]
        m = statistics.median(rest)
        out.append(100.0 * (x / m - 1.0) if m else 0.0)
    return out


def round_offsets(raw: dict, baseline: str | None = None) -> list:
    """One row per (scenario, arm) with at least two profiled rounds: round 0, the later
    rounds' median, and each round's leave-one-out deviation (%, round 0 first); for arms
    other than the baseline also the paired ratio's (baseline / arm) per round and its
    leave-one-out deviations."""
    baseline = baseline or raw.get("baseline") or "vanilla"
    rows = []
    for sc, by_arm in (raw.get("kernels") or {}).items():
        base = (by_arm.get(baseline) or {}).get("rounds_us") or []
        for arm, res in by_arm.items():
            us = (res or {}).get("rounds_us") or []
            if len(us) < 2 or not all(us):
                continue
            dev = _loo(us)
            row = {"scenario": sc, "arm": arm, "round0_us": round(us[0], 2),
                   "later_median_us": round(statistics.median(us[1:]), 2),
                   "offset_pct": round(dev[0], 3),
                   "later_dev_pct": [round(d, 3) for d in dev[1:]]}
            if arm != baseline and len(base) >= 2 and all(base):
                n = min(len(base), len(us))
                ratios = [base[i] / us[i] for i in range(n)]
                rdev = _loo(ratios)
                row["ratios"] = [round(r, 5) for r in ratios]
                row["ratio_shift_pct"] = round(rdev[0], 3)
                row["ratio_later_dev_pct"] = [round(d, 3) for d in rdev[1:]]
            rows.append(row)
    return rows


def _judge(first: list, later: list, tol_pct: float, share: float) -> tuple:
    """(off, text): ``first`` holds round 0's deviation per point, ``later`` every later
    round's. Off when round 0 leans one way at ``share`` of the points and its median
    deviation exceeds both ``tol_pct`` and twice the later rounds' typical (median
    absolute) deviation: a lean beyond what any round shows by chance."""
    if not first:
        return None, "nothing to compare"
    up = sum(1 for d in first if d > 0)
    lean = max(up, len(first) - up) >= share * len(first)
    med0 = statistics.median(first)
    yard = statistics.median(abs(d) for d in later) if later else 0.0
    off = lean and abs(med0) > max(tol_pct, 2 * yard)
    return off, (f"round 0 {med0:+.2f} % at the median ({max(up, len(first) - up)} of "
                 f"{len(first)} points one way), later rounds ±{yard:.2f} % typical")


def verdict(rows: list, tol_pct: float = 0.5, share: float = 0.8) -> dict:
    """Whether round 0 reads systematically off the later rounds, in kernel time and in
    the paired ratio the instrument reports (see the module doc)."""
    if not rows:
        return {"points": 0, "off": None,
                "why": "no (scenario, arm) with two or more profiled rounds"}
    k_off, k_why = _judge([r["offset_pct"] for r in rows],
                          [d for r in rows for d in r["later_dev_pct"]], tol_pct, share)
    # the ratio per arm: an offset of one arm's round 0 moves that arm's figure alone
    ratio = {}
    for arm in dict.fromkeys(r["arm"] for r in rows if "ratio_shift_pct" in r):
        rr = [r for r in rows if r["arm"] == arm and "ratio_shift_pct" in r]
        off, why = _judge([r["ratio_shift_pct"] for r in rr],
                          [d for r in rr for d in r["ratio_later_dev_pct"]], tol_pct, share)
        ratio[arm] = {"off": off, "why": why}
    r_off = any(v["off"] for v in ratio.values())
    r_why = "; ".join(f"{a}: {v['why']}" for a, v in ratio.items()) or "no arm beside the baseline"
    return {"points": len(rows), "off": bool(k_off or r_off),
            "kernel_time": {"off": k_off, "why": k_why},
            "ratio": {"off": r_off, "arms": ratio},
            "why": f"kernel time: {k_why}; paired ratio: {r_why}"}


def profile_cost(raw: dict) -> dict:
    """The run's ``host.profile_cost`` with the later rounds' mean cost beside what the
    limit reserved per round ({} where the run predates it or had no kernel profile)."""
    cost = dict((raw.get("host") or {}).get("profile_cost") or {})
    if not cost:
        return {}
    rounds = cost.get("round_s") or {}
    later = [s for v in rounds.values() for s in v[1:]]
    n_later = max((len(v) for v in rounds.values()), default=1) - 1
    if later and n_later > 0:
        cost["later_round_s"] = round(sum(later) / n_later, 3)
    return cost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", help="an fltune bench --e2e raw file (e2e-raw.json[.gz])")
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--tol", type=float, default=0.5, help="percent (default 0.5)")
    ap.add_argument("--share", type=float, default=0.8)
    ap.add_argument("--json", default=None, help="write rows, verdict and cost here")
    a = ap.parse_args(argv)
    try:
        raw = read_json(a.raw, require=("kernels",))
    except ResultsFileError as e:
        print(f"profile_round_check: {e}", file=sys.stderr)
        return 2
    rows = round_offsets(raw, a.baseline)
    v = verdict(rows, a.tol, a.share)
    cost = profile_cost(raw)
    print(f"{'scenario':<14} {'arm':<12} {'round0':>10} {'later':>10} {'dev0%':>7} "
          f"{'later dev%':>14} {'ratio dev0%':>11} {'later':>14}")
    for r in rows:
        later = " ".join(f"{d:+.2f}" for d in r["later_dev_pct"])
        line = (f"{r['scenario']:<14} {r['arm']:<12} {r['round0_us']:>10.1f} "
                f"{r['later_median_us']:>10.1f} {r['offset_pct']:>+7.2f} {later:>14}")
        if "ratio_shift_pct" in r:
            rl = " ".join(f"{d:+.2f}" for d in r["ratio_later_dev_pct"])
            line += f" {r['ratio_shift_pct']:>+11.2f} {rl:>14}"
        print(line)
    if cost:
        print("profile_cost: " + ", ".join(f"{k}={cost[k]}" for k in
                                           ("first_round_s", "reserved_s", "later_round_s",
                                            "spent_s", "last_rep_s") if k in cost))
    else:
        print("profile_cost: none in this file (a run before session 40, or no kernel "
              "profile)")
    print(("SYSTEMATICALLY OFF: " if v["off"] else "ok: " if v["off"] is not None
           else "no verdict: ") + v["why"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "verdict": v, "profile_cost": cost}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
