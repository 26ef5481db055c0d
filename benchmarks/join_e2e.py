"""Join several ``fltune bench --e2e`` summaries of one model into the evidence file.

A GPU call of 10 minutes measures two scenarios with ten repetitions per arm; issue 11's
``benchmarks/results/e2e-summary-<model>.json`` holds them all. Each run's own command,
date, engine and arms stay under ``runs`` (``fltune.evaluate.e2e.join_summaries`` says
what it refuses and why). The runs' raw data (``e2e-raw.json``, or gzipped) stays beside
each run's summary; ``runs[i].raw`` names it, relative to the joined file.

    python3 benchmarks/join_e2e.py RUN1/e2e-summary.json RUN2/e2e-summary.json \\
        --out benchmarks/results/e2e-summary-Qwen3-0.6B.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from fltune.evaluate.e2e import join_summaries
from fltune.evaluate.results_file import resolve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summaries", nargs="+", help="e2e-summary.json files of one model")
    ap.add_argument("--out", required=True, help="the joined summary (JSON)")
    a = ap.parse_args(argv)
    docs = []
    for path in a.summaries:
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"join_e2e: {path}: {e}", file=sys.stderr)
            return 2
    try:
        doc = join_summaries(docs)
    except ValueError as e:
        print(f"join_e2e: {e}", file=sys.stderr)
        return 2
    for run, path in zip(doc["runs"], a.summaries):
        # the raw data beside the summary, plain or as committed (gzipped): results_file's rule
        raw = resolve(os.path.join(os.path.dirname(os.path.abspath(path)), "e2e-raw.json"))
        if os.path.isfile(raw):
            run["raw"] = os.path.relpath(raw, os.path.dirname(os.path.abspath(a.out)))
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}: {len(doc['points'])} points from {len(docs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
