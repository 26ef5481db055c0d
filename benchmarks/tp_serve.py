"""Tensor parallelism through `fltune serve`: every rank loads the same manifest.

    python benchmarks/tp_serve.py --db DB --profile Qwen3-0.6B --tp 2 --out DIR

Starts `fltune serve --strict --db DB -- ... --tensor-parallel-size N` (dummy weights,
compiled, CUDA graphs) and, beside it, plain vLLM with the same arguments (plugin off: every
FLTUNE_* variable removed), sends both one greedy completions request, compares the token
ids, and reads the per-process counter files the plugin writes (``FLTUNE_COUNTERS_FILE``
with ``{pid}``): one per rank. Writes DIR/tp-<profile>.json with, per rank, the
fingerprint, the routed ops and the calls each implementation served, whether all ranks
agree, and whether the tokens equal vanilla's.
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


def server_cmd(model: str, port: int, a, db: str | None) -> list:
    """``fltune serve --strict --db DB -- ARGS`` (db given) or plain ``vllm serve`` ARGS."""
    args = ["--model", model, "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", "bfloat16", "--max-model-len", "1024", "--gpu-memory-utilization",
            str(a.gpu_mem), "--tensor-parallel-size", str(a.tp), "--host", "127.0.0.1",
            "--port", str(port), "--disable-log-stats", "--seed", "0"]
    if a.profile.startswith("Qwen3.5"):        # as e2e_ab.vllm_args (the stated GDN stand-in)
        args += ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0}),
                 "--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]
    args += a.vllm_arg
    if db is None:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server"] + args
    return [sys.executable, "-m", "fltune", "serve", "--strict", "--db", db, "--"] + args


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
    ap.add_argument("--route", help="FLTUNE_ROUTE for the fltune server (default: the "
                                    "plugin's own, auto)")
    ap.add_argument("--no-vanilla", action="store_true",
                    help="skip the plugin-off server the tokens are compared with")
    ap.add_argument("--sequential", action="store_true",
                    help="start the vanilla server, wait until it is ready, then fltune's "
                         "(each vLLM sizes itself from the device's free memory while it "
                         "profiles; two starting at once can disturb each other's sizing — "
                         "they did not on the H200 at --gpu-mem 0.12, session 8)")
    ap.add_argument("--vllm-arg", action="append", default=[])
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    model = os.path.abspath(a.model_dir) if a.model_dir else make_model_dir(a.profile)
    tag = f"tp{a.tp}-{a.profile}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("FLTUNE_", "VLLM_FL_"))}
    fl_env = dict(base, FLTUNE_COUNTERS_FILE=os.path.join(
        os.path.abspath(a.out), f"counters-{tag}-{{pid}}.json"), FLTUNE_COUNTERS_INTERVAL="1")
    if a.route:
        fl_env["FLTUNE_ROUTE"] = a.route
    # both servers at once (each TP=N over the same GPUs, a small memory share each):
    # one start's wall time instead of two
    arms = {f"tp{a.tp}": (server_cmd(model, a.port, a, a.db), fl_env, a.port)}
    if not a.no_vanilla:
        arms[f"tp{a.tp}-vanilla"] = (server_cmd(model, a.port + 1, a, None), base, a.port + 1)
    doc = {"profile": a.profile, "tp": a.tp, "route": a.route,
           "cmd": {n: c for n, (c, _, _) in arms.items()}}
    def start(n):
        c, e, _ = arms[n]
        return subprocess.Popen(c, env=e, stdout=open(log_path(a, n), "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
    name = f"tp{a.tp}"
    ports = {n: p for n, (_, _, p) in arms.items()}
    order = sorted(arms, key=lambda n: n == name)          # vanilla first
    procs = {}
    try:
        if a.sequential:
            ready, failed = {}, {}
            for n in order:
                procs[n] = start(n)
                r, f = wait_ready({n: procs[n]}, {n: ports[n]}, a.start_timeout, a)
                ready.update(r)
                failed.update(f)
        else:
            procs = {n: start(n) for n in order}
            ready, failed = wait_ready(procs, ports, a.start_timeout, a)
        doc["ready_s"], doc["failed"] = ready, failed
        if name in failed:
            why = failed[name].get("why") or f"exited with {failed[name]['returncode']}"
            raise SystemExit(f"TP server did not start ({why}); see {log_path(a, name)}")
        body = {"model": model, "prompt": prompts(4, 32), "max_tokens": 16,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        tokens = {}
        for n in ready:
            r = http(arms[n][2], "/v1/completions", body)
            tokens[n] = [c.get("token_ids") for c in sorted(r["choices"],
                                                            key=lambda c: c["index"])]
            doc.setdefault("completion_tokens", {})[n] = r["usage"]["completion_tokens"]
        doc["first_tokens"] = {n: [(t or [])[:8] for t in ts] for n, ts in tokens.items()}
        van = tokens.get(f"tp{a.tp}-vanilla")
        doc["tokens_equal_vanilla"] = (None if van is None or name not in tokens
                                       or any(t is None for t in van)
                                       else tokens[name] == van)
        time.sleep(3)                                # the counter files are rewritten each second
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        ranks = {}
        for f in sorted(glob.glob(os.path.join(a.out, f"counters-{tag}-*.json"))):
            with open(f) as fh:
                c = json.load(fh)
            ranks[os.path.basename(f)] = {k: c.get(k) for k in (
                "fingerprint", "model_key", "routed", "native_for_fusion", "layers",
                "counters", "additional_config", "compiled_with_inductor")}
            os.remove(f)
        doc["ranks"] = ranks
        # the processes that ran the model: those with routed calls (the API server and
        # engine core write a counters file too, with no calls)
        busy = {k: r for k, r in ranks.items() if any((r.get("counters") or {}).values())}
        # without calls (nothing routed), the ranks are the processes that ran vLLM's
        # load_model hook: those know the served model's key
        group = busy or {k: r for k, r in ranks.items() if r.get("model_key")}
        seen = {(r["fingerprint"], json.dumps(r.get("routed"), sort_keys=True))
                for r in group.values()}
        doc["ranks_with_calls"] = sorted(busy)
        doc["ranks_agree"] = len(group) >= a.tp and len(seen) == 1
        doc["log_tail"] = {n: [ln.rstrip() for ln in open(log_path(a, n), errors="replace")
                               if "fltune" in ln or "Error" in ln][-30:] for n in arms}
        with open(os.path.join(a.out, f"tp-{a.profile}.json"), "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps({k: doc.get(k) for k in ("ready_s", "completion_tokens", "ranks_agree",
                                              "ranks_with_calls", "tokens_equal_vanilla")}))
    print(json.dumps(doc["ranks"], indent=1)[:3000])


if __name__ == "__main__":
    main()
