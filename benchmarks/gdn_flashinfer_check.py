"""Warm and check the GDN and FlashInfer candidates on a GPU before calibrating them.

FlashInfer JIT-compiles its kernels on first use (the SM90 GDN prefill for minutes); vLLM's FLA
kernels autotune on first use. Run this once per machine with ``FLASHINFER_WORKSPACE_BASE``
pointing at a directory that lives as long as the machine (``/tmp/fiws``), so the calibration
that follows finds the compiled kernels and never times a compile. For every candidate of the
GDN ops and every FlashInfer candidate it prints: qualified or why not, the first call's wall
time (the compile/autotune), and parity against the reference on Qwen3.5-0.8B's shapes at a few
token counts (``--tokens``). Exit status 1 if a qualified candidate fails parity or raises.

    FLASHINFER_WORKSPACE_BASE=/tmp/fiws python3 benchmarks/gdn_flashinfer_check.py --out r.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fltune.dispatch.manager import get_default_manager
from fltune.dispatch.types import QualifyContext
from fltune.ops import get_op
from fltune.tune import parity


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,7,64,300")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    cap = torch.cuda.get_device_capability() if dev == "cuda" else None
    ctx = QualifyContext(dev, dtype, cap)
    reg = get_default_manager().registry
    rows, bad = [], 0
    for op in reg.ops():
        for impl in reg.get_implementations(op):
            if not (op.startswith("gdn_") or impl.impl_id == "vendor.flashinfer"):
                continue
            why = impl.qualify(ctx)
            row = {"op": op, "impl": impl.impl_id, "qualified": why is None, "reason": why,
                   "first_call_s": None, "parity": {}}
            rows.append(row)
            if why is not None:
                print(f"{op:26} {impl.impl_id:24} unqualified: {why}", flush=True)
                continue
            spec = get_op(op)
            for n in [int(x) for x in a.tokens.split(",")]:
                dims = dict(spec.default_dims)
                if op == "gdn_chunk_prefill" and n > 64:
                    dims["seqs"] = 3              # several sequences, boundaries in chunks
                args = spec.make_inputs(n, dims, dtype, dev, torch.Generator().manual_seed(0))
                declined = impl.unsupported(args)
                if declined:
                    row["parity"][n] = f"declined: {declined}"
                    continue
                t0 = time.perf_counter()
                p = parity.check(spec, impl.fn, args, dtype)
                if dev == "cuda":
                    torch.cuda.synchronize()
                if row["first_call_s"] is None:
                    row["first_call_s"] = round(time.perf_counter() - t0, 2)
                row["parity"][n] = p.as_dict()
                ok = "ok" if p.passed else f"FAIL {p.reason}"
                bad += not p.passed
                print(f"{op:26} {impl.impl_id:24} n={n:<5} score {p.score:.4f} rel_err "
                      f"{p.rel_error:.2e} {ok}  (first call {row['first_call_s']} s)",
                      flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
                       "dtype": a.dtype, "rows": rows}, f, indent=1, default=str)
    print(f"{bad} parity failures among qualified candidates")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
