"""Host cost per call of the ``linear`` seam against vLLM's own GEMM call, on this device.

    python benchmarks/seam_overhead.py --db DB [--shapes N:K,...] [--tokens 1,2048] [--out F]

Why: on the H200 (session 6), routing ``linear`` cut Qwen3.5-0.8B's GPU kernel time per
batch-1 decode step by 22 % but made the step's wall time 6 % longer, and prefill 2048 23 %
longer with equal kernel time: the seam costs host time per call. This separates the
layers of that cost, each route calling the same frozen pick for the same tensors:

  F.linear         what vLLM's ``default_unquantized_gemm`` calls (the floor)
  pick             the frozen band pick's function itself (``impl.fn``)
  dispatch         ``ops.dispatch``: band lookup, support check, counter, call
  custom_op        ``torch.ops.fltune.linear``: the ``torch.library`` op the seam puts in
                   vLLM's graph (dispatcher, autograd wrapper, Dynamo-disable frame)

Timed under ``torch.inference_mode()``, as vLLM runs its model (``--grad-mode`` times it with
autograd on, as the first H200 run did: a ``torch.library.custom_op`` costs more there, its
autograd wrapper runs). Per route: the host time per call (calls enqueued back to back, the clock read before the
synchronize) and the time per call with the synchronize (GPU-bound for large shapes).
Medians over interleaved trials. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--shapes", default="5120:1024,1024:2048,8192:1024,32:1024,7168:1024,"
                                        "1024:3584,248320:1024")
    ap.add_argument("--tokens", default="1,16,2048")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--out")
    ap.add_argument("--grad-mode", action="store_true",
                    help="time with autograd on (the first H200 run's setting)")
    ap.add_argument("--db-device", help="the DB's device row (default: this machine's)")
    a = ap.parse_args(argv)
    from fltune.dispatch import frozen
    from fltune.freeze.build import build_manifest
    from fltune.integrations.vllm import linear_seam, ops  # noqa: F401 (registers the op)

    manifest, warns = build_manifest(a.db, device=a.db_device, check_stack=False)
    frozen.freeze_dispatch(manifest)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    fd = frozen.current()
    import contextlib
    mode = contextlib.nullcontext() if a.grad_mode else torch.inference_mode()
    with mode:
        rows = _measure(a, fd, dev, sync, ops)
    doc = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
           "torch": torch.__version__, "db": a.db, "calls": a.calls, "trials": a.trials,
           "mode": "grad" if a.grad_mode else "inference_mode", "warnings": warns,
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


def _measure(a, fd, dev, sync, ops):
    rows = []
    for spec in a.shapes.split(","):
        n, k = (int(v) for v in spec.split(":"))
        with torch.inference_mode(False):     # a layer's weight: a normal tensor, as in vLLM
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for m in (int(t) for t in a.tokens.split(",")):
            if n > 100000 and m > 1024:
                continue
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            impl = fd.select("linear", x, w, None)
            routes = {"F.linear": lambda: F.linear(x, w, None),
                      "pick": lambda: impl.fn(x, w, None),
                      "dispatch": lambda: ops.dispatch("linear", x, w, None),
                      "custom_op": lambda: torch.ops.fltune.linear(x, w, None)}
            for fn in routes.values():
                for _ in range(20):
                    fn()
            sync()
            host = {r: [] for r in routes}
            full = {r: [] for r in routes}
            for _ in range(a.trials):
                for r, fn in routes.items():
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn()
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    host[r].append((t1 - t0) / a.calls * 1e6)
                    full[r].append((t2 - t0) / a.calls * 1e6)
            row = {"n": n, "k": k, "m": m, "pick": impl.impl_id,
                   "host_us": {r: round(statistics.median(v), 2) for r, v in host.items()},
                   "call_us": {r: round(statistics.median(v), 2) for r, v in full.items()}}
            rows.append(row)
            print(f"N={n:6d} K={k:5d} M={m:5d} pick={impl.impl_id:18s} host µs "
                  + " ".join(f"{r}={v:7.2f}" for r, v in row["host_us"].items())
                  + " | with sync " + " ".join(f"{r}={v:7.2f}" for r, v in row["call_us"].items()),
                  flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
