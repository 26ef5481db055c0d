"""Would pairing each run with the other arm's run next to it in time narrow the wall A/A?
(issue 11: the wall A/A on a slow host.)

    python benchmarks/adjacent_pairs.py RAW.json[.gz] [--baseline vanilla] [--json OUT]

Why: on session 44's H100s the host ran ~2x slow for 70 % of the runs and the wall A/A
read ±5-15 % at a 2048-token prefill. The instrument pairs the arms per *repetition*
(each arm's median run, geometric mean over its processes: ``e2e_stats.paired_ratios``);
if the host's slow periods outlast the ~30 ms between two interleaved runs, a run and its
neighbour of the other arm share them, and a ratio taken run by run would cancel them.

Per scenario and arm, from every timed run's ``t_mono`` (the worker's clock at the run):

1. the lag correlation of log run time along the time line (all runs of both arms): the
   share of a run's variance that its neighbours 1, 5, 50 runs away share;
2. the spread (SD of the log, in %) of the per-repetition ratio two ways: the instrument's
   (``paired_ratios``) and the median over the repetition's time-adjacent pairs (a run of
   one arm followed by a run of the other), with the instrument's CI half-width beside it.

Read: a lag-1 correlation near 1 with a much smaller adjacent-pair spread says the slow
periods are long and run pairing would remove them; a correlation near 0.5 says half a
run's variance is its own (a stall of a few ms inside one run), which no pairing removes.
The adjacent-pair spread is per repetition only: it does not resample the processes, so
its figure is not a CI (a process's own offset is still in it: session 35's quiet-host
A/A at decode would read it as an effect).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fltune.evaluate import e2e_stats as st  # noqa: E402
from fltune.evaluate.results_file import ResultsFileError, read_json  # noqa: E402


def run_value(kind: str, steps: list) -> float | None:
    """One run's time as the instrument reads it: a prefill's engine steps summed, a
    decode run's median window (``e2e_stats.run_windows``)."""
    if not steps:
        return None
    if kind == "prefill":
        return sum(steps)
    windows = st.run_windows(steps)
    return statistics.median(windows) if windows else None


def timeline(samples: list, kind: str) -> list:
    """Every timed run of ``samples`` as (t_mono, arm, rep, seconds), in time order."""
    out = []
    for s in samples:
        for steps, h in zip(s.get("runs") or [], s.get("host") or []):
            v = run_value(kind, steps)
            if v and h.get("t_mono") is not None:
                out.append((h["t_mono"], s["arm"], s["rep"], v))
    return sorted(out)


def lag_corr(xs: list, lag: int) -> float | None:
    if len(xs) <= lag + 2:
        return None
    a, b = xs[:-lag], xs[lag:]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return cov / var if var else None


def adjacent_ratios(runs: list, baseline: str) -> dict:
    """rep -> the log ratios baseline / other of the time-adjacent pairs inside it."""
    by_rep: dict = {}
    for a, b in zip(runs, runs[1:]):
        if a[1] != b[1] and a[2] == b[2] and baseline in (a[1], b[1]):
            base, other = (a, b) if a[1] == baseline else (b, a)
            by_rep.setdefault(a[2], []).append(math.log(base[3]) - math.log(other[3]))
    return by_rep


def read(raw: dict, baseline: str = "vanilla") -> list:
    kinds = {x["name"]: x["kind"] for x in raw["scenarios"]}
    rows = []
    for sc in sorted({s["scenario"] for s in raw["samples"]}):
        for arm in sorted({s["arm"] for s in raw["samples"]} - {baseline}):
            ss = [s for s in raw["samples"] if s["scenario"] == sc and s["arm"] in
                  (baseline, arm)]
            runs = timeline(ss, kinds.get(sc, "decode"))
            logs = [math.log(r[3]) for r in runs]
            adj = [statistics.median(v) for _, v in sorted(adjacent_ratios(runs, baseline)
                                                             .items())]
            b = st.complete_processes(st.rep_table(raw["samples"], sc, baseline))
            a = st.complete_processes(st.rep_table(raw["samples"], sc, arm))
            _, lo, hi, ratios = st.hierarchical_ci(b, a)
            if not ratios or len(adj) < 2:
                continue
            rows.append({
                "scenario": sc, "arm": arm, "runs": len(runs), "reps": len(ratios),
                "gap_ms_median": round(1e3 * statistics.median(
                    [y[0] - x[0] for x, y in zip(runs, runs[1:])]), 1),
                "lag_corr": {str(k): (None if lag_corr(logs, k) is None
                                      else round(lag_corr(logs, k), 3)) for k in (1, 5, 50)},
                "rep_sd_pct_instrument": round(100 * statistics.pstdev(
                    [math.log(x) for x in ratios]), 2),
                "ci_half_width_pct_instrument": round(50 * (hi - lo), 2),
                "rep_sd_pct_adjacent": round(100 * statistics.pstdev(adj), 2),
                "ratio_median_adjacent": round(math.exp(statistics.median(adj)), 4)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw")
    ap.add_argument("--baseline", default=None, help="default: the raw file's baseline")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    try:
        raw = read_json(a.raw)
    except ResultsFileError as e:
        sys.exit(f"adjacent_pairs.py: {e}")
    rows = read(raw, a.baseline or raw.get("baseline") or "vanilla")
    for r in rows:
        lc = r["lag_corr"]
        print(f"{r['scenario']:<14} {r['arm']:<8} {r['runs']} runs, {r['gap_ms_median']} ms "
              f"apart; lag corr 1/5/50: {lc['1']}/{lc['5']}/{lc['50']}; per-rep SD "
              f"instrument {r['rep_sd_pct_instrument']:.2f} % (CI ±"
              f"{r['ci_half_width_pct_instrument']:.2f} %), adjacent pairs "
              f"{r['rep_sd_pct_adjacent']:.2f} % (median {r['ratio_median_adjacent']:.4f})")
    if not rows:
        print("no scenario with paired runs and their t_mono (raw data before session 33?)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw": a.raw, "command": "python3 benchmarks/adjacent_pairs.py "
                       + " ".join(argv if argv is not None else sys.argv[1:]),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
