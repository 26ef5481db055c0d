"""Parity of every candidate that runs here, on a model's shapes, in several dtypes.

    python benchmarks/parity_sweep.py --model Qwen3.5-0.8B --dtypes bf16,fp16 \
        --tokens 1,64,4096 --out parity.json

For each op of the model's workload (and every other op at its default, Qwen3.5-0.8B dims),
each dtype and token count: every qualified candidate's parity score, error and pass/fail
against the high-precision reference. Prints a summary; writes raw JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fltune.store import device as devmod
from fltune.dispatch import get_default_manager
from fltune.dispatch.types import QualifyContext
from fltune.ops import OPS, dtype_from_name, workload_dims
from fltune.tune import parity
from fltune.tune.workload import derive


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen3.5-0.8B")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--tokens", default="1,64,4096")
    ap.add_argument("--out", default="parity.json")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = get_default_manager()
    wl = derive(a.model)
    cases = [(i.op, i.dims_dict, i.where) for i in wl.items]
    covered = {i.op for i in wl.items}
    cases += [(name, dict(spec.default_dims), "default dims") for name, spec in OPS.items()
              if name not in covered]
    results, failures = [], []
    t0 = time.time()
    for dt_name in a.dtypes.split(","):
        dt = dtype_from_name(dt_name)
        cap = torch.cuda.get_device_capability() if dev == "cuda" else None
        ctx = QualifyContext(dev, dt, cap)
        for op, dims, where in cases:
            spec = OPS[op]
            for n in map(int, a.tokens.split(",")):
                args = spec.make_inputs(n, dims, dt, dev, torch.Generator().manual_seed(n))
                ref = parity.reference_outputs(spec, args)
                for impl in m.registry.get_implementations(op):
                    why = impl.qualify(ctx)
                    rec = {"op": op, "where": where, "signature": spec.signature(dims),
                           "dtype": dt_name, "tokens": n, "impl_id": impl.impl_id}
                    if why:
                        rec.update(qualified=False, reason=why)
                    else:
                        # inside the item's dims, as the race calls (native.vllm builds
                        # per rows per token and context: ops.workload_dims)
                        with workload_dims(dims):
                            r = parity.check(spec, impl.fn, args, dt, reference=ref)
                        rec.update(qualified=True, **r.as_dict())
                        if not r.passed:
                            failures.append(rec)
                    results.append(rec)
    doc = {"device": devmod.current(dev), "stack": devmod.stack(), "model": a.model,
           "command": " ".join(sys.argv), "wall_s": round(time.time() - t0, 1),
           "checked": sum(1 for r in results if r.get("qualified")),
           "failed": len(failures), "failures": failures, "results": results}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"parity on {doc['device']['name']}: {doc['checked']} candidate checks, "
          f"{doc['failed']} failed ({doc['wall_s']} s) -> {a.out}")
    for r in failures:
        print(f"  FAIL {r['op']} {r['dtype']} n={r['tokens']} {r['impl_id']}: score "
              f"{r['score']:.4f} {r.get('reason')}")
    by = {}
    for r in results:
        if r.get("qualified"):
            by.setdefault(r["impl_id"], [0, 0])[0 if r["passed"] else 1] += 1
    for k, (ok, bad) in sorted(by.items()):
        print(f"  {k:24s} passed {ok:4d}  failed {bad}")


if __name__ == "__main__":
    main()
