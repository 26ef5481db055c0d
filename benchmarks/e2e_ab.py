"""End-to-end A/B: real OpenAI servers side by side, measured interleaved.

    python benchmarks/e2e_ab.py --profile Qwen3-0.6B --out DIR \
        --arm vanilla --arm fl=fl.json:all --arm calibrated=m.json:auto

Each arm is one server process on 127.0.0.1, started one after another (``--concurrent-start``:
all at once) and alive together:
``vanilla`` is vLLM's own server with no fltune (its default compile, custom ops off);
``NAME=MANIFEST:ROUTE`` is ``fltune serve --manifest MANIFEST`` (``--db`` for a ``.db``) with
``FLTUNE_ROUTE=ROUTE``
(``all``: every op the manifest routes; ``auto``: only where the win beats the fusion it
gives up). Then, for each repetition and each batch size, every arm serves the same
request in turn, the arm order rotating between repetitions, so drift of the machine
(clocks, other tenants) lands on all arms alike. A request is one completions call whose
``prompt`` is a list of ``batch`` token-id prompts, ``max_tokens`` output tokens each,
greedy, ``ignore_eos``: output throughput = generated tokens / wall time of the call.

Why servers and not the offline ``LLM`` API: this is what users run (``fltune serve``), and
several engines can stay up at once only as separate processes; one engine per arm alive
for the whole run is what lets the measurements interleave.

Writes DIR/e2e-<profile>.json: every sample, the median per (arm, batch), the ratio of
each arm to vanilla, whether greedy outputs match vanilla's, and each fltune arm's per-op
call counters (from ``FLTUNE_COUNTERS_FILE``) and startup log tail.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_arm(text: str) -> dict:
    if text == "vanilla":
        return {"name": "vanilla", "manifest": None, "route": None}
    name, _, rest = text.partition("=")
    manifest, _, route = rest.rpartition(":")
    if not name or not manifest or route not in ("auto", "all"):
        raise SystemExit(f"--arm {text!r}: expected 'vanilla' or NAME=MANIFEST:auto|all")
    return {"name": name, "manifest": os.path.abspath(manifest), "route": route}


def vllm_args(model_dir: str, profile: str, port: int, a) -> list:
    args = ["--model", model_dir, "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", a.dtype, "--max-model-len", str(a.max_model_len),
            "--gpu-memory-utilization", str(a.gpu_mem), "--seed", "0",
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs",
            str(max(a.batches)), "--disable-log-stats"]
    if profile.startswith("Qwen3.5"):
        args += ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0}),
                 "--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]
    return args + a.vllm_arg


def start(arm: dict, model_dir: str, port: int, a) -> subprocess.Popen:
    env = dict(os.environ)
    for k in ("FLTUNE_MANIFEST", "FLTUNE_DB", "FLTUNE_STRICT", "FLTUNE_ROUTE"):
        env.pop(k, None)
    args = vllm_args(model_dir, a.profile, port, a)
    if arm["manifest"] is None:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"] + args
    else:
        env["FLTUNE_ROUTE"] = arm["route"]
        env["FLTUNE_COUNTERS_FILE"] = os.path.join(
            os.path.abspath(a.out), f"counters-{a.profile}-{arm['name']}-{{pid}}.json")
        env["FLTUNE_COUNTERS_INTERVAL"] = "2"
        # a calibration DB is frozen for this device by `fltune serve --db` itself
        flag = "--db" if arm["manifest"].endswith(".db") else "--manifest"
        cmd = [sys.executable, "-m", "fltune", "serve", "--strict", flag,
               arm["manifest"], "--"] + args
    log = open(log_path(a, arm["name"]), "w")
    arm["cmd"] = cmd
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def http(port: int, path: str, body=None, timeout=600):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null") if path != "/health" else r.status


def log_path(a, name: str) -> str:
    return os.path.join(a.out, f"server-{a.profile}-{name}.log")


def error_tail(path: str, n: int = 40) -> list:
    """The lines of a server log that say why it died (tracebacks' last lines, errors)."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if not ln.startswith("frame #")]
    except OSError:
        return []
    keep = [ln for ln in lines if "Error" in ln or "error" in ln or "Traceback" in ln
            or "raise " in ln or "fltune" in ln]
    return keep[-n:] + ["--- last lines ---"] + lines[-15:]


def wait_ready(procs: dict, ports: dict, timeout: float, a) -> tuple:
    """Waits for every server; one that dies is recorded (with why) and the others go on:
    an arm that cannot start is a result too."""
    t0, ready, failed = time.time(), {}, {}
    while len(ready) + len(failed) < len(procs) and time.time() - t0 < timeout:
        for name, p in procs.items():
            if name in ready or name in failed:
                continue
            if p.poll() is not None:
                failed[name] = {"returncode": p.returncode,
                                "log_tail": error_tail(log_path(a, name))}
                print(f"  {name} EXITED with {p.returncode} during start:", flush=True)
                print("    " + "\n    ".join(failed[name]["log_tail"][-25:]), flush=True)
                continue
            try:
                if http(ports[name], "/health", timeout=2) == 200:
                    ready[name] = round(time.time() - t0, 1)
                    print(f"  {name} ready after {ready[name]} s", flush=True)
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
        time.sleep(2)
    for name in procs:
        if name not in ready and name not in failed:
            failed[name] = {"returncode": None, "log_tail": error_tail(log_path(a, name)),
                            "why": f"not ready after {timeout} s"}
    return ready, failed


def prompts(batch: int, length: int) -> list:
    return [[5 + (i * 7 + j) % 200 for j in range(length)] for i in range(batch)]


def one_request(port: int, model: str, batch: int, a) -> tuple:
    body = {"model": model, "prompt": prompts(batch, a.prompt_len), "max_tokens": a.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    r = http(port, "/v1/completions", body)
    dt = time.perf_counter() - t0
    toks = r["usage"]["completion_tokens"]
    outs = [list(c.get("token_ids") or []) for c in sorted(r["choices"], key=lambda c: c["index"])]
    return toks / dt, toks, dt, outs


def outputs_digest(outs: list) -> dict:
    """What the token comparison rests on, kept in the JSON so it can be audited: how many
    prompts returned their full token ids, and a hash of all of them."""
    import hashlib

    return {"prompts": len(outs), "lengths": sorted({len(o) for o in outs}),
            "sha256": hashlib.sha256(json.dumps(outs).encode()).hexdigest()[:16]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="Qwen3-0.6B")
    ap.add_argument("--model-dir", help="serve this HF config directory instead of one made "
                                        "from --profile (which then only names the outputs)")
    ap.add_argument("--arm", action="append", required=True, type=parse_arm)
    ap.add_argument("--out", default="out")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpu-mem", type=float, default=0.2)
    ap.add_argument("--base-port", type=int, default=8100)
    ap.add_argument("--start-timeout", type=float, default=480,
                    help="seconds each server (all of them, with --concurrent-start) may take")
    ap.add_argument("--concurrent-start", action="store_true",
                    help="start every server at once (faster, but their KV-cache sizing races)")
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="one more argument for every server (repeatable)")
    a = ap.parse_args()
    a.batches = [int(b) for b in a.batches.split(",")]
    os.makedirs(a.out, exist_ok=True)
    from h200_serve import model_dir as make_model_dir

    model_dir = os.path.abspath(a.model_dir) if a.model_dir else make_model_dir(a.profile)
    arms = {arm["name"]: arm for arm in a.arm}
    ports = {name: a.base_port + i for i, name in enumerate(arms)}
    procs = {}
    doc = {"profile": a.profile, "batches": a.batches, "reps": a.reps,
           "max_tokens": a.max_tokens, "prompt_len": a.prompt_len, "gpu_mem": a.gpu_mem,
           "arms": {}, "samples": [], "started": time.time()}
    try:
        t0 = time.time()
        ready, failed = {}, {}
        if a.concurrent_start:
            for name, arm in arms.items():
                procs[name] = start(arm, model_dir, ports[name], a)
            ready, failed = wait_ready(procs, ports, a.start_timeout, a)
        else:
            # one after another: vLLM sizes its KV cache from the memory free while it
            # profiles, so servers starting together starve each other (seen on the
            # H200: "No available memory for the cache blocks" in one of four arms)
            for name, arm in arms.items():
                procs[name] = start(arm, model_dir, ports[name], a)
                r, f = wait_ready({name: procs[name]}, ports, a.start_timeout, a)
                ready.update(r)
                failed.update(f)
        doc["start_s"] = round(time.time() - t0, 1)
        for name, arm in arms.items():
            doc["arms"][name] = {"manifest": arm["manifest"], "route": arm["route"],
                                 "cmd": arm["cmd"], "ready_s": ready.get(name),
                                 "failed": failed.get(name)}
        arms = {n: arm for n, arm in arms.items() if n in ready}
        if not arms:
            raise SystemExit("no server started")
        for b in a.batches:                           # warm every arm at every batch size
            for name in arms:
                one_request(ports[name], model_dir, b, a)
        outputs = {}
        names = list(arms)
        for rep in range(a.reps):
            for b in a.batches:
                order = names[rep % len(names):] + names[:rep % len(names)]
                for name in order:
                    tps, toks, dt, outs = one_request(ports[name], model_dir, b, a)
                    doc["samples"].append({"rep": rep, "batch": b, "arm": name,
                                           "tok_per_s": round(tps, 1), "tokens": toks,
                                           "seconds": round(dt, 4)})
                    outputs[(name, b)] = outs
                    doc["samples"][-1]["outputs"] = outputs_digest(outs)
                    print(f"  rep {rep} batch {b:>3} {name:<12} {tps:9.1f} tok/s", flush=True)
        summary = {}
        for name in names:
            for b in a.batches:
                xs = [s["tok_per_s"] for s in doc["samples"]
                      if s["arm"] == name and s["batch"] == b]
                summary.setdefault(name, {})[str(b)] = {
                    "median_tok_per_s": statistics.median(xs), "min": min(xs), "max": max(xs)}
        base = "vanilla" if "vanilla" in arms else names[0]
        for name in names:
            for b in a.batches:
                s = summary[name][str(b)]
                s["vs_" + base] = round(s["median_tok_per_s"]
                                        / summary[base][str(b)]["median_tok_per_s"], 3)
                ref, got = outputs.get((base, b)), outputs.get((name, b))
                # only prompts that returned all their tokens count: a server that ignores
                # return_token_ids gives [] for every prompt, which must not read as a match
                pairs = [(x, y) for x, y in zip(ref or [], got or [])
                         if len(x) == a.max_tokens and len(y) == a.max_tokens]
                s["same_tokens_as_" + base] = (
                    sum(x == y for x, y in pairs) / len(pairs) if pairs else None)
                s["prompts_compared"] = len(pairs)
        doc["summary"] = summary
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        for name in doc["arms"]:
            cs = {}
            for f in glob.glob(os.path.join(a.out, f"counters-{a.profile}-{name}-[0-9]*.json")):
                with open(f) as fh:
                    cs[os.path.basename(f)] = json.load(fh)
            if cs:
                doc["arms"].setdefault(name, {})["counters"] = cs
        doc["finished"] = time.time()
        # the server logs travel as one archive (a device call returns few files)
        import tarfile
        logs = sorted(glob.glob(os.path.join(a.out, f"server-{a.profile}-*.log"))
                      + glob.glob(os.path.join(a.out, f"counters-{a.profile}-*.json")))
        if logs:
            with tarfile.open(os.path.join(a.out, f"server-logs-{a.profile}.tar.gz"),
                              "w:gz") as tf:
                for f in logs:
                    tf.add(f, arcname=os.path.basename(f))
            for f in logs:
                os.remove(f)
        path = os.path.join(a.out, f"e2e-{a.profile}.json")
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    print(json.dumps(doc.get("summary"), indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
