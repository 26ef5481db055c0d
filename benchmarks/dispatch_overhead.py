"""Dispatch overhead: nanoseconds per call of each way fltune can route an op, in eager mode.

    python benchmarks/dispatch_overhead.py [--device cpu|cuda] [--out FILE] [--calls N] [--trials T]

Routes timed, each calling the *same* implementation, so the differences are dispatch alone:

  direct            impl.fn(*args)                       (no dispatch: the floor)
  frozen_1band      FrozenDispatch.call(op, *args), a table with one band (no bisect)
  frozen_1band_nocheck  the same, for the candidate with its ``supports`` declaration
                    removed: the difference is the per-call support check
  frozen_15bands    FrozenDispatch.call(op, *args), 15 bands (bisect over 14 edges, as
                    the H200 manifest's unmerged tables have) — every band the same impl
  call_op_frozen    fltune.dispatch.call_op(op, *args) while frozen (module lookup + frozen)
  call_op           OpManager.call_op(op, *args), unfrozen: FL's run-time selection
                    (qualification context, policy-ordered cache, fallback loop)

for two implementations: ``noop`` (a Python function returning its argument — the pure
dispatch cost) and the real kernel the fixed FL order picks for ``silu_and_mul`` at 1 token
(bf16): on CPU vLLM's ``_C`` kernel, on CUDA FlagGems (or vLLM's, if FlagGems is absent).
On CUDA the calls are launched back to back and synchronized once per trial, so a call's
time is its host-side cost (launch included), which is what dispatch adds to.

Trials are interleaved (trial t runs every route once before trial t+1); the figure per
route is the median over trials of (trial time / calls), and the overhead is that minus
``direct``'s; the same from the fastest trial of each route (``overhead_min_ns``) is the
better estimate on a shared, busy machine, where the median carries the neighbours' noise. Prints a table and writes JSON (default ``benchmarks/results/<device>/
dispatch_overhead.json``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from fltune.store import device as devmod
from fltune.dispatch.frozen import (MANIFEST_FORMAT, FrozenDispatch, fingerprint_of,
                                   freeze_dispatch, thaw_dispatch)
from fltune.dispatch.manager import OpManager, get_default_manager
from fltune.dispatch.policy import SelectionPolicy
from fltune.dispatch.registry import OpRegistry
from fltune.dispatch.types import BackendImplKind, OpImpl, QualifyContext
from fltune.ops import DTYPE_NAMES, get_op

OP = "silu_and_mul"
INTERMEDIATE = 3584          # Qwen3.5-0.8B's MLP width
NOOP_ID = "bench.noop"


def _manifest(impl_id: str, dtype, trailing, n_bands: int) -> dict:
    his = [2 ** i for i in range(n_bands - 1)] + [2 ** (n_bands - 1)]
    bands = [{"lo": (his[i - 1] + 1) if i else 1, "hi": h, "impl_id": impl_id,
              "kind": "reference", "vendor": None, "callable": None, "median_us": None,
              "runner_up": None, "runner_up_us": None, "gap": None, "merged": 1}
             for i, h in enumerate(his)]
    m = {"format": MANIFEST_FORMAT, "device": {}, "driver": None, "stack": [], "policy": {},
         "band_rule": "synthetic (dispatch benchmark)", "source_db": None, "overrides": [],
         "ops": {OP: {"tables": [{"dtype": DTYPE_NAMES[dtype], "signature": "bench",
                                  "dims": {"intermediate": INTERMEDIATE},
                                  "trailing": list(trailing), "rows_per_token": 1, "weight": 1,
                                  "bands": bands}],
                      "shadowed": [], "fallback": impl_id, "native_everywhere": False}}}
    m["fingerprint"] = fingerprint_of(m)
    return m


def _routes(impl: OpImpl, registry: OpRegistry, args: list, device: str) -> dict:
    """name -> (no-argument call, manifest to freeze process-wide while timing it or None)."""
    from fltune.dispatch.manager import call_op

    x = args[0]
    m1 = _manifest(impl.impl_id, x.dtype, x.shape[1:], 1)
    m15 = _manifest(impl.impl_id, x.dtype, x.shape[1:], 15)
    fd1, fd15 = FrozenDispatch(m1, registry), FrozenDispatch(m15, registry)
    assert fd15.select(OP, *args) is impl and fd1.select(OP, *args) is impl
    mgr = OpManager(registry, SelectionPolicy())
    # the unfrozen manager must pick the same implementation, or the comparison is void
    ctx = QualifyContext(device, x.dtype, torch.cuda.get_device_capability() if device == "cuda"
                         else None)
    assert mgr.resolve(OP, ctx) is impl, (mgr.resolve(OP, ctx).impl_id, impl.impl_id)
    fn = impl.fn
    # the same candidate without its support declaration, in its own registry: what the
    # per-call ``supports`` check costs, measured side by side
    bare = OpRegistry()
    bare.register(dataclasses.replace(impl, supports=None))
    fd1_bare = FrozenDispatch(m1, bare)
    return {
        "direct": (lambda: fn(*args), None),
        "frozen_1band": (lambda: fd1.call(OP, *args), None),
        "frozen_1band_nocheck": (lambda: fd1_bare.call(OP, *args), None),
        "frozen_15bands": (lambda: fd15.call(OP, *args), None),
        "call_op_frozen": (lambda: call_op(OP, *args), m15),
        "call_op": (lambda: mgr.call_op(OP, *args), None),
    }


def _time(routes: dict, registry: OpRegistry, calls: int, trials: int, device: str) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(fn, manifest, n):
        if manifest is not None:
            freeze_dispatch(manifest, registry)
        try:
            sync()
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            sync()
            return time.perf_counter_ns() - t0
        finally:
            if manifest is not None:
                thaw_dispatch()

    for fn, manifest in routes.values():            # warm-up (first-call costs, caches)
        run(fn, manifest, 100)
    samples = {n: [] for n in routes}
    for _ in range(trials):                          # interleaved trials
        for name, (fn, manifest) in routes.items():
            samples[name].append(run(fn, manifest, calls) / calls)
    return samples


def noop_impl() -> OpImpl:
    def noop(x):
        return x
    return OpImpl(op_name=OP, impl_id=NOOP_ID, kind=BackendImplKind.REFERENCE, fn=noop,
                  priority=1000, backend="bench")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"],
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=2000, help="calls per trial")
    p.add_argument("--trials", type=int, default=31)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args(argv)
    dev = a.device
    dtype = torch.bfloat16
    spec = get_op(OP)
    args = spec.make_inputs(a.tokens, {"intermediate": INTERMEDIATE}, dtype, dev,
                            torch.Generator().manual_seed(0))
    full = get_default_manager().registry
    ctx = QualifyContext(dev, dtype, torch.cuda.get_device_capability() if dev == "cuda" else None)
    real = next(i for i in SelectionPolicy().order(OP, full.get_implementations(OP))
                if i.qualify(ctx) is None)
    results = []
    for label, impl in (("noop", noop_impl()), (f"real:{real.impl_id}", real)):
        reg = OpRegistry()
        reg.register(impl)
        routes = _routes(impl, reg, args, dev)
        samples = _time(routes, reg, a.calls, a.trials, dev)
        med = {n: statistics.median(s) for n, s in samples.items()}
        low = {n: min(s) for n, s in samples.items()}
        for n, s in samples.items():
            results.append({"impl": label, "route": n, "ns_per_call": med[n],
                            "min_ns": low[n], "p10_ns": sorted(s)[len(s) // 10],
                            "p90_ns": sorted(s)[(9 * len(s)) // 10],
                            "overhead_ns": med[n] - med["direct"],
                            "overhead_min_ns": low[n] - low["direct"]})
    me = devmod.current(dev)
    doc = {"format": "fltune.dispatch_overhead/1", "device": me, "op": OP,
           "dims": {"intermediate": INTERMEDIATE}, "tokens": a.tokens,
           "dtype": DTYPE_NAMES[dtype], "calls_per_trial": a.calls, "trials": a.trials,
           "torch_threads": torch.get_num_threads(),
           "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ},
           "loadavg_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "stack": devmod.stack(),
           "python": platform.python_version(), "command": " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
           "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "results": results}
    print(f"dispatch overhead on {devmod.label(me)}, {OP} bf16 x{a.tokens} token(s), "
          f"{a.trials} trials x {a.calls} calls, median ns per call:")
    print(f"  {'impl':<28} {'route':<16} {'ns/call':>10} {'overhead':>10} {'min':>10} "
          f"{'overhead(min)':>14}")
    for r in results:
        print(f"  {r['impl']:<28} {r['route']:<16} {r['ns_per_call']:>10.0f} "
              f"{r['overhead_ns']:>+10.0f} {r['min_ns']:>10.0f} {r['overhead_min_ns']:>+14.0f}")
    out = a.out or str(Path(__file__).resolve().parent / "results" / dev / "dispatch_overhead.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
