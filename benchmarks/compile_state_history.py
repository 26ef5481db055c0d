"""Every stored H200 instrument run with a second vanilla arm, read for the engines' compile
state: did each arm's engine compile the model at its start, or load it from vLLM's compile
cache (its worker log: "Compiling a graph" / "saved AOT compiled function" against "Directly
load")? Beside it, the A/A's median wall ratio (vanilla time / arm time, per repetition) at
each scenario.

    python3 benchmarks/compile_state_history.py [RESULTS_DIR]   (default benchmarks/results)

Why (session 27): the wall A/A at prefill 2048 read 1.06-1.17 in run after run, an offset,
not a spread. Where vanilla compiled and the A/A arm loaded, it is the compile state: a
compiled engine runs a host-bound step slower (``fltune.evaluate.e2e.START_STATES``).
A run whose logs were not kept reads "?" (its start times, in the second column, hint: a
load takes 15-45 s, a compile 45-250 s)."""
from __future__ import annotations

import glob
import gzip
import os
import statistics
import sys
import zlib
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fltune.evaluate.e2e import samples_by_process, split_generation  # noqa: E402
from fltune.evaluate.results_file import ResultsFileError, read_json, resolve  # noqa: E402
from fltune.integrations.vllm.e2e_worker import compile_start_state  # noqa: E402

SCENARIOS = ("decode_b1", "decode_b16", "decode_b64", "prefill_2048", "prefill_8192")


def _read(path: str) -> str | None:
    p = resolve(path)                 # a log kept gzipped reads too
    if not os.path.exists(p):
        return None
    try:
        with (gzip.open if p.endswith(".gz") else open)(p, "rt", errors="replace") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as e:     # a log cut short or not gzip
        print(f"compile_state_history: {p} unreadable ({e}): its state reads '?'",
              file=sys.stderr)
        return None


def log_state(text: str | None) -> str:
    """"compiled", "loaded", "both" (a log of two starts) or "?" (no log)."""
    if text is None:
        return "?"
    compiled = "Compiling a graph" in text or "saved AOT compiled" in text
    loaded = "Directly load" in text
    return {(True, False): "compiled", (False, True): "loaded",
            (True, True): "both"}.get((compiled, loaded), "?")


def rows(root: str):
    for f in sorted(glob.glob(os.path.join(root, "**", "e2e-raw*.json*"), recursive=True)):
        try:
            d = read_json(f)
        except ResultsFileError as e:     # said, not silently skipped
            print(f"compile_state_history: skipped {e}", file=sys.stderr)
            continue
        arms = d.get("arms") or {}
        base = d.get("baseline", "vanilla")
        if base not in arms:
            continue
        vanillas = [n for n, a in arms.items() if n != base and not a.get("engine")
                    and not any(str(k).startswith("FLTUNE_") for k in (a.get("env") or {}))]
        by = defaultdict(dict)
        # each worker process its own arm (``--procs``), as ``arms`` names them; a later
        # generation's process (``aa.p2@g1``) under its plain name: a repetition runs in
        # one generation, so it pairs with that generation's baseline process
        for s in samples_by_process(d.get("samples", [])):
            by[(s["scenario"], s["rep"])][split_generation(s["arm"])[0]] = s["time_s"]
        where = os.path.dirname(f)

        def state(name):
            a = arms[name]
            if a.get("compile"):        # the worker's counters (session 27 on), read again
                # with main's rule (session 27's first run labelled its loaded restarts
                # "compiled": vLLM 0.24 counts Inductor compiles in a loaded start)
                return compile_start_state(a["compile"].get("counters"))["state"]
            return log_state(_read(os.path.join(where, f"worker-{name}.log")))

        for other in vanillas:
            med = {}
            for sc in SCENARIOS:
                r = [x[base] / x[other] for k, x in by.items()
                     if k[0] == sc and base in x and other in x]
                if len(r) >= 3:
                    med[sc] = (round(statistics.median(r), 3), len(r))
            if med:
                yield {"run": os.path.relpath(f, root), "model": d.get("model"),
                       "baseline_state": state(base), "arm": other, "arm_state": state(other),
                       "start_s": (arms[base].get("start_s"), arms[other].get("start_s")),
                       "median_ratio": med}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = argv[0] if argv else "benchmarks/results"
    out = list(rows(root))
    for r in out:
        print(f"{r['run'][:64]:64s} {r['baseline_state']:>8s}/{r['arm_state']:<8s} "
              f"{str(r['start_s']):14s} {r['arm']:12s} "
              + " ".join(f"{sc}={v[0]}" for sc, v in r["median_ratio"].items()))
    print("\nprefill_2048, by (vanilla state / A/A arm state): median ratios")
    groups = defaultdict(list)
    for r in out:
        if "prefill_2048" in r["median_ratio"]:
            groups[(r["baseline_state"], r["arm_state"])].append(r["median_ratio"]["prefill_2048"][0])
    for k, v in sorted(groups.items()):
        print(f"  {k[0]:>8s} / {k[1]:<8s} n={len(v):2d}  above 1: {sum(x > 1 for x in v):2d}  "
              f"ratios {sorted(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
