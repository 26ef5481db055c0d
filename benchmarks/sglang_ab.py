"""SGLang against itself and against fltune, with the in-context instrument's method (issue 13).

    [FLTUNE_MANIFEST=m.json] python benchmarks/sglang_ab.py --out DIR \
        [--arm off=off --arm aa=off --arm auto=auto --arm on=all] [--reps 10] [--warmup 2]

What ``fltune bench --e2e`` does for vLLM (fltune/evaluate/e2e.py), done here for SGLang:
every arm is one persistent offline ``sglang.Engine`` in its own worker process (its
scheduler a process below it, as in ``sglang serve``), started one after another and kept
up; the fixed scenarios (decode at batch 1 and 16 with fixed output lengths, a prefill of
2048 tokens) run with the arms alternated and the order rotated every repetition; warm-up
repetitions are excluded; per scenario and arm the ratio to ``off`` (vanilla SGLang) is
paired by repetition (off's time / the arm's time, > 1 = faster) and summarised by the
median and the same 95 % bootstrap interval (``e2e.bootstrap_ci``). An ``aa`` arm (a
second vanilla engine) states the noise before any effect is read.

Arm spec ``NAME=ROUTE``: ``off`` strips every FLTUNE_* variable (vanilla SGLang, fltune's
plugin inert); otherwise FLTUNE_ROUTE=ROUTE (``auto``, ``all``, ``ops:a,b``) over the
manifest in FLTUNE_MANIFEST. All arms get the same engine arguments (``--attention-backend``
triton by default: the staged sglang-kernel has no FA3; the radix cache off, so a repeated
prefill is a prefill). Each worker also returns the greedy tokens of one fixed prompt set
(compared with ``off``) and its model process's counters (which implementation served
which op, by band).

Host placement as the vLLM instrument's (``--pinning``, fltune/evaluate/pinning.py): every
arm's process tree on one core set (``shared``), or the measured arm moved onto the fastest
few cores for each call and the rest parked (``measure``); recorded in the JSON's ``host``.

What it does not have, unlike the vLLM instrument: the GPU kernel time per step (SGLang's
model runs in its scheduler process, out of a profiler in the worker). The timed unit is a
whole ``generate`` call (a decode scenario's time includes its one short prefill).

Writes DIR/sglang-ab.json (every sample, per-arm info, the points) and prints the table.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from fltune.evaluate.pinning import MODES as PINNING_MODES

SCENARIOS = {  # name: (batch, prompt tokens, output tokens)
    "decode_b1": (1, 16, 64),
    "decode_b16": (16, 16, 64),
    "prefill_2048": (1, 2048, 1),
    "cpu_decode_b2": (2, 8, 8),          # --device cpu (a smoke run of this script)
    "cpu_prefill_64": (1, 64, 1),
}
TOKENS_CHECK = (8, 16, 32)


def graph_bs_kwargs(max_bs: int) -> dict:
    """The largest decode batch SGLang captures, under the installed version's name:
    ``cuda_graph_max_bs_decode`` (0.5.17 on the H200, 0.5.21 here: ``cuda_graph_max_bs``,
    which the first version of this script passed, was refused on the H200, 2026-12-01) or
    the older ``cuda_graph_max_bs``; {} where neither exists (SGLang's default). ServerArgs
    is a dataclass in 0.5.17 and a msgspec Struct in 0.5.21."""
    from sglang.srt.server_args import ServerArgs

    fields = (getattr(ServerArgs, "__dataclass_fields__", None)
              or getattr(ServerArgs, "__struct_fields__", ()))
    for name in ("cuda_graph_max_bs_decode", "cuda_graph_max_bs"):
        if name in fields:
            return {name: max_bs}
    return {}


def prompts(batch: int, length: int, salt: int = 0) -> list:
    return [[5 + (i * 7 + j * 3 + salt) % 1000 for j in range(length)] for i in range(batch)]


# ---- worker -----------------------------------------------------------------------------

def worker(a) -> None:
    # replies go on the original stdout; everything else (SGLang's processes too) on stderr
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    out = os.fdopen(reply_fd, "w", buffering=1)
    tag = a.arm_name
    import sglang as sgl

    from fltune.evaluate.model_dir import model_dir

    if a.device == "cpu":     # as tests/test_sglang.py runs SGLang on CPU
        kw = dict(device="cpu", attention_backend="torch_native", context_length=256,
                  max_running_requests=4, chunked_prefill_size=128, disable_cuda_graph=True)
    else:
        kw = dict(context_length=4096, attention_backend=a.attention_backend,
                  **graph_bs_kwargs(16))
    t0 = time.time()
    llm = sgl.Engine(model_path=model_dir(a.profile), load_format="dummy",
                     skip_tokenizer_init=True, dtype="bfloat16",
                     mem_fraction_static=a.mem_fraction, random_seed=0,
                     disable_radix_cache=True, enable_torch_compile=a.torch_compile,
                     log_level="warning", **kw)
    out.write(json.dumps({"ok": True, "start_s": round(time.time() - t0, 1)}) + "\n")
    from fltune.integrations.vllm.e2e_worker import gated_runs, host_probe_us
    floor = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "run":
            b, p, o = SCENARIOS[cmd["scenario"]]
            sp = {"temperature": 0.0, "max_new_tokens": o, "ignore_eos": True}
            ids = prompts(b, p, cmd.get("salt", 0))

            def run():
                t0 = time.perf_counter()
                llm.generate(input_ids=ids, sampling_params=sp)
                return time.perf_counter() - t0
            # the instrument's probe gate (fltune bench --e2e --probe-gate): the call is
            # taken while the host runs at speed, again if a slow period hit it
            [(s, probes)], floor, account = gated_runs(run, host_probe_us, 1,
                                                        a.probe_gate or None, floor)
            out.write(json.dumps({"s": s, "probe_us": probes, "gate": account}) + "\n")
        elif cmd["cmd"] == "tokens":
            b, p, o = TOKENS_CHECK
            res = llm.generate(input_ids=prompts(b, p),
                               sampling_params={"temperature": 0.0, "max_new_tokens": o,
                                                "ignore_eos": True})
            out.write(json.dumps({"tokens": [list(r["output_ids"]) for r in res]}) + "\n")
        elif cmd["cmd"] == "quit":
            time.sleep(1.5)          # the model process rewrites its counters every 0.5 s
            llm.shutdown()
            counters = {}
            for f in glob.glob(os.path.join(a.workdir, f"counters-{tag}-*.json")):
                counters[os.path.basename(f)] = json.load(open(f))
            out.write(json.dumps({"counters": counters}) + "\n")
            return


# ---- driver -----------------------------------------------------------------------------

class Arm:
    def __init__(self, name, route, a, cores=None):
        self.name, self.route = name, route
        env = {k: v for k, v in os.environ.items()
               if not (route == "off" and k.startswith("FLTUNE_"))}
        if route != "off":
            env["FLTUNE_ROUTE"] = route
            env["FLTUNE_COUNTERS_FILE"] = os.path.join(a.workdir, f"counters-{name}-{{pid}}.json")
            env["FLTUNE_COUNTERS_INTERVAL"] = "0.5"
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--arm-name", name,
               "--profile", a.profile, "--workdir", a.workdir, "--mem-fraction",
               str(a.mem_fraction), "--attention-backend", a.attention_backend,
               "--device", a.device, "--probe-gate", str(a.probe_gate)]
        if a.torch_compile:
            cmd.append("--torch-compile")
        self.log = open(os.path.join(a.workdir, f"worker-{name}.log"), "w")
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, bufsize=1,
                                  preexec_fn=(lambda: os.sched_setaffinity(0, cores))
                                  if cores else None)

    def reply(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"arm {self.name}: the worker died (see worker-{self.name}.log)")
        return json.loads(line)

    def call(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        return self.reply()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm-name", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default="Qwen3-0.6B")
    ap.add_argument("--arm", action="append", default=[], help="NAME=ROUTE (off, auto, all, ops:..)")
    ap.add_argument("--scenarios", default=None,
                    help="comma list; default: the cpu_* smoke scenarios with --device cpu, "
                         "the others on a GPU")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mem-fraction", type=float, default=0.18)
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--torch-compile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    ap.add_argument("--pinning", default="shared", choices=PINNING_MODES,
                    help="where the arms' host work runs, as `fltune bench --e2e --pinning` "
                         "(fltune/evaluate/pinning.py; not on --device cpu)")
    ap.add_argument("--probe-gate", type=float, default=None,
                    help="as `fltune bench --e2e --probe-gate` (default 1.25 on cuda, 0 = off "
                         "on cpu)")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    if a.probe_gate is None:
        from fltune.evaluate.e2e import DEFAULT_PROBE_GATE
        a.probe_gate = DEFAULT_PROBE_GATE if a.device != "cpu" else 0.0
    if a.probe_gate and not a.probe_gate > 1:
        ap.error(f"--probe-gate: 0 (off) or a factor above 1, got {a.probe_gate}")
    if a.worker:
        return worker(a)
    from fltune.evaluate.e2e import bootstrap_ci
    from fltune.evaluate.pinning import measuring, plan_pinning

    os.makedirs(a.out, exist_ok=True)
    a.workdir = os.path.abspath(a.out)
    specs = [s.split("=", 1) for s in (a.arm or ["off=off", "aa=off", "auto=auto"])]
    if specs[0][1] != "off":
        sys.exit("the first arm is the baseline and must be vanilla (NAME=off)")
    scen = (a.scenarios.split(",") if a.scenarios else   # 2026-12-01: the cpu_* ones ran on the H200
            [s for s in SCENARIOS if s.startswith("cpu_") == (a.device == "cpu")])
    arms, info = [], {}
    # SGLang's idle schedulers busy-poll; with "measure" they spin on the park set while the
    # measured arm (launcher, scheduler, detokenizer) has the measurement cores
    pin = plan_pinning(a.pinning) if a.device != "cpu" else None
    for name, route in specs:                 # one after another: each sizes its KV pool
        t0 = time.time()
        arm = Arm(name, route, a, set(pin.start) if pin else None)
        try:
            r = arm.reply()
            arms.append(arm)
            info[name] = {"route": route, "start_s": r["start_s"]}
        except Exception as e:                # noqa: BLE001 (recorded, the arm left out)
            info[name] = {"route": route, "error": str(e), "after_s": round(time.time() - t0)}
        print(name, info[name], flush=True)
    base = specs[0][0]
    toks = {arm.name: arm.call(cmd="tokens")["tokens"] for arm in arms}
    for arm in arms:
        info[arm.name]["tokens_equal_baseline"] = toks[arm.name] == toks.get(base)
    samples = []
    for r in range(a.warmup + a.reps):
        for sc in scen:
            k = r % len(arms)
            for arm in arms[k:] + arms[:k]:
                with measuring(pin, arm.p.pid):
                    res = arm.call(cmd="run", scenario=sc, salt=r)
                if r >= a.warmup:
                    samples.append({"rep": r - a.warmup, "scenario": sc, "arm": arm.name,
                                    "s": res["s"], "probe_us": res["probe_us"],
                                    "gate": res["gate"]})
        print(f"rep {r + 1}/{a.warmup + a.reps}", flush=True)
    for arm in arms:
        info[arm.name]["counters"] = arm.call(cmd="quit")["counters"]
        arm.p.wait(timeout=120)
    points = []
    for sc in scen:
        t = {(x["arm"], x["rep"]): x["s"] for x in samples if x["scenario"] == sc}
        for arm in arms:
            if arm.name == base:
                continue
            ratios = [t[(base, r)] / t[(arm.name, r)] for r in range(a.reps)
                      if (base, r) in t and (arm.name, r) in t]
            med, lo, hi = bootstrap_ci(ratios)
            bs = sorted(t[(base, r)] for r in range(a.reps) if (base, r) in t)
            points.append({"scenario": sc, "arm": arm.name, "n": len(ratios),
                           "ratio_median": med, "ci_low": lo, "ci_high": hi,
                           "baseline_median_s": bs[len(bs) // 2] if bs else None})
    import sglang
    import torch
    doc = {"profile": a.profile, "sglang": sglang.__version__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
           "torch_compile": a.torch_compile, "attention_backend": a.attention_backend,
           "scenarios": {s: dict(zip(("batch", "prompt", "output"), SCENARIOS[s])) for s in scen},
           "reps": a.reps, "warmup": a.warmup, "arms": info, "points": points,
           "host": {"pinning": pin.describe() if pin else {"mode": "off"},
                    "probe_gate": a.probe_gate or None},
           "samples": samples}
    with open(os.path.join(a.out, "sglang-ab.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'scenario':14} {'arm':6} {'ratio':>7}  95% CI")
    for p in points:
        print(f"{p['scenario']:14} {p['arm']:6} {p['ratio_median']:7.3f}  "
              f"[{p['ci_low']:.3f}, {p['ci_high']:.3f}]  (n={p['n']})")
    for name, i in info.items():
        print(name, {k: v for k, v in i.items() if k != "counters"})


if __name__ == "__main__":
    main()
