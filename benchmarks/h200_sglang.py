"""One arm of the SGLang A/B on the GPU: a model config with dummy weights served by an offline
``sglang.Engine`` (its scheduler is a separate process, as in ``sglang serve``), greedy
generation from token-id prompts, fltune's plugin loaded through SGLang's
``sglang.srt.plugins`` entry point in every process.

    FLTUNE_MANIFEST=m.json FLTUNE_ROUTE=all python benchmarks/h200_sglang.py --arm on --out DIR
    python benchmarks/h200_sglang.py --arm off --out DIR      # every FLTUNE_* variable removed

Writes DIR/sglang-<profile>-<arm>.json: timings (engine start; generate: one warm-up, then
``--reps`` timed calls, median), the greedy tokens of every prompt, and the model process's
counters (``FLTUNE_COUNTERS_FILE``: which implementation served which op, by band). Why an
offline engine and not the in-context instrument (benchmarks/e2e_ab.py): that instrument
drives vLLM's server; this script's timings are a plain wall-clock A/B of whole generate
calls, arms run one after the other (benchmarks/h200_sglang.sh alternates them).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="Qwen3-0.6B")
    ap.add_argument("--arm", required=True, help="a label; 'off' or 'off-...' removes every FLTUNE_* variable")
    ap.add_argument("--out", default="out")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--attention-backend", default="triton",
                    help="the same on every arm; triton needs no FA3 (scripts/stage-sglang.sh "
                         "stages sglang-kernel without it) and no FlashInfer JIT")
    ap.add_argument("--torch-compile", action="store_true", help="--enable-torch-compile")
    ap.add_argument("--device", default=None, help="SGLang's --device (default: its own pick)")
    ap.add_argument("--mem-fraction", type=float, default=0.5)
    ap.add_argument("--context-length", type=int, default=1024)
    ap.add_argument("--cuda-graph-max-bs", type=int, default=16,
                    help="capture only what the batch needs: each engine starts faster")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tag = f"{os.path.basename(os.path.normpath(a.profile))}-{a.arm}"
    if a.arm.split("-")[0] == "off":     # off, off-compiled: plugin inert
        for k in [k for k in os.environ if k.startswith("FLTUNE_")]:
            del os.environ[k]
    else:
        os.environ.setdefault("FLTUNE_COUNTERS_FILE", os.path.abspath(
            os.path.join(a.out, f"counters-sglang-{tag}-{{pid}}.json")))
        os.environ.setdefault("FLTUNE_COUNTERS_INTERVAL", "0.5")
    import sglang as sgl

    from sglang_ab import graph_bs_kwargs     # this folder (the script's own, on sys.path)

    from fltune.evaluate.model_dir import model_dir

    t0 = time.time()
    llm = sgl.Engine(model_path=model_dir(a.profile), load_format="dummy",
                     skip_tokenizer_init=True, dtype="bfloat16", context_length=a.context_length,
                     mem_fraction_static=a.mem_fraction, random_seed=0,
                     **({"device": a.device} if a.device else
                        graph_bs_kwargs(max(a.cuda_graph_max_bs, a.batch))),
                     attention_backend=a.attention_backend,
                     enable_torch_compile=a.torch_compile, log_level="warning")
    init_s = time.time() - t0
    prompts = [[5 + (i * 7 + j) % 200 for j in range(16)] for i in range(a.batch)]
    sp = {"temperature": 0.0, "max_new_tokens": a.max_tokens, "ignore_eos": True}
    llm.generate(input_ids=prompts, sampling_params=sp)        # warm-up
    runs = []
    for _ in range(a.reps):
        t0 = time.time()
        outs = llm.generate(input_ids=prompts, sampling_params=sp)
        runs.append(time.time() - t0)
    gen_s = sorted(runs)[len(runs) // 2]
    toks = [list(o["output_ids"]) for o in outs]
    time.sleep(2)               # the model process rewrites its counters every 0.5 s;
    llm.shutdown()              # SGLang's shutdown kills it without atexit
    counters = {}
    for f in glob.glob(os.path.join(a.out, f"counters-sglang-{tag}-*.json")):
        counters[os.path.basename(f)] = json.load(open(f))
        os.remove(f)            # kept in this arm's JSON (fewer files come back from $OUT)
    import sglang
    import torch

    doc = {"profile": a.profile, "arm": a.arm, "sglang": sglang.__version__,
           "torch": torch.__version__, "attention_backend": a.attention_backend,
           "torch_compile": a.torch_compile,
           "env": {k: v for k, v in os.environ.items() if k.startswith("FLTUNE_")},
           "init_s": round(init_s, 1), "generate_s": round(gen_s, 4),
           "generate_runs_s": [round(r, 4) for r in runs], "batch": a.batch,
           "max_tokens": a.max_tokens, "output_tok_per_s": round(a.batch * a.max_tokens / gen_s, 1),
           "tokens": toks, "counters": counters}
    with open(os.path.join(a.out, f"sglang-{tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k not in ("counters", "tokens")}, indent=1))
    for name, rec in counters.items():
        print(name, json.dumps({"counters": rec.get("counters"), "layers": rec.get("layers"),
                                "routed_without_layer": rec.get("routed_without_layer"),
                                "rerouted": rec.get("rerouted")}, indent=1))


if __name__ == "__main__":
    main()
