"""Serve a model config with dummy weights through vLLM with fltune's plugin, on the GPU.

    FLTUNE_MANIFEST=m.json python benchmarks/h200_serve.py --profile Qwen3.5-0.8B --out DIR

Offline ``LLM`` (the engine core and worker are separate processes, as in ``vllm serve``),
compiled with CUDA graphs (vLLM's defaults), greedy generation from token-id prompts. The
plugin loads through the ``vllm.general_plugins`` entry point in every process; its per-op
call counters (``FLTUNE_COUNTERS_FILE``) show which implementations really ran. Writes
DIR/serve-<profile>.json with timings, outputs and counters.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time

from fltune.evaluate.model_dir import model_dir


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="Qwen3.5-0.8B")
    ap.add_argument("--out", default="out")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no compile/graphs)")
    ap.add_argument("--no-plugin", action="store_true",
                    help="vanilla vLLM: unset FLTUNE_MANIFEST/FLTUNE_DB (the plugin then does nothing)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tag = a.profile + ("-eager" if a.eager else "") + ("-vanilla" if a.no_plugin else "")
    if a.no_plugin:
        os.environ.pop("FLTUNE_MANIFEST", None)
        os.environ.pop("FLTUNE_DB", None)
    os.environ.setdefault("FLTUNE_COUNTERS_FILE", os.path.abspath(
        os.path.join(a.out, f"counters-{tag}-{{pid}}.json")))
    os.environ.setdefault("FLTUNE_COUNTERS_INTERVAL", "1")
    from vllm import LLM, SamplingParams

    kw = {}
    if a.profile.startswith("Qwen3.5"):
        kw["additional_config"] = {"gdn_prefill_backend": "triton"}
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    t0 = time.time()
    llm = LLM(model=model_dir(a.profile), load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5, seed=0,
              enforce_eager=a.eager, **kw)
    init_s = time.time() - t0
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(16)]}
               for i in range(a.batch)]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sp)          # warm-up at the measured batch (first runs autotune)
    runs = []
    for _ in range(3):
        t0 = time.time()
        outs = llm.generate(prompts, sp)
        runs.append(time.time() - t0)
    gen_s = sorted(runs)[1]
    toks = [list(o.outputs[0].token_ids) for o in outs]
    time.sleep(3)                                      # let workers flush their counters
    counters = {}
    for f in glob.glob(os.path.join(a.out, f"counters-{tag}-*.json")):
        counters[os.path.basename(f)] = json.load(open(f))
    doc = {"profile": a.profile, "eager": a.eager, "manifest": os.environ.get("FLTUNE_MANIFEST"),
           "init_s": round(init_s, 1), "generate_s": round(gen_s, 3),
           "generate_runs_s": [round(r, 3) for r in runs], "batch": a.batch,
           "max_tokens": a.max_tokens,
           "output_tok_per_s": round(a.batch * a.max_tokens / gen_s, 1),
           "outputs_first_tokens": [t[:8] for t in toks], "counters": counters}
    with open(os.path.join(a.out, f"serve-{tag}.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: v for k, v in doc.items() if k != "counters"}, indent=1))
    print("counters:", json.dumps(counters, indent=1)[:4000])


if __name__ == "__main__":
    main()
