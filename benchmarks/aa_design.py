"""What it takes for an A/A to read within ±1 %: processes and repetitions per arm, from the
noise a recorded A/A run measured, and whether that many engines fit one card (issue 11).

    python3 benchmarks/aa_design.py RAW.json[.gz] [--target 1.0] [--key time_s|fast_s]
        [--reps R] [--arms 3] [--engine-gib 9.4] [--card-gib 80] [--json OUT]

Why: the goal is an A/A CI half-width of at most 1 % at every point. Session 35's A/A with
four processes a side read ±0.9–1.0 % at decode and ±1.6 % at a 2048-token prefill, where
each process sits ~1 % from its engine's mean. Whether more repetitions, more processes or
neither can close that is arithmetic on two variance components, and the processes cost
GPU memory: ``fltune bench --e2e --procs K`` with A arms starts A x K engines on one card
(each ~9.4 GiB on the H100 with the instrument's 4 GiB KV cache; the memory preflight,
``fltune/evaluate/gpu_memory.py``, starts only what fits).

Per scenario of an A/A raw file (every arm a second vanilla; each process an arm of its
own, as ``process_variance.py`` reads it):

1. the components: ``sigma_p`` (a process's own offset, the same in every repetition) and
   ``sigma_e`` (a sample's noise beyond the repetition's shared level), two-way ANOVA
   (``process_variance.components``);
2. a model check: the run's own design (K processes a side, R repetitions) simulated with
   those components and the instrument's CI (``procs_coverage.run``: the hierarchical
   bootstrap ``fltune bench --e2e`` computes), against the half-width the run read; a
   model that misses the run by far says the components do not describe it (an offset
   between engines that processes do not average, a drift);
3. the design: the smallest K (at ``--reps``) whose simulated half-width is within the
   target, and the engines it takes (arms x K) against the card; where no K up to
   ``--max-procs`` reaches it, the floor it would need: sigma_p itself must shrink (fewer
   host-side offsets: CUDA graphs, pinning), processes alone will not do it on one card;
4. where the processes that fit fall short, fresh ones instead of more at once: the fewest
   generations (``fltune bench --e2e --generations G``, every process started again G - 1
   times in the run) within the target with the processes that fit
   (:func:`generations_design`). Session 43 read session 35's H100 A/A for where its
   offset lives (``process_variance.py --by-cpu``): at a 2048-token prefill the process
   explains 46 % of the spread and the vCPU a process ran on adds nothing beside it
   (F 0.17, p 0.98; the process beside the vCPU: F 6.7, p 0.0001), so pinning cannot
   remove sigma_p there, and a new process is a new draw.
5. what the planned run costs on the run's own clock (:func:`run_costs`,
   :func:`call_seconds`): the engines' first start, one restart of every worker per later
   generation, and each repetition's time per engine, against one device call
   (``--call-s``). Why: session 43 planned six generations (15 repetitions in all)
   assuming ~30 s a restart; on the H100 of session 44 a restart of eight engines took
   40-49 s and the first start ~150 s, so that plan takes ~470 s of a call's 510, and a
   call asked for 18 repetitions under a 440-s limit ran four generations.

The simulation is the CPU's (figures are predictions; the GPU run that follows the design
is the measurement).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from fltune.evaluate.e2e import GENERATION_WARMUP  # noqa: E402
from fltune.evaluate.results_file import ResultsFileError, read_json  # noqa: E402
from procs_coverage import run as simulate_design  # noqa: E402
from process_variance import components  # noqa: E402

#: the hierarchical design's row in ``procs_coverage.run`` (one process: the plain bootstrap)
HIER, ONE = "K processes, hierarchical", "one process, reps bootstrap"


def predicted(k: int, reps: int, sigma_p: float, sigma_e: float, *,
              sims: int, resamples: int, generations: int = 1) -> tuple:
    """(median CI half-width %, coverage) of the instrument's CI for an A/A of K processes
    a side and ``reps`` repetitions, in ``generations`` fresh sets of processes,
    sigma_p / sigma_e as fractions (simulated). With one process a side in one generation
    the CI cannot see sigma_p: narrow, and its coverage says how honest."""
    res = simulate_design(k, reps, sigma_p, sigma_e, sims, resamples,
                          generations=generations)
    return tuple(res[HIER if k > 1 or generations > 1 else ONE][key]
                 for key in ("half_width_pct_median", "coverage"))


#: generations tried where the processes that fit cannot reach the target
GENERATIONS = (2, 3, 4, 6, 8, 10, 12, 16)
#: the simulated coverage below which a design's narrow CI does not count (95 % nominal)
HONEST = 0.9


def generations_design(k: int, reps: int, sp: float, se: float, target: float, *,
                       sims: int, resamples: int) -> dict:
    """With ``k`` processes a side (those that fit), the fewest generations
    (``fltune bench --e2e --generations G``: every process started afresh G - 1 times in
    the run) whose CI is within ``target``, at max(``reps``, 2 G) repetitions: what fresh
    processes buy where the card holds no more of them at once. Each generation costs an
    engine restart (loaded, all arms in parallel: ~30 s on session 35's H100, 40-49 s for
    eight engines on session 44's; :func:`call_seconds` prices it) and a warm-up
    repetition."""
    out = {"procs": k, "by_generations": {}, "coverage": {}, "generations_needed": None}
    for g in GENERATIONS:
        r = max(reps, 2 * g)
        hw, cov = predicted(k, r, sp, se, sims=sims, resamples=resamples, generations=g)
        out["by_generations"][g], out["coverage"][g] = hw, cov
        if hw <= target and cov >= HONEST:
            out.update(generations_needed=g, reps=r)
            break
    return out


def vanilla_arms(raw: dict) -> set:
    """The arms that run vanilla as the baseline does (no environment overlay, no engine
    override): the A/A's sides. An A/B arm, or a fresh compile's draw (``recompiled``: its
    own caches), is another engine and stays out of the components. A raw file without
    arm records counts every arm."""
    arms = raw.get("arms") or {}
    if not arms:
        return {s["arm"] for s in raw.get("samples") or []}
    return {info.get("arm") or name for name, info in arms.items()
            if not info.get("env") and not info.get("engine")}


def observed(raw: dict, scenario: str, key: str, same: set) -> dict | None:
    """The run's own A/A reading at ``scenario``: half-width (%) and K a side, for the
    first arm of ``same`` (:func:`vanilla_arms`) with a point (the baseline has none: its
    A/A arm)."""
    lo_k, hi_k = ("fast_ci_low", "fast_ci_high") if key == "fast_s" else ("ci_low", "ci_high")
    for p in raw.get("points") or []:
        if (p.get("scenario") == scenario and p.get(lo_k) is not None
                and p.get("arm") in same):
            return {"arm": p.get("arm"), "n": p.get("n"),
                    "half_width_pct": 50.0 * (p[hi_k] - p[lo_k]),
                    "procs": min(p.get("procs_arm") or 1, p.get("procs_vanilla") or 1)}
    return None


#: the seconds of one device call a planned run may take: h200_s7.sh's default TIMEOUT of
#: 540 s less the 30 s it keeps for the kernel profile and packing (``lim``)
CALL_S = 510


def run_costs(raw: dict, scenario: str | None = None) -> dict | None:
    """What the run's own clock says a run costs, from its timed runs' ``t_mono`` (the
    workers' ``time.monotonic``, one clock for the host): ``rep_engine_s``, a repetition's
    span (first to last timed run; of ``scenario``'s runs alone where given: a repetition
    runs its scenarios one after another) per engine that ran in it, median over the
    repetitions; ``restart_s``, one restart of every worker (``host.generations``, a
    run with generations), else a loaded engine's start (the arms' ``start_s``);
    ``start_s``, from the run's beginning to the moment every engine was up (before the
    first warm-up) where the run recorded its clock (``host.clock``, session 44 on), else
    the first wave's start (a compiled arm's ``first_start``) plus two loaded starts (the
    second wave, and the compiled arms' restart to a loaded engine): session 44's
    five-generation run read 88 + 2 x 41.7 s there, where its call spent ~150 s before
    the first timed run. None without ``t_mono``."""
    by_rep: dict = {}
    engines: dict = {}
    for s in raw.get("samples") or []:
        if scenario and s.get("scenario") != scenario:
            continue
        ts = [h["t_mono"] for h in s.get("host") or [] if h.get("t_mono") is not None]
        if ts:
            by_rep.setdefault(s["rep"], []).extend(ts)
            engines.setdefault(s["rep"], set()).add((s["arm"], s.get("replica", 1)))
    per_engine = [(max(v) - min(v)) / len(engines[r]) for r, v in by_rep.items()
                  if len(v) > 1]
    if not per_engine:
        return None
    host = raw.get("host") or {}
    arms = raw.get("arms") or {}
    starts = [a["start_s"] for a in arms.values() if a.get("start_s")]
    loaded = statistics.median_high(starts) if starts else None
    restarts = [r["s"] for r in (host.get("generations") or {}).get("restarts") or []
                if r.get("s")]
    restart = statistics.median_high(restarts) if restarts else loaded
    clock = host.get("clock") or {}
    if clock.get("began_mono") is not None and clock.get("ready_mono") is not None:
        start = clock["ready_mono"] - clock["began_mono"]
    else:
        firsts = [(a.get("first_start") or {}).get("start_s") or 0.0 for a in arms.values()]
        start = max(firsts + starts + [0.0]) + 2 * (loaded or 0.0)
    return {"rep_engine_s": round(statistics.median_high(per_engine), 3),
            "restart_s": restart and round(restart, 1), "start_s": round(start, 1)}


def call_seconds(costs: dict, *, procs: int, arms: int, reps: int, generations: int = 1,
                 warmup: int = 2) -> float:
    """A planned run's seconds on ``costs`` (:func:`run_costs`): the start, a restart per
    later generation, and every repetition (``warmup`` first, one more per later
    generation, as ``e2e.rep_plan`` lays them out) at its time per engine times the
    planned engines (``arms`` x ``procs``). The kernel profile after it is left out (a
    fraction of a second a round on the H100)."""
    later = generations - 1
    n_reps = warmup + reps + later * min(warmup, GENERATION_WARMUP)
    return round(costs["start_s"] + later * (costs["restart_s"] or 0.0)
                 + n_reps * costs["rep_engine_s"] * arms * procs, 1)


def design(raw: dict, *, key: str = "time_s", target: float = 1.0, reps: int | None = None,
           arms: int = 3, engine_gib: float = 9.4, card_gib: float = 80.0,
           max_procs: int = 12, sims: int = 120, resamples: int = 600,
           generations: bool = True, call_s: float = CALL_S) -> list:
    """One row per scenario (see the module doc); where the processes that fit the card
    do not reach the target, ``with_generations`` (:func:`generations_design`). Where the
    run's clock says what it cost (:func:`run_costs`), each design found says what it
    would take of one call of ``call_s`` (``call_s``, ``fits_call``: a run of that
    scenario alone)."""
    rows = []
    warmup = raw.get("warmup", 2)

    def cost(plan: dict, costs: dict | None, **kw):
        if costs:
            plan["call_s"] = call_seconds(costs, arms=arms, warmup=warmup, **kw)
            plan["fits_call"] = plan["call_s"] <= call_s
    fit_engines = int(card_gib // engine_gib)
    # what sigma_p would allow the target with the processes that fit: the hierarchical
    # CI's width is mostly 1.96 * sqrt(2 sigma_p^2 / K) once reps are many
    k_fit = max(1, fit_engines // max(arms, 1))
    sigma_p_for_target = round(target / 1.96 * math.sqrt(k_fit / 2), 3)
    same = vanilla_arms(raw)
    for sc, c in components([s for s in raw["samples"] if s["arm"] in same], key).items():
        sp, se = c["sigma_p_pct"] / 100, c["residual_sd_pct"] / 100
        costs = run_costs(raw, sc)
        seen = observed(raw, sc, key, same)
        r_run = c["reps"]
        r_plan = reps or r_run
        row = {"scenario": sc, "sigma_p_pct": round(c["sigma_p_pct"], 3),
               "sigma_e_pct": round(c["residual_sd_pct"], 3), "reps_run": r_run,
               "observed": seen}
        if seen:
            row["model_check_pct"] = predicted(seen["procs"], r_run, sp, se,
                                               sims=sims, resamples=resamples)[0]
        row["by_procs"], row["coverage"] = {}, {}
        need = None
        # from two processes a side: one cannot resample the process level, its CI is
        # narrow by leaving sigma_p out (shown for reference, with its coverage)
        for k in range(1, max_procs + 1):
            hw, cov = predicted(k, r_plan, sp, se, sims=sims, resamples=resamples)
            row["by_procs"][k], row["coverage"][k] = hw, cov
            if k > 1 and hw <= target:
                need = k
                break
        row["reps_plan"] = r_plan
        row["procs_needed"] = need
        row["engines_needed"] = need * arms if need else None
        row["fits_card"] = bool(need) and need * arms <= fit_engines
        row["procs_that_fit"] = k_fit
        row["sigma_p_for_target_pct"] = sigma_p_for_target
        if need:
            cost(row, costs, procs=need, reps=r_plan)
        if not row["fits_card"] and generations:
            gen = row["with_generations"] = generations_design(
                k_fit, r_plan, sp, se, target, sims=sims, resamples=resamples)
            if gen["generations_needed"]:
                cost(gen, costs, procs=k_fit, reps=gen["reps"],
                     generations=gen["generations_needed"])
        rows.append(row)
    return rows


def engine_gib_of(raw: dict) -> float | None:
    """GiB per engine as the run's memory preflight measured it (``host.memory_preflight``,
    runs since session 42), else None."""
    seen = [w.get("per_engine_mib") for w in (raw.get("host") or {}).get("memory_preflight")
            or [] if w.get("per_engine_mib")]
    return round(max(seen) / 1024, 2) if seen else None


def in_calls(plan: dict, call_s: float = CALL_S) -> str:
    """`` (~N s: one call)`` or `` (~N s: more than one call of S s)`` where the design
    has a cost (:func:`design`), else nothing."""
    if plan.get("call_s") is None:
        return ""
    return (f" (~{plan['call_s']:.0f} s: " + ("fits one call" if plan["fits_call"] else
                                             f"more than one {call_s:.0f}-s call") + ")")


def verdict(row: dict, target: float, call_s: float = CALL_S) -> str:
    if row["procs_needed"] and row["fits_card"]:
        return (f"reachable: {row['procs_needed']} processes a side x {row['reps_plan']} reps "
                f"({row['engines_needed']} engines, fit){in_calls(row, call_s)}")
    if row["procs_needed"]:
        text = (f"needs {row['procs_needed']} processes a side ({row['engines_needed']} "
                f"engines): more than the card holds ({row['procs_that_fit']} a side fit; "
                f"with those, sigma_p must fall to ~{row['sigma_p_for_target_pct']:.2f} %)")
    else:
        text = (f"not within {max(row['by_procs'])} processes a side: sigma_p must fall to "
                f"~{row['sigma_p_for_target_pct']:.2f} % for ±{target:g} % with the "
                f"{row['procs_that_fit']} a side that fit")
    gen = row.get("with_generations")
    if gen and gen["generations_needed"]:
        text += (f"; or fresh processes: {gen['procs']} a side in "
                 f"{gen['generations_needed']} generations x {gen['reps']} reps "
                 f"(--generations {gen['generations_needed']}){in_calls(gen, call_s)}")
    elif gen:
        text += (f"; fresh processes ({gen['procs']} a side) not within "
                 f"{max(gen['by_generations'])} generations")
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", help="an A/A run's e2e-raw.json[.gz] (--procs K: K per arm)")
    ap.add_argument("--key", default="time_s", choices=["time_s", "fast_s"],
                    help="time_s (the median run, the instrument's main figure) or fast_s")
    ap.add_argument("--target", type=float, default=1.0, help="CI half-width, %% (1.0)")
    ap.add_argument("--reps", type=int, help="repetitions to plan for (default: the run's)")
    ap.add_argument("--arms", type=int, default=3,
                    help="arms the planned run starts (vanilla, aa, an A/B arm: 3)")
    ap.add_argument("--engine-gib", type=float, default=None,
                    help="GPU memory per engine (default: what the run's memory preflight "
                         "measured, else 9.4, the H100's in session 35)")
    ap.add_argument("--card-gib", type=float, default=80.0)
    ap.add_argument("--max-procs", type=int, default=12)
    ap.add_argument("--sims", type=int, default=120)
    ap.add_argument("--no-generations", action="store_true",
                    help="skip the generations design where the processes that fit fall short")
    ap.add_argument("--call-s", type=float, default=CALL_S,
                    help=f"seconds of one device call a planned run may take ({CALL_S})")
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args(argv)
    try:
        raw = read_json(a.raw)
    except ResultsFileError as e:
        print(f"aa_design: {e}", file=sys.stderr)
        return 2
    engine_gib = a.engine_gib or engine_gib_of(raw) or 9.4
    rows = design(raw, key=a.key, target=a.target, reps=a.reps, arms=a.arms,
                  engine_gib=engine_gib, card_gib=a.card_gib, max_procs=a.max_procs,
                  sims=a.sims, generations=not a.no_generations, call_s=a.call_s)
    costs = run_costs(raw)
    if costs:
        print(f"the run's clock: start {costs['start_s']:.0f} s, a restart of every worker "
              f"{costs['restart_s'] or 0:.0f} s; the designs' seconds are a run of their "
              f"scenario alone, against a {a.call_s:.0f}-s call")
    if not rows:
        print(f"aa_design: {a.raw}: no scenario with 2+ processes and 2+ repetitions "
              f"(an A/A run with --procs, or with an A/A arm, is needed)", file=sys.stderr)
        return 1
    for r in rows:
        seen = r["observed"]
        check = (f"run read ±{seen['half_width_pct']:.2f} % at K={seen['procs']} R={r['reps_run']}, "
                 f"model ±{r['model_check_pct']:.2f} %" if seen else "no A/A point")
        curve = " ".join(f"K{k}:{hw:.2f}" + (f" (coverage {r['coverage'][k]:.2f})"
                                             if k == 1 else "")
                         for k, hw in r["by_procs"].items())
        print(f"{r['scenario']:<13} sigma_p {r['sigma_p_pct']:.2f} %  sigma_e "
              f"{r['sigma_e_pct']:.2f} %  | {check}\n{'':13} ±% by K at R={r['reps_plan']}: "
              f"{curve}\n{'':13} {verdict(r, a.target, a.call_s)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"raw": a.raw, "key": a.key, "target_pct": a.target, "arms": a.arms,
                       "engine_gib": engine_gib, "card_gib": a.card_gib,
                       "call_s": a.call_s, "run_costs": costs,
                       "command": "python3 benchmarks/aa_design.py "
                                  + " ".join(argv if argv is not None else sys.argv[1:]),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
