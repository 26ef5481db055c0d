"""One arm of the end-to-end instrument: an in-process vLLM ``LLM`` driven by JSON lines.

    python -m fltune.integrations.vllm.e2e_worker SPEC.json      (started by fltune.evaluate.e2e)

The parent sets this process's environment (the arm's ``FLTUNE_*`` overlay, and by default
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so engine core and model run here: nothing else runs
while the arm is idle, and torch.profiler sees its kernels; ``=1`` for the multiprocess
mode, where the steps are timed from this front end) before Python starts, so vLLM
loads fltune's plugin through its entry point with the arm's settings.

It lives with the vLLM integration, not with ``evaluate/e2e.py`` that drives it: it is a vLLM
process and reads the plugin's own state there (status, load_model hook record, counters),
and the stages import one way only (``tests/test_architecture.py``).

Protocol: one JSON object per line on stdin (a command), one per line on a private copy of
the original stdout (the reply). Everything else this process prints, vLLM's logs included,
goes to stderr (fd 1 is pointed at fd 2 before vLLM is imported), which the parent sends
to the arm's log file. The first reply is ``{"ok": true, "ready": ...}`` once the engine is
up, or ``{"ok": false, "error": ...}``.

Commands (``cmd``):
  time     {"scenario": {...}, "inner": k[, "gate": g, "retakes": r]} -> {"runs": [k lists
           of engine-step seconds], "run_s": [k whole generate() seconds], "host": [k
           host records with probe_us][, "gate": account]} (k runs of the scenario, each
           timed per engine step, with ``gate`` only runs at host speed: see
           :meth:`Worker.cmd_time` and :func:`gated_runs`)
  tokens   {"batch", "prompt_len", "output_len"} -> {"tokens": [[...]], "digest"}
  profile  {"scenario": {...}, "top": n} -> kernel time per step (CUDA only)
  hostprof {"scenario": {...}, "runs": k} -> host time per Python function (cProfile)
  info     -> versions, KV cache size, compilation mode, fltune plugin status
  quit
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import re
import sys
import tempfile
import time
import traceback

_PROTO = None


def _reply(obj: dict) -> None:
    _PROTO.write(json.dumps(obj, default=str) + "\n")
    _PROTO.flush()


def _redirect_stdout() -> None:
    """Keep the protocol on a private fd; fd 1 (and sys.stdout) become stderr."""
    global _PROTO
    _PROTO = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def prompts_for(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list:
    """``batch`` token-id prompts of ``prompt_len`` tokens, the same in every arm."""
    rng = random.Random(f"{seed}:{batch}:{prompt_len}")
    lo = min(100, max(3, vocab // 4))
    return [{"prompt_token_ids": [rng.randrange(lo, vocab) for _ in range(prompt_len)]}
            for _ in range(batch)]


def digest_of(tokens: list) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


class Worker:
    def __init__(self, spec: dict):
        self.spec = spec
        import torch
        self.torch = torch
        self.cuda = torch.cuda.is_available() and spec.get("device_type", "cuda") == "cuda"
        from vllm import LLM, SamplingParams
        self.SamplingParams = SamplingParams
        engine = dict(spec["engine"])
        # tensor parallelism: the model runs in vLLM's rank processes (:meth:`_profiled_ranks`)
        self.ranks = int(engine.get("tensor_parallel_size") or 1) > 1
        t0 = time.perf_counter()
        self.llm = LLM(model=spec["model_dir"], **engine)
        self.init_s = time.perf_counter() - t0
        #: whether this engine compiled its model or loaded it from vLLM's compile cache,
        #: read right after the start (the driver restarts a compiled arm: ``start_state``)
        self.compile_start = compile_start_state(read_compilation_counter())
        try:
            self.vocab = int(self.llm.llm_engine.model_config.get_vocab_size())
        except Exception:
            self.vocab = int(spec.get("vocab_size") or 256)
        self._prompts: dict = {}
        self._steps = None
        #: the host probe's speed floor here (:class:`SpeedFloor`): the gate's reference
        self.probe_floor = None
        self.rank_totals: dict = {}
        self._time_steps()

    def _time_steps(self):
        """Wrap this engine's ``step`` so every call of it during a timed run leaves its
        host-side duration in ``self._steps``.

        Why per step: timing whole ``generate`` calls, the first H200 A/A run saw the same
        arm's 64-step decode take 177-282 ms from one run to the next; a few steps hit by
        a host hiccup (the scheduler thread preempted, a GC pass, a page fault) carry the
        whole run. With each step's time, a window of steps hit that way is one outlier
        among many and a median drops it (:func:`fltune.evaluate.e2e.step_estimate`).
        vLLM's own ``LLM.generate`` still drives the engine (it calls
        ``self.llm_engine.step()`` in a loop, in 0.24 and in 0.32); only the clock is ours."""
        eng = self.llm.llm_engine
        orig = eng.step

        def step():
            t0 = time.perf_counter()
            out = orig()
            if self._steps is not None:
                self._steps.append(time.perf_counter() - t0)
            return out

        eng.step = step

    # ---- helpers ----------------------------------------------------------------------
    def prompts(self, batch: int, prompt_len: int) -> list:
        key = (batch, prompt_len)
        if key not in self._prompts:
            self._prompts[key] = prompts_for(batch, prompt_len, self.vocab,
                                             self.spec.get("prompt_seed", 0))
        return self._prompts[key]

    def params(self, n: int):
        return self.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                   detokenize=False)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def gen(self, prompts, n: int):
        self.sync()
        t = time.perf_counter()
        out = self.llm.generate(prompts, self.params(n), use_tqdm=False)
        self.sync()
        return time.perf_counter() - t, out

    # ---- commands ---------------------------------------------------------------------
    def cmd_time(self, scenario: dict, inner: int = 1, gate: float | None = None,
                 retakes: int | None = None) -> dict:
        """``inner`` runs of the scenario (decode: ``output_len`` tokens; prefill: one
        token), each with its engine steps' durations, the host probe before and after
        (``probe_us``), and with ``gate`` only runs taken while the host ran at speed
        (:func:`gated_runs`; its account in ``gate``). Python's GC is collected before
        and held off during the runs, in every arm alike: a collection landing in one
        arm's run is noise, not a property of the arm."""
        import gc
        prompts = self.prompts(scenario["batch"], scenario["prompt_len"])
        n = scenario["output_len"] if scenario["kind"] == "decode" else 1

        def one_run():
            self._steps = []
            h0 = host_state()
            # CLOCK_MONOTONIC is one clock for every process of the host: the runs of all
            # arms can be put on one time line (which ran next to which:
            # benchmarks/interleave_check.py)
            t_mono = time.monotonic()
            t = self.gen(prompts, n)[0]
            h = host_delta(h0, host_state())
            h["t_mono"] = round(t_mono, 6)
            steps, self._steps = self._steps, None
            return t, steps, h

        runs, run_s, host = [], [], []
        gc.collect()
        gc.disable()
        try:
            kept, self.probe_floor, account = gated_runs(
                one_run, host_probe_us, max(1, inner), gate, self.probe_floor, retakes)
        finally:
            self._steps = None
            gc.enable()
        for (t, steps, h), probes in kept:
            h["probe_us"] = probes
            run_s.append(t)
            runs.append(steps)
            host.append(h)
        out = {"runs": runs, "run_s": run_s, "host": host}
        if gate:
            out["gate"] = account
        return out

    def cmd_tokens(self, batch: int, prompt_len: int, output_len: int) -> dict:
        _, out = self.gen(self.prompts(batch, prompt_len), output_len)
        toks = [list(o.outputs[0].token_ids) for o in out]
        return {"tokens": toks, "digest": digest_of(toks)}

    def cmd_profile(self, scenario: dict, top: int = 20) -> dict:
        if not self.cuda:
            return {"kernel_us_per_step": None, "why": "no CUDA device: no kernel profile"}
        prompts = self.prompts(scenario["batch"], scenario["prompt_len"])
        ranks = None
        if scenario["kind"] == "decode":
            k_long, wall_long = self._profiled(prompts, scenario["output_len"])
            r_long = dict(self.rank_totals)
            k_short, wall_short = self._profiled(prompts, 1)
            steps = scenario["output_len"] - 1
            if self.ranks:
                ranks = {r: (r_long[r] - self.rank_totals.get(r, 0.0)) / steps
                         for r in r_long}
            names = set(k_long) | set(k_short)
            per = {n: ((k_long.get(n, [0, 0.0])[1] - k_short.get(n, [0, 0.0])[1]) / steps,
                       (k_long.get(n, [0, 0])[0] - k_short.get(n, [0, 0])[0]) / steps)
                   for n in names}
            total = (sum(v[1] for v in k_long.values())
                     - sum(v[1] for v in k_short.values())) / steps
            wall = (wall_long - wall_short) / steps
        else:
            k, wall = self._profiled(prompts, 1)
            per = {n: (v[1], v[0]) for n, v in k.items()}
            total = sum(v[1] for v in k.values())
            if self.ranks:
                ranks = dict(self.rank_totals)
        tops = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
        extra = {} if ranks is None else {
            "source": "torch.profiler in each rank process (collective_rpc), rank 0",
            "rank_kernel_us_per_step": {f"tp{r}": round(v, 3) for r, v in sorted(ranks.items())}}
        coll = {n: v for n, v in per.items() if is_collective(n)}
        if coll:       # every collective kernel, not only those among the top
            extra["collectives"] = [{"name": n[:200], "us_per_step": round(us, 3),
                                     "calls_per_step": round(c, 3)}
                                    for n, (us, c) in sorted(coll.items(), key=lambda kv: -kv[1][0])]
            extra["collective_us_per_step"] = round(sum(v[0] for v in coll.values()), 3)
        return {"kernel_us_per_step": total, "profiled_wall_s_per_step": wall, **extra,
                "top_n": top, "top_kernels": [{"name": n[:200], "us_per_step": round(us, 3),
                                 "calls_per_step": round(c, 3)} for n, (us, c) in tops]}

    def cmd_hostprof(self, scenario: dict, runs: int = 3, top: int = 200) -> dict:
        """Where a run's host time goes, by Python function: ``runs`` runs of the scenario
        under ``cProfile`` (one unprofiled run first), per function its own time
        (``tottime``), calls and cumulative time, per run, the ``top`` by own time.

        Why: on the H200 the served DB's arm ran Qwen3-0.6B's 2048-token prefill step
        with the same 382 kernels as vanilla and 2 % less kernel time, yet its profiled
        step took 37 ms against vanilla's 25 (session 15): the extra is host work, and
        the kernel profile cannot say whose. ``run_e2e(host_profile=True)`` asks every arm
        and lists the functions where an arm spends more than the baseline. cProfile
        slows Python calls several-fold, so these are for comparing arms side by side,
        not step times; its timer is wall time (``time.perf_counter``)."""
        import cProfile
        import gc
        import pstats

        prompts = self.prompts(scenario["batch"], scenario["prompt_len"])
        n = scenario["output_len"] if scenario["kind"] == "decode" else 1
        self.gen(prompts, n)
        prof = cProfile.Profile(time.perf_counter)
        wall = 0.0
        gc.collect()
        gc.disable()
        try:
            for _ in range(max(1, runs)):
                prof.enable()
                try:
                    wall += self.gen(prompts, n)[0]
                finally:
                    prof.disable()
        finally:
            gc.enable()
        k = max(1, runs)
        rows = [{"func": func_label(f), "tottime_us": tt / k * 1e6, "calls": nc / k,
                 "cumtime_us": ct / k * 1e6}
                for f, (_cc, nc, tt, ct, _callers) in pstats.Stats(prof).stats.items()]
        rows.sort(key=lambda r: -r["tottime_us"])
        return {"runs": k, "run_s": wall / k,
                "own_time_us": sum(r["tottime_us"] for r in rows),
                "functions": [{key: (round(v, 2) if isinstance(v, float) else v)
                               for key, v in r.items()} for r in rows[:top]]}

    def _profiled(self, prompts, n: int):
        if self.ranks:
            return self._profiled_ranks(prompts, n)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            wall, _ = self.gen(prompts, n)
        return kernels_of(p), wall

    def _profiled_ranks(self, prompts, n: int):
        """Tensor parallelism: the kernels run in vLLM's rank processes, out of this
        process's torch.profiler. Each rank runs the same torch.profiler around the run,
        started and stopped through ``LLM.collective_rpc`` (:func:`rank_profile_start`,
        :func:`rank_profile_stop`), and sends back its kernel table; the collectives are
        in it. The figure is rank 0's (the ranks run the same kernels in lock step; each
        rank's total is kept).

        Why not vLLM's own worker profiler (``profiler_config``, ``LLM.start_profile``):
        on the H200 (vLLM 0.24, TP=2, session 8) it left no trace file that this process
        could find, and it writes whole traces to disk where a table of kernels is all
        that is needed."""
        started = self.llm.collective_rpc(rank_profile_start, args=("cuda",))
        try:
            wall, _ = self.gen(prompts, n)
        finally:
            got = self.llm.collective_rpc(rank_profile_stop)
        per_rank = {int(r["rank"]): r["kernels"] for r in got}
        if len(per_rank) != len(started):
            raise RuntimeError(f"{len(started)} ranks started a profile, "
                               f"{len(per_rank)} distinct ranks answered: {sorted(per_rank)}")
        self.rank_totals = {r: sum(v[1] for v in k.values()) for r, k in per_rank.items()}
        return per_rank[min(per_rank)], wall

    def cmd_info(self) -> dict:
        import torch
        import vllm
        info = {"vllm": getattr(vllm, "__version__", "?"), "torch": torch.__version__,
                "init_s": round(self.init_s, 2), "pid": os.getpid(), "vocab": self.vocab,
                "cuda": self.cuda}
        try:
            vc = self.llm.llm_engine.vllm_config
            cc = vc.cache_config
            info["kv_cache"] = {"num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size,
                                "kv_cache_memory_bytes": getattr(cc, "kv_cache_memory_bytes",
                                                                 None),
                                "gpu_memory_utilization": cc.gpu_memory_utilization}
            comp = vc.compilation_config
            info["compilation"] = {"mode": str(getattr(comp, "mode", None)),
                                   "cudagraph_mode": str(getattr(comp, "cudagraph_mode", None)),
                                   "cudagraph_capture_sizes": getattr(
                                       comp, "cudagraph_capture_sizes", None)}
            info["additional_config"] = vc.additional_config
            info["max_num_seqs"] = vc.scheduler_config.max_num_seqs
            info["async_scheduling"] = getattr(vc.scheduler_config, "async_scheduling", None)
            info["attention_backend"] = str(getattr(getattr(vc, "attention_config", None),
                                                    "backend", None))
            info["enforce_eager"] = vc.model_config.enforce_eager
            # InprocClient (engine core here) or SyncMPClient (in its own process)
            info["engine_core_client"] = type(self.llm.llm_engine.engine_core).__name__
        except Exception as e:  # diagnostics only
            info["config_error"] = repr(e)
        try:
            from fltune.integrations.vllm import config as flcfg
            from fltune.integrations.vllm import hooks, ops
            info["fltune"] = {"status": dict(flcfg.STATUS), "record": hooks.RECORD,
                              "counters": ops.counters()}
        except Exception as e:
            info["fltune"] = {"error": repr(e)}
        info["compile_start"] = self.compile_start
        if self.cuda:
            info["device_name"] = torch.cuda.get_device_name(0)
            info["memory_allocated"] = torch.cuda.memory_allocated()
        return info


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def host_state() -> dict:
    """What the host did around a timed run (Linux; empty elsewhere): the machine's CPU
    ticks (steal: time the hypervisor gave this VM's CPUs to someone else), this process's
    CPU time, the CPU it last ran on and that CPU's clock. Why: on the H200 machine the
    wall time per step of one arm switched between two levels (up to 1.8x apart) from one
    repetition to the next while its GPU kernel time stayed within 0.3 %; these say which
    host cause goes with the slow level."""
    st = {}
    cpu = _read("/proc/stat").split("\n", 1)[0].split()
    if cpu and cpu[0] == "cpu":
        ticks = [int(x) for x in cpu[1:]]
        st["ticks"] = sum(ticks)
        st["steal"] = ticks[7] if len(ticks) > 7 else 0
        st["idle"] = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    me = _read("/proc/self/stat").rpartition(")")[2].split()
    if len(me) > 37:
        st["proc_ticks"] = int(me[11]) + int(me[12])       # utime + stime
        st["cpu"] = int(me[36])                             # processor last run on
        st["ctx_invol"] = None
    for line in _read("/proc/self/status").splitlines():
        if line.startswith("nonvoluntary_ctxt_switches"):
            st["ctx_invol"] = int(line.split()[1])
    if "cpu" in st:
        khz = _read(f"/sys/devices/system/cpu/cpu{st['cpu']}/cpufreq/scaling_cur_freq").strip()
        st["mhz"] = int(khz) / 1000 if khz.isdigit() else None
    st["t"] = time.monotonic()
    return st


#: iterations of :func:`host_probe_us`'s loop: ~0.3-1 ms of Python on these hosts
PROBE_LOOPS = 20000


def host_probe_us(loops: int = PROBE_LOOPS) -> float:
    """How long a fixed pure-Python loop takes on this thread now, in µs: a speedometer
    for the host work that sets a decode step. Taken right before and after each timed run
    (``probe_us`` in the run's host record). Why: on the H200 machine runs of one arm, even
    two arms on the same vCPU a second apart, came out at levels up to 1.6x apart
    (``h200-2026-12-01-s9/linbench``: prefill 2048 at 35-38 or 54-61 ms, both arms on CPU
    1), with no steal time and no context switch to show it. If the probe slows with the
    run, samples taken in a slow period can be told apart (and left out or re-taken);
    if it does not, the slowdown is not the CPU's speed at plain Python work (caches,
    memory, the GPU's host interface) — either answer narrows the cause."""
    t0 = time.perf_counter()
    x = 0
    for i in range(loops):
        x += i & 7
    return round((time.perf_counter() - t0) * 1e6, 1)


#: how long :func:`gated_runs` waits for the host to come back to speed before a run
GATE_WAIT_S = 2.0
#: probes that set a worker's speed floor on its first gated call
GATE_SEED_PROBES = 20
#: the speed floor is this quantile of the worker's last :data:`FLOOR_WINDOW` probes
FLOOR_QUANTILE, FLOOR_WINDOW = 0.1, 400


class SpeedFloor:
    """What a worker's host probe reads at full speed: the :data:`FLOOR_QUANTILE` quantile of
    its last :data:`FLOOR_WINDOW` readings (``us``). Why not the lowest reading ever (the
    first version): one reading well below the fast level set a gate the fast level itself
    failed. On the H200 machine in session 11 the probe's fast level read 745-1000 µs with
    one reading of 698, so a 1.25x gate on the minimum (873 µs) retook runs taken at full
    speed, and the gate's waits cost ~90 s a repetition of 5 scenarios x 3 arms. A low
    quantile sits inside the fast level as long as the host spends a tenth of its time
    there; if it never does, the floor rises to the slow level and the gate lets runs
    through rather than wait without end (``floor_us`` in the account says which). The
    readings are the ones around runs (two a run, and the seed), not the gate's waiting
    probes, so the tenth is a tenth of the runs' time, not of the probes'."""

    def __init__(self, readings=()):
        self.readings = collections.deque(readings, maxlen=FLOOR_WINDOW)

    def add(self, us: float) -> None:
        self.readings.append(us)

    @property
    def us(self) -> float | None:
        if not self.readings:
            return None
        r = sorted(self.readings)
        return r[int(FLOOR_QUANTILE * (len(r) - 1))]


def gated_runs(run, probe, inner: int, gate: float | None, floor: "SpeedFloor | None" = None,
               retakes: int | None = None, wait_s: float = GATE_WAIT_S,
               clock=time.monotonic):
    """``inner`` calls of ``run()``, each between two ``probe()`` readings (µs of a fixed
    Python loop: :func:`host_probe_us`); returns ``([(run's result, [before, after])...],
    floor, account)``.

    With ``gate`` (e.g. 1.25), a run counts only if both probes read at most ``gate`` times
    the worker's speed floor (:class:`SpeedFloor`, kept across calls: pass back the one
    returned; topped up to :data:`GATE_SEED_PROBES` probes when it holds fewer): before a run the probe is
    repeated until it reads fast (at most ``wait_s``), and a run whose probes read slow is
    taken again, at most ``retakes`` times per call (default ``2 * inner``; after that it
    is kept and counted in ``slow_kept``). Why: on the H200 machine the host works at one
    of two speeds in periods of about a second, seen by every process and on every core (a
    probe of ~650 µs becomes ~1200 µs; ``h200-2026-12-01-s10``), and a run in a slow
    period is 10-20 % slower whatever the arm. Taking every arm's runs only at full speed
    measures the arms, not the host's period. ``gate`` None or 0: every run counts (the
    probes are still recorded). ``account``: factor, floor_us, retaken, waited_s,
    slow_kept.

    The probe runs on the worker's main thread, so another thread of the same process that
    holds the GIL during it also reads as "slow": in fltune's arms the plugin's counters
    writer (a file write once a second) is such a thread, vanilla has none. Its share of a
    run's probe window is ~0.1 %; the summary's per-arm ``retaken`` shows whether the arms
    were treated alike."""
    retakes = 2 * inner if retakes is None else retakes
    floor = SpeedFloor() if floor is None else floor
    if gate and len(floor.readings) < GATE_SEED_PROBES:
        for _ in range(GATE_SEED_PROBES - len(floor.readings)):
            floor.add(probe())
    account = {"factor": gate, "retaken": 0, "waited_s": 0.0, "slow_kept": 0}
    kept = []

    while len(kept) < inner:
        before = probe()
        if gate:
            # the readings taken while waiting for speed do not enter the floor: they are
            # ~1 ms apart and all slow, and a window of them would carry the floor up to
            # the slow level within half a second and end the wait it exists for
            t0, limit = clock(), gate * floor.us     # fixed while waiting (see above)
            while before > limit and clock() - t0 < wait_s:
                before = probe()
            account["waited_s"] += clock() - t0
        floor.add(before)
        out = run()
        after = probe()
        floor.add(after)
        slow = bool(gate) and max(before, after) > gate * floor.us
        if slow and account["retaken"] < retakes:
            account["retaken"] += 1
            continue
        account["slow_kept"] += int(slow)
        kept.append((out, [before, after]))
    account["waited_s"] = round(account["waited_s"], 4)
    account["floor_us"] = floor.us
    return kept, floor, account


def host_delta(a: dict, b: dict) -> dict:
    """The run's share of :func:`host_state`: tick deltas as fractions of the machine's,
    the process's CPU seconds, its CPU and clock at the end."""
    out = {"cpu": b.get("cpu"), "mhz": b.get("mhz")}
    dt = b.get("ticks", 0) - a.get("ticks", 0)
    if dt > 0:
        out["steal_frac"] = round((b["steal"] - a["steal"]) / dt, 4)
        out["idle_frac"] = round((b["idle"] - a["idle"]) / dt, 4)
    if "proc_ticks" in a and "proc_ticks" in b:
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        out["proc_cpu_s"] = round((b["proc_ticks"] - a["proc_ticks"]) / hz, 4)
    if a.get("ctx_invol") is not None and b.get("ctx_invol") is not None:
        out["ctx_invol"] = b["ctx_invol"] - a["ctx_invol"]
    out["wall_s"] = round(b["t"] - a["t"], 6)
    return out


def func_label(f) -> str:
    """cProfile's (file, line, name) as ``pkg/mod.py:line(name)``, the path from its package
    on (after ``site-packages/``, or from ``fltune/`` for a source checkout; else its last
    three parts): install prefixes differ between machines, the package path names the
    code (``vllm/v1/engine/core.py``, ``fltune/dispatch/frozen.py``). A builtin's name
    loses its object address (``<function Event.record at 0x7f39...>``): each process has
    its own, and with it the arms' labels of one function never matched (session 33's
    host profiles listed ``Event.record`` as a function only the arm ran)."""
    path, line, name = f
    if path == "~":                                  # a builtin
        return re.sub(r" at 0x[0-9a-fA-F]+", "", name)
    path = path.replace("\\", "/")
    if "site-packages/" in path:
        tail = path.rsplit("site-packages/", 1)[1]
    elif "/fltune/" in path:
        tail = "fltune/" + path.rsplit("/fltune/", 1)[1]
    else:
        tail = "/".join(path.split("/")[-3:])
    return f"{tail}:{line}({name})"


def kernels_of(prof) -> dict:
    """{kernel name: [count, total µs]} of a torch.profiler run (GPU kernels, memcpy and
    memset), from its Chrome trace (as research/tools/prof.py)."""
    return trace_kernels(chrome_trace(prof))


def chrome_trace(prof) -> dict:
    """A stopped torch.profiler run's Chrome trace, as a dict (through a temporary file:
    torch exports to a path only)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)
    finally:
        os.remove(path)


#: kernel names of the collectives a tensor-parallel vLLM model adds: NCCL's, vLLM's custom
#: all-reduce (``cross_device_reduce_*``), FlashInfer/TensorRT-LLM's all-reduce (+ norm)
#: fusion (``allreduce_fusion*``, ``lamport``), torch symmetric memory's one/two-shot
_COLLECTIVE = ("nccl", "allreduce", "all_reduce", "cross_device_reduce", "allgather",
               "all_gather", "reducescatter", "reduce_scatter", "lamport", "one_shot",
               "two_shot", "oneshot", "twoshot", "multimem")


def is_collective(kernel_name: str) -> bool:
    n = kernel_name.lower()
    return any(k in n for k in _COLLECTIVE)


def rank_profile_start(worker, activity: str = "cuda") -> int:
    """Run in each rank process by ``LLM.collective_rpc``: start a torch.profiler there
    (``activity``: "cuda" for GPU kernels, "cpu" where there is none) and keep it on the
    worker object until :func:`rank_profile_stop`. Returns the rank."""
    from torch.profiler import ProfilerActivity, profile
    act = ProfilerActivity.CUDA if activity == "cuda" else ProfilerActivity.CPU
    prof = profile(activities=[act])
    prof.start()
    worker._fltune_profile = (prof, activity)
    return _tp_rank(worker)


def rank_profile_stop(worker) -> dict:
    """Run in each rank process by ``LLM.collective_rpc``: stop the profiler
    :func:`rank_profile_start` left there; returns ``{"rank", "kernels": {name: [count,
    µs]}, "events"}`` (``events``: every event of the trace, CPU ones included)."""
    import torch
    prof, activity = worker._fltune_profile
    del worker._fltune_profile
    if activity == "cuda":
        torch.cuda.synchronize()
    prof.stop()
    tr = chrome_trace(prof)
    return {"rank": _tp_rank(worker), "kernels": trace_kernels(tr),
            "events": sum(1 for e in tr.get("traceEvents", []) if e.get("ph") == "X")}


def _tp_rank(worker) -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group
        return int(get_tp_group().rank_in_group)
    except Exception:
        return int(getattr(worker, "rank", 0) or 0)


#: vLLM's compilation counters (``vllm/compilation/counter.py``, the same fields in vLLM 0.24
#: and 0.32) that only a start that compiled the model and wrote it to the compile cache
#: moves, and those a start that loaded it from there moves. ``num_inductor_compiles`` is in
#: neither: on the H200 (vLLM 0.24, session 27) a start that loaded every graph from the
#: cache still counted 26 of them (against 29 in the start that compiled), so it says
#: "compiled" only where nothing was loaded either (a compile with the cache switched off)
COMPILED_COUNTERS = ("num_aot_compiles", "num_cache_entries_updated",
                     "num_compiled_artifacts_saved", "num_aot_artifacts_saved")
LOADED_COUNTERS = ("num_aot_artifacts_loaded", "num_compiled_artifacts_loaded")


def read_compilation_counter() -> dict | None:
    """vLLM's process-wide compilation counters (non-zero fields), or None where this vLLM
    has none. With the multiprocess engine the compile runs in the engine core's process
    and these stay at zero here."""
    try:
        import dataclasses

        from vllm.compilation.counter import compilation_counter
        return {k: v for k, v in dataclasses.asdict(compilation_counter).items() if v}
    except Exception:
        return None


def compile_start_state(counters: dict | None) -> dict:
    """``{"state": "compiled" | "loaded" | "none" | "unknown", "saved": bool, "counters":
    ...}`` of an engine start, from :func:`read_compilation_counter` (``saved``: it wrote
    what it compiled to the compile cache, so a restart can load it): "compiled" where any of
    :data:`COMPILED_COUNTERS` moved (this start compiled and saved at least one graph), or
    where graphs went through the compiler and nothing was saved or loaded (the compile
    cache off); "loaded" where :data:`LOADED_COUNTERS` moved and none that writes; "none"
    where none moved (eager, or the compile ran in another process); "unknown" without
    counters.

    Why it matters: a compiled and a loaded engine of the same model ran a host-bound
    prefill 6-8 % apart on the H200 (``fltune.evaluate.e2e.START_STATES``)."""
    if counters is None:
        return {"state": "unknown", "saved": False, "counters": None}
    saved = any(counters.get(k) for k in COMPILED_COUNTERS)
    if saved:
        state = "compiled"
    elif any(counters.get(k) for k in LOADED_COUNTERS):
        state = "loaded"
    elif counters.get("num_inductor_compiles") or counters.get("num_backend_compilations"):
        state = "compiled"      # compiled, nothing written or read: the cache is off
    else:
        state = "none"
    return {"state": state, "saved": saved, "counters": dict(counters)}


def trace_kernels(tr: dict) -> dict:
    """{kernel name: [count, total µs]} of a Chrome trace's GPU events."""
    agg: dict = {}
    for e in tr.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e["name"] if cat == "kernel" else f"[{cat}] {e['name']}"
            a = agg.setdefault(name, [0, 0.0])
            a[0] += 1
            a[1] += float(e.get("dur", 0))
    return agg


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _redirect_stdout()
    try:
        with open(argv[0]) as f:
            spec = json.load(f)
        worker = Worker(spec)
        if worker.cuda:          # CUPTI's first profile is slow: warm it up now
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]):
                worker.torch.ones(8, device="cuda").add_(1)
                worker.sync()
            if worker.ranks:     # and in each rank process, where the kernels run at TP > 1
                worker.llm.collective_rpc(rank_profile_start, args=("cuda",))
                worker.llm.collective_rpc(rank_profile_stop)
    except BaseException as e:   # reported to the parent, then exit non-zero
        traceback.print_exc()
        _reply({"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
        sys.stderr.flush()
        os._exit(3)
    _reply({"ok": True, "ready": True, "init_s": worker.init_s})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            msg = json.loads(line)
            cmd = msg.pop("cmd")
            if cmd == "quit":
                _reply({"ok": True})
                break
            fn = getattr(worker, f"cmd_{cmd}", None)
            if fn is None:
                raise ValueError(f"unknown command {cmd!r}")
            _reply({"ok": True, **fn(**msg)})
        except Exception as e:
            traceback.print_exc()
            _reply({"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]})
    sys.stderr.flush()
    # the plugin's counters writer flushes at exit (atexit); skip vLLM's slow teardown
    import atexit
    atexit._run_exitfuncs()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
