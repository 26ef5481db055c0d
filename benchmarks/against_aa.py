"""Read an ``fltune bench --e2e`` summary's arms against its A/A arms, after the fact.

``fltune bench --e2e`` stores this reading (``against_aa``) in every summary since session
38; summaries written before it (the evidence files of sessions 15-37) lack it. This
script applies the same function, ``fltune.evaluate.model_step.read_against_aa``, to
summaries on disk and prints one line per scenario and arm, or writes the readings as
JSON (``--out``), one entry per file, leaving the summaries themselves as they were
measured.

    python3 benchmarks/against_aa.py benchmarks/results/h100-2026-12-06-s38/*-e2e-summary.json \\
        --out benchmarks/results/h100-2026-12-06-s38/against-aa.json
"""
from __future__ import annotations

import argparse
import json
import sys

from fltune.cli.render import against_aa_lines
from fltune.evaluate.model_step import read_against_aa


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summaries", nargs="+", help="e2e-summary.json files")
    ap.add_argument("--out", help="write {file: reading} as JSON here")
    a = ap.parse_args(argv)
    out = {}
    for path in a.summaries:
        try:
            with open(path) as f:
                doc = json.load(f)
            if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
                raise ValueError("no points list at its top level")
            reading = read_against_aa(doc)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"against_aa: {path}: not a readable e2e summary ({e})", file=sys.stderr)
            return 2
        out[path] = reading
        if not reading:
            print(f"{path}: no A/A arm (vanilla again or recompiled) to read against")
        for sc, arm, verdict, floors in against_aa_lines(reading):
            print(f"{path}: {sc} {arm}: {verdict or 'no usable CI'} {floors}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
