"""How often does Inductor's first-call autotune draw which launch configuration for an op,
and what does each draw cost at the sizes the model then runs?

    PYTHONPATH=/tmp/site:/tmp/vsite:$PWD python3 benchmarks/autotune_draw.py \
        --profile Qwen3.5-0.8B --op rms_norm_gated --draws 6 --out DIR

Why: session 26's Qwen3.5 run found the model's gated-norm kernel (``triton_per_fused_1``, a
persistent reduction over 128) launched with two configurations in one compile: 16 of 18
layers at XBLOCK 32 (4.6 µs per call at one token), 2 at XBLOCK 8 (1.6 µs); session 24's two
compiles had drawn XBLOCK 8 for all 18. vLLM compiles its graph with a dynamic token
dimension and runs it first at ``max_num_batched_tokens`` (8192 tokens, 131072 rows for the
gated norm), where Inductor benchmarks the kernel's configurations once and keeps the
fastest; if two are near-equal there, the pick is noise, and decode then runs whichever won.
``native.vllm`` is compiled the same way (first call at 8192 tokens), so it draws too.

Each draw is a fresh process with a fresh Inductor cache (``TORCHINDUCTOR_CACHE_DIR``: the
autotune's ``.best_config`` and the FX graph are cached there, and would decide every later
draw); the Triton binary cache is shared (it keeps compiled kernels, not decisions). In each
draw the candidate is built as the race builds it (``native.vllm`` traces and autotunes at
8192 tokens, whatever sizes are asked), then profiled at every size given, in the order
given: the launch (grid, block) and µs per call. Inductor's own log of the autotune (every
configuration's time at the first call: up to 200 lines) is kept. A draw that fails or
outlasts ``--timeout`` is recorded as an error; the JSON is written after every draw.

Writes DIR/autotune-draw-<profile>-<op>.json and prints one line per draw and a summary per
configuration drawn.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(profile: str, op: str, sizes: list, n: int) -> dict:
    """One draw, in this process: the op's native.vllm candidate built and profiled."""
    import torch
    from fltune.dispatch.discovery import discover
    from fltune.dispatch.registry import OpRegistry
    from fltune.ops import OPS, dtype_from_name, workload_dims
    from fltune.tune.workload import derive
    from native_in_model import profile_calls

    lines: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    tuner_log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
    tuner_log.setLevel(logging.DEBUG)
    tuner_log.addHandler(Keep())
    reg = OpRegistry()
    discover(reg)
    item = next(i for i in derive(profile).items if i.op == op)
    spec, impl = OPS[op], reg.get(op, "native.vllm")
    out = {"signature": item.signature, "sizes": {}}
    with workload_dims(item.dims):
        for tokens in sizes:
            gen = torch.Generator().manual_seed(0)
            args = spec.make_inputs(tokens, item.dims_dict, dtype_from_name(item.dtype),
                                    "cuda", gen)
            kernels, launches = profile_calls(lambda: impl.fn(*args), n=n, warmup=3)
            out["sizes"][str(tokens)] = {"kernels": kernels, "launches": launches}
    out["autotune_log"] = [ln for ln in lines if "Benchmark" in ln or "nreg" in ln
                           or "XBLOCK" in ln][:200]
    return out


def config_of(launches: dict) -> str:
    """A draw's configuration as its launch keys (grid and block) at one size."""
    return " + ".join(sorted(k.split(" ", 1)[1] if " " in k else k for k in launches))


def summarise(draws: list, sizes: list) -> list:
    """Per configuration drawn (named by its launch at the first size given, ``sizes[0]``):
    how many draws drew it and the median µs per call at every size across those draws."""
    groups: dict = {}
    for d in draws:
        if "sizes" not in d:
            continue
        key = config_of(d["sizes"][str(sizes[0])]["launches"])
        groups.setdefault(key, []).append(d)
    out = []
    for key, ds in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        us = {str(t): round(statistics.median(sum(v[1] for v in d["sizes"][str(t)]["kernels"]
                                                  .values()) for d in ds), 3)
              for t in sizes}
        out.append({"launch_at_smallest": key, "draws": len(ds), "us_per_call": us})
        # (key name kept for the files already written: it is the launch at sizes[0])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="Qwen3.5-0.8B")
    ap.add_argument("--op", default="rms_norm_gated")
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--sizes", default="1,16,64,2048,8192",
                    help="token counts, comma-separated, profiled in this order (the "
                         "summary names a draw by its launch at the first)")
    ap.add_argument("--timeout", type=float, default=480.0,
                    help="seconds one draw may take (a device call has 600)")
    ap.add_argument("--n", type=int, default=20, help="calls profiled per size")
    ap.add_argument("--out", default=".")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.child:
        print("DRAW " + json.dumps(child(a.profile, a.op, sizes, a.n)), flush=True)
        return
    draws = []
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"autotune-draw-{a.profile}-{a.op}.json")

    def write(summary=None):
        doc = {"profile": a.profile, "op": a.op, "sizes": sizes, "command": " ".join(sys.argv),
               "draws": draws, "summary": summary if summary is not None
               else summarise(draws, sizes)}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)

    for k in range(a.draws):
        with tempfile.TemporaryDirectory(prefix="draw-inductor-") as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            try:
                p = subprocess.run([sys.executable, __file__, "--child", "--profile",
                                    a.profile, "--op", a.op, "--sizes", a.sizes,
                                    "--n", str(a.n)],
                                   env=env, capture_output=True, text=True, timeout=a.timeout)
                found = [ln for ln in p.stdout.splitlines() if ln.startswith("DRAW ")]
                d = (json.loads(found[-1][5:]) if not p.returncode and found else
                     {"error": f"rc={p.returncode}: {p.stderr[-600:]}"})
            except subprocess.TimeoutExpired:
                d = {"error": f"no result within {a.timeout:.0f} s"}
        draws.append(d)
        write()             # a call cut at its limit keeps the draws made
        if "sizes" in d:
            print(f"draw {k}: " + "  ".join(
                f"{t}: {config_of(d['sizes'][str(t)]['launches'])} "
                f"{sum(v[1] for v in d['sizes'][str(t)]['kernels'].values()):.3f} µs"
                for t in sizes), flush=True)
        else:
            print(f"draw {k}: {d['error']}", flush=True)
    summary = summarise(draws, sizes)
    for s in summary:
        print(f"{s['draws']} of {len(draws)} draws: {s['launch_at_smallest']} at {sizes[0]} "
              f"token(s); µs per call {s['us_per_call']}", flush=True)
    write(summary)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
