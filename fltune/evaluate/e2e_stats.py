"""From the instrument's samples to its figures (issue 11): the per-repetition estimates,
the paired ratios and their confidence intervals, the host's speed, the per-process views.

Why a module of its own: these functions are what a reader of a run's raw data needs, and
nothing else of :mod:`fltune.evaluate.e2e` (which spawns and schedules the workers). The
instrument computes its summary with them when a run ends, and the scripts under
``benchmarks/`` (``interleave_check.py``, ``process_variance.py``, ``aa_design.py``, ...)
read old runs' raw files with the very same code, so a figure re-read later is the figure
the run printed, with today's estimate. Each sample is a dict as ``run_e2e`` records it
(``rep``, ``scenario``, ``arm``, ``replica``, optional ``generation``, ``time_s``,
``fast_s``, the worker's ``runs`` and ``host`` probes); a scenario is anything with
``name``, ``kind`` and ``output_len`` (an ``e2e.Scenario``: this module imports nothing
of the instrument, so a reader of raw data need not load it). :mod:`fltune.evaluate.e2e`
re-exports every public name here, so ``from fltune.evaluate.e2e import hierarchical_ci``
keeps working.
"""
from __future__ import annotations

import math
import random
import statistics


def bootstrap_ci(ratios, *, resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0) -> tuple:
    """(median, low, high) of paired per-repetition ratios: the sample median and the
    percentile interval of the medians of ``resamples`` resamplings (with replacement) of
    the repetitions, fixed seed. The interval always holds the median (widened to it in the
    rare case the percentiles miss it); identical samples give zero width."""
    xs = [float(x) for x in ratios]
    if not xs:
        return None, None, None
    med = statistics.median(xs)
    if len(xs) == 1:
        return med, med, med
    rng = random.Random(seed)
    n = len(xs)
    meds = sorted(statistics.median(rng.choices(xs, k=n)) for _ in range(resamples))
    return _percentile_interval(med, meds, confidence)


def _percentile_interval(med: float, meds: list, confidence: float) -> tuple:
    """(med, low, high): the percentile interval of the sorted resampled ``meds``,
    widened to hold ``med``."""
    alpha = (1.0 - confidence) / 2.0

    def pct(q):
        pos = q * (len(meds) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(meds) - 1)
        return meds[lo] + (meds[hi] - meds[lo]) * (pos - lo)

    return med, min(pct(alpha), med), max(pct(1.0 - alpha), med)


def _geomean(xs: list) -> float:
    if len(xs) == 1:        # exactly the one time (one process per arm: as before procs)
        return float(xs[0])
    # statistics.fmean's own sum (fsum / n), bit for bit, without its generator counting:
    # the bootstrap calls this ~10^5 times a CI, and a design's simulation ~10^7 times
    return math.exp(math.fsum(map(math.log, xs)) / len(xs))


def paired_ratios(base: dict, arm: dict, base_procs=None, arm_procs=None,
                  reps=None) -> list:
    """Per repetition (of ``reps``, default every one both sides have), the ratio
    baseline time / arm time, each side's time the geometric mean over its processes
    (``base_procs`` / ``arm_procs``, default all; a list with repeats counts a process
    twice, as a bootstrap draw does). ``base`` and ``arm``: repetition -> {process
    (replica index) -> seconds}, as :func:`rep_table` makes them."""
    if reps is None:
        reps = sorted(r for r in base if r in arm)
    out = []
    for r in reps:
        b = [base[r][j] for j in (base_procs or base[r]) if j in base[r]]
        a = [arm[r][j] for j in (arm_procs or arm[r]) if j in arm[r]]
        if b and a:
            out.append(_geomean(b) / _geomean(a))
    return out


#: generations from which :func:`hierarchical_ci` resamples the generations alone (below:
#: the processes inside each drawn generation too)
CLUSTER_GENERATIONS = 5


def hierarchical_ci(base: dict, arm: dict, *, resamples: int = 2000,
                    confidence: float = 0.95, seed: int = 0) -> tuple:
    """(median, low, high, ratios) of the paired ratio where each arm ran in one or more
    worker processes (``run_e2e(procs=)``), possibly in several generations of them
    (``run_e2e(generations=)``): the point is the median over repetitions of
    :func:`paired_ratios`; each bootstrap draw resamples, with replacement, the level that
    holds the processes' offsets (each side's processes where there is one generation, the
    generations where there are several), then the repetitions (within each drawn
    generation): a hierarchical bootstrap.

    Why the processes are a level of their own: an offset that belongs to a process (where
    its memory landed, what its host threads share, how its engine warmed up) is the same
    in every repetition, so resampling repetitions alone cannot see it, and an A/A of two
    single processes can then read 1-2 % apart with a CI clear of 1 (session 33's H100
    run, session 28's H200 runs). Why generations above them: a generation is a fresh draw
    of every arm's processes (:func:`generation_of`), so its offsets are new draws too, and
    the offsets average over processes x generations instead of the processes one card
    holds at once. From :data:`CLUSTER_GENERATIONS` generations on, a generation's
    processes are not drawn again inside it: its mean offset is what the generation level
    resamples, and drawing both read 95 % CIs that held 1 in 99-100 % of simulated A/As,
    ~25 % wider than honest (session 43, ``benchmarks/procs_coverage.py --generations``).
    Below that, few generations drawn with replacement see too few distinct offsets (two:
    80 % coverage, four: 91 %), so the processes are drawn inside each as well
    (conservative, not dishonest). With one generation and one process per side nothing is
    drawn but the repetitions: this is then :func:`bootstrap_ci` of the paired ratios, draw
    for draw."""
    base, arm = complete_processes(base), complete_processes(arm)
    reps = sorted(r for r in base if r in arm)
    ratios = paired_ratios(base, arm, reps=reps)
    gens: dict = {}
    for r in reps:
        gens.setdefault(_rep_generation(base[r], arm[r]), []).append(r)
    levels = [(rs, sorted({j for r in rs for j in base[r]}),
               sorted({j for r in rs for j in arm[r]})) for _, rs in sorted(gens.items())]
    if len(levels) <= 1 and all(len(bp) <= 1 and len(ap) <= 1 for _, bp, ap in levels):
        return (*bootstrap_ci(ratios, resamples=resamples, confidence=confidence,
                              seed=seed), ratios)
    med = statistics.median(ratios)
    rng = random.Random(seed)
    meds = []
    inner = len(levels) < CLUSTER_GENERATIONS     # processes drawn inside too
    for _ in range(resamples):
        xs = []
        drawn = rng.choices(levels, k=len(levels)) if len(levels) > 1 else levels
        for rs, bp, ap in drawn:
            bsel = rng.choices(bp, k=len(bp)) if inner and len(bp) > 1 else bp
            asel = rng.choices(ap, k=len(ap)) if inner and len(ap) > 1 else ap
            xs += paired_ratios(base, arm, bsel, asel, rng.choices(rs, k=len(rs)))
        if xs:
            meds.append(statistics.median(xs))
    # (every draw empty only where each process ran in a repetition of its own)
    return (*_percentile_interval(med, sorted(meds) or [med], confidence), ratios)


def generation_of(process) -> int:
    """The generation of a process key of :func:`rep_table`: ``(generation, replica)`` in a
    run with several generations, a plain replica index (generation 0) otherwise."""
    return process[0] if isinstance(process, tuple) else 0


def _rep_generation(*tables) -> int:
    """The generation a repetition ran in, from its process keys (one generation per
    repetition: every process is started again between generations)."""
    return max((generation_of(j) for t in tables for j in t), default=0)


def complete_processes(table: dict) -> dict:
    """``table`` (:func:`rep_table`) kept, generation by generation, to the processes
    present in every repetition of their generation, where at least one is: a process that
    died mid-run (or one whose worker failed a call) leaves the whole run (its generation's
    part), so that every repetition's mean is over the same processes and its offset does
    not enter the later repetitions as a step."""
    if not table:
        return table
    by_gen: dict = {}
    for r, t in table.items():
        by_gen.setdefault(_rep_generation(t), []).append(r)
    out: dict = {}
    for rs in by_gen.values():
        keep = set.intersection(*(set(table[r]) for r in rs))
        for r in rs:
            out[r] = ({j: x for j, x in table[r].items() if j in keep} if keep
                      else table[r])
    return {r: out[r] for r in table}


def process_offsets(table: dict) -> list:
    """Per process (replica 1, 2, ...) of one arm, how far its time sits from the arm's
    geometric mean, in percent: the median over repetitions of its log-ratio (> 0: slower
    than its siblings). The spread between processes of one and the same engine, which
    repetitions do not shrink."""
    procs = sorted({j for t in table.values() for j in t})
    out = []
    for j in procs:
        logs = [math.log(t[j] / _geomean(list(t.values()))) for t in table.values()
                if j in t and len(t) > 1]
        out.append(round(100.0 * (math.exp(statistics.median(logs)) - 1.0), 3)
                   if logs else None)
    return out


def _median(xs):
    return statistics.median(xs) if xs else None


#: engine steps per window of the decode estimate, and steps skipped at a run's start
STEP_WINDOW, STEP_SKIP = 8, 2


def step_estimate(scenario, r: dict) -> float:
    """One repetition's time for ``scenario``, from the worker's per-step durations
    (``r["runs"]``: one list of engine-step seconds per inner run).

    - decode: each run's steps after the first ``STEP_SKIP`` (the prompt's prefill, and
      with async scheduling the step that only queues it) and before the last, cut into
      consecutive windows of ``STEP_WINDOW`` steps; the time per decode step is the
      **median over all windows of the runs** of the window's mean step time. A window is
      several steps so that async scheduling's alternation (one step queues a batch, the
      next collects it) averages out inside it; the median across windows drops the few
      that a host hiccup hit (why: :meth:`Worker._time_steps`).
    - prefill: each run's engine steps summed (the prompt's processing before the first
      step is left out, as in decode), median over the runs.

    Raw data of the first version (``long_s``/``short_s``, whole generate calls) still
    reads: (median long - median short) / (output_len - 1)."""
    if "runs" not in r:     # the first version's raw data
        if scenario.kind == "decode":
            return ((_median(r["long_s"]) - _median(r["short_s"]))
                    / (scenario.output_len - 1))
        return _median(r["prefill_s"])
    runs = [list(x) for x in r["runs"] if x]
    if not runs:
        raise ValueError(f"scenario {scenario.name}: the worker timed no engine step")
    if scenario.kind == "prefill":
        return _median([sum(x) for x in runs])
    return _median([w for steps in runs for w in run_windows(steps)])


def run_windows(steps: list) -> list:
    """One decode run's window means (:func:`step_estimate`): the steps after the first
    ``STEP_SKIP`` and before the last, in consecutive windows of ``STEP_WINDOW`` (fewer
    where the run is short)."""
    body = steps[STEP_SKIP:-1] if len(steps) > STEP_SKIP + 2 else steps[1:] or steps
    w = STEP_WINDOW if len(body) >= 2 * STEP_WINDOW else max(1, len(body) // 2)
    return [sum(body[i:i + w]) / w for i in range(0, len(body) - w + 1, w)]


def run_estimates(scenario, r: dict) -> list:
    """Each inner run's own time, in :func:`step_estimate`'s terms: decode, the median of
    the run's windows; prefill, the run's engine steps summed."""
    return [step_estimate(scenario, {"runs": [steps]}) for steps in r.get("runs") or []
            if steps]


#: the fast level's band (:func:`fast_level_estimate`): the decode windows within this factor
#: of a repetition's fastest window. Chosen on the raw data of session 28 (H200) and 33
#: (H100): 1.02-1.05 gave the same A/A widths, 1.08 and wider let slow windows in
FAST_LEVEL_BAND = 1.05


def fast_level_estimate(scenario, r: dict) -> float | None:
    """One repetition's time at the host's full speed (``fast_s``; the point's ``fast_*``
    figures), beside :func:`step_estimate`'s median (the main figure, ``ratio_median``).

    Why: on the GPU machines' hosts a slow period (about a second, every core) makes the
    engine's steps 1.3-1.45x longer, as a *level shift*: one run's steps read 2.45 ms, then
    1.75 ms from the middle of the run on, when the period ends (session 33, H100, decode
    at batch 1). Slowness only adds time, so the host's fast level is the arm's speed.
    - decode: the median of the windows (:func:`run_windows`, over all the repetition's
      runs) that lie within ``FAST_LEVEL_BAND`` of its fastest window: the windows at the
      fast level, wherever in the runs they fell, and their median rather than the single
      fastest window, an extreme that one window's noise moves;
    - prefill: the fastest run (a run is one or two engine steps: no level inside it).
    Session 31 took the fastest *run* for decode too, but a period that covers part of
    every run of one arm leaves it no fast run. Re-read on the raw data of sessions 28 and
    33, the A/A half-width at decode fell from 1.0-11 % (fastest run) and 2.6-13 % (median)
    to 0.7-3.8 % (benchmarks/results/RUNS.md, "fifteenth run")."""
    runs = [list(x) for x in r.get("runs") or [] if x]
    if not runs:
        return None
    if scenario.kind != "decode":
        return min(run_estimates(scenario, r))
    windows = sorted(w for steps in runs for w in run_windows(steps))
    return _median([w for w in windows if w <= FAST_LEVEL_BAND * windows[0]])


def merge_time_replies(replies: list) -> dict:
    """The replies of several ``time`` calls of one arm (one run each, interleaved with the
    other arms') as the reply of one call with all their runs; the gate's accounts summed."""
    out = {"runs": [], "run_s": [], "host": []}
    gate = None
    for r in replies:
        for k in ("runs", "run_s", "host"):
            out[k] += r.get(k) or []
        g = r.get("gate")
        if g:
            if gate is None:
                gate = dict(g)
            else:
                for k in ("retaken", "slow_kept"):
                    gate[k] = gate.get(k, 0) + g.get(k, 0)
                gate["waited_s"] = round(gate.get("waited_s", 0.0) + g.get("waited_s", 0.0), 4)
                gate["floor_us"] = g.get("floor_us", gate.get("floor_us"))
    if gate is not None:
        out["gate"] = gate
    return out


def host_extra(arm: dict | None, base: dict | None, top: int = 15) -> dict:
    """Where ``arm``'s host time per run exceeds ``base``'s (two ``hostprof`` replies): the
    difference of their profiled run times and of their own times, and the ``top``
    functions by own time beyond the baseline's (a function the baseline does not run
    counts in full: a plugin's code shows up so)."""
    if not arm or not base or "functions" not in arm or "functions" not in base:
        return {"why": "a host profile is missing"}
    b = {f["func"]: f for f in base["functions"]}
    rows = []
    for f in arm["functions"]:
        o = b.get(f["func"], {})
        rows.append({"func": f["func"], "extra_us": round(f["tottime_us"]
                                                         - o.get("tottime_us", 0.0), 2),
                     "arm_us": f["tottime_us"], "baseline_us": o.get("tottime_us"),
                     "arm_calls": f["calls"], "baseline_calls": o.get("calls")})
    rows.sort(key=lambda r: -r["extra_us"])
    return {"run_s_arm": arm.get("run_s"), "run_s_baseline": base.get("run_s"),
            "own_time_extra_us": round(arm["own_time_us"] - base["own_time_us"], 2),
            "functions": rows[:top]}


#: the host's probe (a fixed Python loop timed around every run) read this many times the
#: run's fastest reading at its median: the host ran slow for most of the timed runs
SLOW_HOST_FACTOR = 1.25


def host_speed(samples: list) -> dict:
    """How fast the host ran during the timed runs, from the probes around them
    (``e2e_worker.host_probe_us``, recorded gated or not): the run's fastest reading, and
    each run's slower probe over it at the median, the 90th percentile, and the share of
    runs above :data:`SLOW_HOST_FACTOR`.

    Why: the wall CI says how wide the noise was, not why; a host that runs at half speed
    for most of a run (session 36's H100 machine: its probes' median 2.1x their fastest,
    decode steps varying 12.5 % where session 35's machine read 1.06x and 1.5 %) makes the
    wall figures measure the host, and the gate then retakes most runs (117 retakes for 108
    runs). One number in the summary tells such a run from a method that got worse. The
    fastest reading of the whole run, not each worker's floor: a worker whose every run
    fell in slow periods has a slow floor of its own."""
    worst = [max(h["probe_us"]) for s in samples for h in s.get("host") or []
             if len(h.get("probe_us") or []) == 2 and min(h["probe_us"]) > 0]
    if not worst:
        return {"runs": 0}
    floor = min(p for s in samples for h in s.get("host") or []
                for p in h.get("probe_us") or [] if p > 0)
    r = sorted(w / floor for w in worst)
    return {"runs": len(r), "probe_floor_us": round(floor, 1),
            "median_over_floor": round(r[(len(r) - 1) // 2], 3),
            "p90_over_floor": round(r[int(0.9 * (len(r) - 1))], 3),
            "slow_share": round(sum(1 for x in r if x > SLOW_HOST_FACTOR) / len(r), 3)}


#: how :func:`slow_host_note` begins: a report that states ``host.speed`` on a line of its
#: own (``render.host_speed_line``) leaves the note out rather than say it twice
SLOW_HOST_NOTE_START = "the host ran slow for most of the timed runs"


def slow_host_note(speed: dict) -> str:
    return (f"{SLOW_HOST_NOTE_START}: its probe read "
            f"{speed['median_over_floor']:.2f}x its fastest at the median, "
            f"{100 * speed['slow_share']:.0f} % of runs above {SLOW_HOST_FACTOR}x (host.speed); "
            f"the wall figures here measure the host's speed as much as the arms: read "
            f"the kernel figures, and measure the wall time again on a quieter host")


def _kernel_rounds(res) -> list:
    """The kernel µs per step of each profiled round of one (arm, scenario)."""
    if not res:
        return []
    if res.get("rounds_us"):
        return list(res["rounds_us"])
    us = res.get("kernel_us_per_step")
    return [us] if us is not None else []


def kernel_deltas(base: dict | None, arm: dict | None, n: int = 5) -> list:
    """The kernels whose time per step differs most between the baseline's profile and an
    arm's (each a worker ``profile`` result with ``top_kernels``: its first profiled round),
    largest difference first: ``[{name, us_vanilla, us_arm, delta_us}]`` (delta = arm -
    vanilla, µs per step; a kernel only one side runs has None on the other).

    Why: the kernel ratio says *that* a step's GPU time moved, not *where*. On the H200
    (session 19) an A/A of two vanilla engines read 1.4 % apart at batch-16 decode, all of
    it FlashAttention's decode kernel (265 against 249 µs per step: attention reads each
    engine's own KV-cache blocks); and Qwen3-0.6B's GEMM split lost 2 % at batch 64 in one
    place, FlagGems' mm for the down projection (250 µs per step) where vanilla ran cuBLAS's
    split-K GEMM and its reduction (151 + 53). Only the ``top`` kernels of each side are
    listed; a kernel missing from one side's list counts as absent there only where that
    list is short or ends below the kernel's time (it would have been listed), else it is
    left out (unknown). Names the worker cut to the same 200 characters are summed."""
    def tops(res):
        out: dict = {}
        for k in (res or {}).get("top_kernels") or []:
            out[k["name"]] = out.get(k["name"], 0.0) + k["us_per_step"]
        return out, len((res or {}).get("top_kernels") or []), (res or {}).get("top_n", 20)

    (a, a_len, a_top), (b, b_len, b_top) = tops(base), tops(arm)
    if not a or not b:
        return []

    def absent_in(side: dict, side_len: int, top_n: int, us: float) -> bool:
        return side_len < top_n or us > min(side.values())   # would it have been listed?

    out = []
    for name in set(a) | set(b):
        ua, ub = a.get(name), b.get(name)
        if ua is None and not absent_in(a, a_len, a_top, ub):
            continue
        if ub is None and not absent_in(b, b_len, b_top, ua):
            continue
        out.append({"name": name, "us_vanilla": ua, "us_arm": ub,
                    "delta_us": round((ub or 0.0) - (ua or 0.0), 3)})
    out.sort(key=lambda d: -abs(d["delta_us"]))
    return out[:n]


def rep_table(samples: list, scenario: str, arm: str, value=None) -> dict:
    """repetition -> {process -> seconds} of one arm's samples of one scenario; ``value``
    (sample -> seconds or None, default its ``time_s``) picks the estimate. The process is
    the sample's replica index (a sample from before ``procs`` is replica 1), or
    ``(generation, replica)`` where the sample says its generation (a run with several,
    ``run_e2e(generations=)``: replica 2 of one generation is another process than replica
    2 of the next). A time that is missing or not positive is left out."""
    value = value or (lambda s: s.get("time_s"))
    out: dict = {}
    for s in samples:
        if s["scenario"] == scenario and s["arm"] == arm:
            t = value(s)
            if t is not None and t > 0:
                j = s.get("replica", 1)
                if "generation" in s:
                    j = (s["generation"], j)
                out.setdefault(s["rep"], {})[j] = t
    return out


def compute_points(samples: list, scenarios: list, arm_names: list, baseline: str,
                   kernels: dict | None = None) -> list:
    """One point per (scenario, non-baseline arm) from the paired per-repetition samples
    (with several processes per arm, :func:`hierarchical_ci`)."""
    kernels = kernels or {}
    points = []
    for sc in scenarios:
        base = complete_processes(rep_table(samples, sc.name, baseline))
        for name in arm_names:
            if name == baseline:
                continue
            arm = complete_processes(rep_table(samples, sc.name, name))
            med, lo, hi, ratios = hierarchical_ci(base, arm)
            if not ratios:
                continue
            reps = sorted(r for r in base if r in arm)
            k = kernels.get(sc.name, {})
            ka, kb = _kernel_rounds(k.get(name)), _kernel_rounds(k.get(baseline))
            kpairs = [b / a for a, b in zip(ka, kb) if a and b]
            kmed, klo, khi = bootstrap_ci(kpairs) if kpairs else (None, None, None)
            procs_arm = len({j for r in reps for j in arm[r]})
            procs_base = len({j for r in reps for j in base[r]})
            points.append({
                "scenario": sc.name, "arm": name, "n": len(ratios), "ratio_median": med,
                "ci_low": lo, "ci_high": hi,
                "kernel_us_arm": _median(ka) if ka else None,
                "kernel_us_vanilla": _median(kb) if kb else None,
                # vanilla kernel time / arm kernel time per profiled round (> 1: the arm's
                # kernels are faster), median and paired bootstrap CI like the wall ratio
                "kernel_n": len(kpairs), "kernel_ratio_median": kmed,
                "kernel_ci_low": klo, "kernel_ci_high": khi,
                "kernel_top_deltas": kernel_deltas(k.get(baseline), k.get(name)),
                "step_us_arm": _median([_geomean(list(arm[r].values())) for r in reps]) * 1e6,
                "step_us_vanilla": _median([_geomean(list(base[r].values()))
                                            for r in reps]) * 1e6,
                "ci_half_width": (hi - lo) / 2, "ratios": ratios,
                "procs_arm": procs_arm, "procs_vanilla": procs_base,
                "process_offsets_pct": _offsets_or_none(arm, base),
                **_fast_figures(samples, sc, name, baseline)})
    return points


def _offsets_or_none(arm: dict, base: dict) -> dict | None:
    """The point's ``process_offsets_pct`` (:func:`process_offsets` of each side), or None
    where no process had a sibling to sit apart from (one process per arm, in one
    generation or in several)."""
    offs = {"arm": process_offsets(arm), "vanilla": process_offsets(base)}
    return offs if any(x is not None for side in offs.values() for x in side) else None


def _fast_figures(samples: list, scenario, arm: str, baseline: str) -> dict:
    """The point's ratio from :func:`fast_level_estimate` (``fast_ratio_median``,
    ``fast_ci_low``, ``fast_ci_high``, ``fast_ratios``), paired per repetition like the
    main one (processes too): read from the sample's steps where it has them (so older raw
    data reads with today's estimate), else its recorded ``fast_s``; empty where a sample
    has neither (raw data before session 31 that kept no steps)."""
    def fast(s):
        return fast_level_estimate(scenario, s) if s.get("runs") else s.get("fast_s")

    med, lo, hi, ratios = hierarchical_ci(rep_table(samples, scenario.name, baseline, fast),
                                          rep_table(samples, scenario.name, arm, fast))
    if not ratios:
        return {}
    return {"fast_ratio_median": med, "fast_ci_low": lo, "fast_ci_high": hi,
            "fast_ratios": ratios}


def replica_name(arm: str, replica: int) -> str:
    """The worker of ``arm``'s ``replica``-th process (``run_e2e(procs=)``): the first keeps
    the arm's name (its logs, counters and profiles read as with one process), the others
    ``ARM.pN``."""
    return arm if replica == 1 else f"{arm}.p{replica}"


def samples_by_process(samples: list) -> list:
    """The samples with each worker process as an arm of its own (``vanilla``,
    ``vanilla.p2``, ...; ``run_e2e(procs=)``): what a reading per process needs (the
    scripts that put every run on one time line, or compare A/A processes); a sample from
    before ``procs`` is its arm's first process and keeps its name. In a run with several
    generations (``run_e2e(generations=)``) a later generation's process is also named
    for it: ``vanilla.p2@g1`` (each generation's workers are new processes); the first
    generation's keep the plain names, so the baseline's first process is still the
    baseline by name."""
    return [{**s, "arm": replica_name(s["arm"], s.get("replica", 1))
             + (f"@g{s['generation']}" if s.get("generation") else "")} for s in samples]


def split_generation(process: str) -> tuple:
    """(process name without its generation, generation) of a name
    :func:`samples_by_process` gave: ``("aa.p3", 2)`` for ``aa.p3@g2``, ``("aa.p3", 0)``
    for ``aa.p3``. Only a trailing ``@g`` and digits is a generation: an arm may itself be
    named ``x@gpu``."""
    head, at, tail = process.rpartition("@g")
    if at and tail.isdigit():
        return head, int(tail)
    return process, 0


def baseline_process(process: str, baseline: str) -> str:
    """The baseline's first process in the generation of ``process`` (a name
    :func:`samples_by_process` gave): ``vanilla`` for ``aa.p3``, ``vanilla@g2`` for
    ``aa.p3@g2``. Why: a per-process reading compares each process with the baseline
    process that ran beside it; a later generation's processes never shared a repetition
    with the first generation's ``vanilla``, so read against it they had no pairs."""
    generation = split_generation(process)[1]
    return baseline + (f"@g{generation}" if generation else "")
