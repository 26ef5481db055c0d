"""Where a vLLM step's host time goes: cProfile of one scenario in an in-process engine.

    FLTUNE_DB=... FLTUNE_ROUTE=ops:linear VLLM_ENABLE_V1_MULTIPROCESSING=0 \
      python benchmarks/host_profile.py --model Qwen3.5-0.8B --prompt-len 2048 --out DIR

Why: on the H200 (session 6) routing ``linear`` left prefill 2048's kernel time equal
(0.992) but made its wall 11.8 ms longer (35.2 -> 47.0 ms), and the seam's measured per-call
costs (benchmarks/seam_overhead.py) explain only part of it. Run once per arm (the arm is
this process's FLTUNE_* environment, as in ``fltune bench --e2e``) and compare the tables.
Writes ``host-profile-<tag>.txt`` (top functions by own time and by cumulative time) and
the raw ``.pstats``; prints the wall time of the timed runs.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen3.5-0.8B")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--output-len", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tag", default=os.environ.get("FLTUNE_ROUTE", "vanilla") or "vanilla")
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    import torch

    from fltune.evaluate.e2e import default_engine
    from fltune.evaluate.model_dir import config_of, model_dir
    from fltune.integrations.vllm.e2e_worker import prompts_for
    from vllm import LLM, SamplingParams

    mdir = model_dir(a.model, os.path.join(a.out, "model"))
    eng, _ = default_engine("cuda" if torch.cuda.is_available() else "cpu", config_of(mdir))
    t0 = time.perf_counter()
    llm = LLM(model=mdir, **eng)
    init_s = time.perf_counter() - t0
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    prompts = prompts_for(a.batch, a.prompt_len, vocab)
    sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True,
                        detokenize=False)

    def run():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(3):
        run()
    walls = [run() for _ in range(a.runs)]
    prof = cProfile.Profile()
    prof.enable()
    prof_wall = run()
    prof.disable()
    tag = a.tag.replace(":", "_").replace(",", "_")
    prof.dump_stats(os.path.join(a.out, f"host-profile-{tag}.pstats"))
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    buf.write(f"# {a.tag}: walls {[round(w * 1e3, 2) for w in walls]} ms, profiled "
              f"{prof_wall * 1e3:.2f} ms (cProfile inflates it), init {init_s:.0f} s\n")
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(60)
    with open(os.path.join(a.out, f"host-profile-{tag}.txt"), "w") as f:
        f.write(buf.getvalue())
    print(json.dumps({"tag": a.tag, "walls_ms": [round(w * 1e3, 3) for w in walls],
                      "profiled_ms": round(prof_wall * 1e3, 3), "init_s": round(init_s, 1)}))
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
