"""Tensor parallelism through `fltune serve`: every rank loads the same manifest.

    python benchmarks/tp_serve.py --db DB --profile Qwen3-0.6B --tp 2 --out DIR

Starts `fltune serve --strict --db DB -- ... --tensor-parallel-size N` (dummy weights,
compiled, CUDA graphs), sends one completions request, and reads the per-process counter
files the plugin writes (``FLTUNE_COUNTERS_FILE`` with ``{pid}``): one per rank. Writes
DIR/tp-<profile>.json with, per rank, the fingerprint, the routed ops and the calls each
implementation served, and whether all ranks agree.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from e2e_ab import http, log_path, prompts, wait_ready  # noqa: E402
from h200_serve import model_dir as make_model_dir  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--profile", default="Qwen3-0.6B")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default="out")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--gpu-mem", type=float, default=0.12)
    ap.add_argument("--start-timeout", type=float, default=420)
    ap.add_argument("--model-dir", help="serve this HF config directory instead of --profile's")
    ap.add_argument("--vllm-arg", action="append", default=[])
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = os.path.abspath(a.model_dir) if a.model_dir else make_model_dir(a.profile)
    tag = f"tp{a.tp}-{a.profile}"
    env = dict(os.environ, FLTUNE_COUNTERS_FILE=os.path.join(
        os.path.abspath(a.out), f"counters-{tag}-{{pid}}.json"), FLTUNE_COUNTERS_INTERVAL="1")
    cmd = [sys.executable, "-m", "fltune", "serve", "--strict", "--db", a.db, "--",
           "--model", model, "--load-format", "dummy", "--skip-tokenizer-init",
           "--dtype", "bfloat16", "--max-model-len", "1024", "--gpu-memory-utilization",
           str(a.gpu_mem), "--tensor-parallel-size", str(a.tp), "--host", "127.0.0.1",
           "--port", str(a.port), "--disable-log-stats", "--seed", "0"] + a.vllm_arg
    name = f"tp{a.tp}"
    log = log_path(a, name)
    doc = {"profile": a.profile, "tp": a.tp, "cmd": cmd}
    p = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                         start_new_session=True)
    try:
        ready, failed = wait_ready({name: p}, {name: a.port}, a.start_timeout, a)
        if failed:
            doc["failed"] = failed[name]
            why = failed[name].get("why") or f"exited with {failed[name]['returncode']}"
            raise SystemExit(f"TP server did not start ({why}); see {log}")
        doc["ready_s"] = ready[name]
        body = {"model": model, "prompt": prompts(4, 32), "max_tokens": 16,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        r = http(a.port, "/v1/completions", body)
        doc["completion_tokens"] = r["usage"]["completion_tokens"]
        doc["first_tokens"] = [(c.get("token_ids") or [])[:8] for c in r["choices"]]
        time.sleep(3)                                # the counter files are rewritten each second
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        ranks = {}
        for f in sorted(glob.glob(os.path.join(a.out, f"counters-{tag}-*.json"))):
            with open(f) as fh:
                c = json.load(fh)
            ranks[os.path.basename(f)] = {k: c.get(k) for k in (
                "fingerprint", "routed", "native_for_fusion", "layers", "counters",
                "additional_config", "compiled_with_inductor")}
            os.remove(f)
        doc["ranks"] = ranks
        seen = {(r["fingerprint"], json.dumps(r.get("routed"), sort_keys=True))
                for r in ranks.values()}
        doc["ranks_agree"] = len(ranks) >= a.tp and len(seen) == 1
        doc["log_tail"] = [ln.rstrip() for ln in open(log, errors="replace")
                           if "fltune" in ln or "Error" in ln][-30:]
        with open(os.path.join(a.out, f"tp-{a.profile}.json"), "w") as f:
            json.dump(doc, f, indent=1)
        if doc.get("completion_tokens"):
            os.remove(log)          # kept when the run failed: the error message names it
    print(json.dumps({k: doc.get(k) for k in ("ready_s", "completion_tokens", "ranks_agree")}))
    print(json.dumps(doc["ranks"], indent=1)[:3000])


if __name__ == "__main__":
    main()
