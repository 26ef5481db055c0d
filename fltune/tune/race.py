"""The race: one (op, shape, dtype, band) — inputs -> qualify -> parity -> clone -> time ->
adjudicate. The one loop every measuring command runs (calibrate, refine, bench, verify),
in process or in the supervised worker (``tune/worker.py``).

Why one loop: it used to exist three times (adjudicate, bench, verify; refine a fourth,
partial one), and the copies drifted — bench and verify skipped the memory guard and the
worker isolation, so a crashing kernel killed them and a too-large band took the machine's
memory. Commands now differ only in which candidates they race and what they read off the
returned :class:`Verdict`.

The rule is flashrt's ``adjudicate()``: the fastest candidate wins, *except* that every
candidate whose median is within the win margin (default 3 %) of the fastest competes on
precision, and the most precise of those (smallest measured error against the reference)
wins. Why: a 2 % timing difference is inside what a rerun moves, so picking on it is
picking on noise, while a precision difference is deterministic and real. Exact precision
ties fall back to the declared precision rank, then the fastest.

Every candidate's outcome is returned — unqualified (reason), refused (raised; reason),
parity_failed (score), timed (stats) — because the DB keeps all of them: "why did X not
win here" must be answerable from the DB alone.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..dispatch.types import OpImpl, QualifyContext
from ..ops import get_op, workload_dims
from ..ops.base import clone_args
from . import cold_weights, parity, timing
from .bands import Band

WIN_MARGIN = 0.03


@dataclass
class Settings:
    device: str = "cpu"
    parity_floor: float = parity.PARITY_FLOOR
    margin: float = WIN_MARGIN
    cold_l2: bool = False          # eager cold-L2 timing for prefill bands (> COLD_L2_ABOVE)
    #: CUDA graph-timed bands: an op's step-cold arguments (a GEMM's weight) rotated
    #: through copies that overflow L2, as a model step reads them (tune/cold_weights.py)
    cold_weights: bool = False
    reps: int = 0                  # 0 = adaptive
    budget_s: float = 0.05         # per candidate, when adaptive
    graph_calls: int = 20
    #: bands above this many tokens are timed eagerly, back to back (``timing``): vLLM's
    #: largest CUDA-graph capture size by default (``bands.DECODE_LIMIT``); above it vLLM
    #: runs without a graph and a candidate's host launch cost is part of its cost
    graph_limit: int = 512
    seed: int = 0
    # also time candidates that fail parity (outcome stays parity_failed, with a timing):
    # bench shows what the fixed FL order would run, and FL checks no parity
    time_failing: bool = False

    def as_dict(self):
        return dict(self.__dict__)

    def recorded(self) -> dict:
        """What a calibration run stores as its settings (the race-only switches left out,
        so the DB's ``runs.settings`` reads as before)."""
        d = self.as_dict()
        if not d["time_failing"]:
            del d["time_failing"]
        if not d["cold_weights"]:      # recorded only when on: older runs read the same
            del d["cold_weights"]
        return d


@dataclass
class Outcome:
    impl: OpImpl
    outcome: str                   # unqualified | refused | parity_failed | timed
    reason: Optional[str] = None
    parity: Optional[parity.ParityResult] = None
    timing: Optional[timing.Timing] = None


@dataclass
class Verdict:
    outcomes: list
    winner: Optional[Outcome]
    runner_up: Optional[Outcome]
    reason: str
    bytes: int
    extra: dict = field(default_factory=dict)


def pick_winner(timed: list[Outcome], margin: float):
    """flashrt's rule over the timed, parity-passing outcomes. Returns (winner, runner_up,
    reason)."""
    if not timed:
        return None, None, "no candidate passed parity and timing"
    by_time = sorted(timed, key=lambda o: o.timing.median_us)
    fastest = by_time[0]
    limit = fastest.timing.median_us * (1.0 + margin)
    contenders = [o for o in by_time if o.timing.median_us <= limit]
    winner = min(contenders, key=lambda o: (o.parity.rel_error, o.impl.precision_rank,
                                            o.timing.median_us))
    runner_up = next((o for o in by_time if o is not winner), None)
    if winner is fastest:
        reason = "fastest"
        if len(contenders) > 1:
            reason += f"; also most precise of {len(contenders)} within {margin:.0%}"
    else:
        slower = winner.timing.median_us / fastest.timing.median_us - 1
        reason = (f"within {margin:.0%} of fastest {fastest.impl.impl_id} (+{slower:.1%}) and "
                  f"more precise (rel err {winner.parity.rel_error:.2e} vs "
                  f"{fastest.parity.rel_error:.2e})")
    return winner, runner_up, reason


#: ``--cold-l2`` times the bands above this many tokens (prefill) eagerly, L2 flushed per call
COLD_L2_ABOVE = 512


def timing_mode(band: Band, settings: Settings) -> tuple[bool, bool]:
    """(cold, eager): whether the race times ``band`` with L2 flushed before each call
    (``--cold-l2``, above :data:`COLD_L2_ABOVE` tokens) or eagerly back to back (above
    ``graph_limit``); neither = calls replayed from one CUDA graph. The one statement of the
    rule: the race, ``--cold-weights``' report and the resume's regime all read it."""
    cold = settings.cold_l2 and band.tokens > COLD_L2_ABOVE
    return cold, not cold and band.tokens > settings.graph_limit


def graph_timed(band: Band, settings: Settings) -> bool:
    """Whether the race times ``band`` as calls replayed from one CUDA graph (on CUDA): a
    band up to ``graph_limit`` tokens that ``--cold-l2`` does not time eagerly."""
    return not any(timing_mode(band, settings))


def rotated_weights(rows: list) -> bool:
    """Whether a raced band's candidates rotated copies of their weights (their timers
    record ``cold_weight_copies``): what ``cold_weights_unused`` counts."""
    return any("cold_weight_copies" in json.loads(r["timer"] or "{}") for r in rows)


def timing_regime(spec, band: Band, settings: Settings) -> dict:
    """The timing switches that change how ``band`` of an op (``spec``) is timed, with their
    values in ``settings``: on CUDA, ``cold_l2`` above 512 tokens (eager, L2 flushed per
    call), ``cold_weights`` for a CUDA-graph-timed band of an op with step-cold arguments.
    A resumed calibration counts a band as measured only under the same switches
    (``CalibrationDB.has_band``); a switch that cannot change a band is left out, so a
    ``--cold-weights`` run does not re-race the norms or the prefill bands, and on a CPU
    (whose timer flushes nothing and replays no graph) neither switch re-races anything."""
    regime = {}
    if settings.device != "cuda":
        return regime
    if band.tokens > COLD_L2_ABOVE:
        regime["cold_l2"] = bool(settings.cold_l2)
    if spec.step_cold_args and graph_timed(band, settings):
        regime["cold_weights"] = bool(settings.cold_weights)
    return regime


def cold_weights_unused(settings: Settings, raced: list, skipped: list,
                        rotated: int) -> Optional[str]:
    """The one line a calibration prints when ``--cold-weights`` was asked for and changed
    nothing, saying why (None when it was not asked for, or some band's candidates did
    rotate their weights). ``raced`` and ``skipped`` are the ``(op, band)`` pairs the run
    raced and found already in the DB, ``rotated`` how many raced bands' timers recorded
    copies (``cold_weight_copies``).

    Why: the switch is a no-op on a CPU, for ops whose arguments a step reads hot, at
    bands timed eagerly, for bands measured before (a resumed run skips them) and for
    weights that overflow L2 on their own — and a DB written then reads exactly like a
    hot-timed one, so a user who asked for cold weights would take its picks for the cold
    ones without being told."""
    if not settings.cold_weights or rotated:
        return None
    head = "--cold-weights changed nothing: "
    tail = "; the weights were timed as usual"
    if settings.device != "cuda":
        return (head + f"no band here is timed by CUDA graph replay ({settings.device.upper()} "
                       f"device)" + tail)
    pairs = list(raced) + list(skipped)
    cold_ops = sorted({op for op, _ in pairs if get_op(op).step_cold_args})
    if not cold_ops:
        ops = ", ".join(sorted({op for op, _ in pairs})) or "none"
        return (head + f"no op calibrated reads an argument cold in a model step (ops: {ops}; "
                       f"OpSpec.step_cold_args, e.g. linear's weight)")
    names = ", ".join(cold_ops)
    in_graph = [(op, b) for op, b in pairs if op in cold_ops and graph_timed(b, settings)]
    if not in_graph:
        return (head + f"no band of {names} is timed by CUDA graph replay (above "
                       f"{settings.graph_limit} tokens, or timed eagerly by --cold-l2)" + tail)
    if not any(op in cold_ops and graph_timed(b, settings) for op, b in raced):
        return (head + f"every CUDA-graph-timed band of {names} was in the DB already, timed "
                       f"with the weights cold by an earlier run on this device, driver and "
                       f"stack, so none was raced (--force re-races them)")
    return (head + f"the cold arguments of {names} span {cold_weights.L2_FACTOR:g}x L2 on "
                   f"their own at every band raced, or free memory left no room for a second "
                   f"copy" + tail)


def _cold_weight_copies(spec, args, settings: Settings, graph_timed: bool,
                        candidates: int = 1) -> int:
    """Copies of the step-cold arguments each candidate's timed call rotates through (1 =
    none): only with ``--cold-weights``, on CUDA, for graph-timed (decode) bands of an op
    that declares such arguments, and only as many as fit half of free memory for all
    ``candidates`` together. Eager (prefill) bands are left as they are: ``--cold-l2``
    flushes L2 before each call there."""
    if not (settings.cold_weights and spec.step_cold_args and graph_timed
            and settings.device == "cuda"):
        return 1
    nbytes = cold_weights.cold_bytes(args, spec.step_cold_args)
    n = cold_weights.copies_needed(nbytes, cold_weights.l2_bytes(settings.device))
    fit = int(_free_memory(settings.device) * 0.5 // (max(nbytes, 1) * max(candidates, 1)))
    return max(1, min(n, fit))


def _free_memory(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def race(op_name: str, dims: dict, dtype: torch.dtype, band: Band,
               impls: list[OpImpl], settings: Settings, progress=None) -> Verdict:
    """Race ``impls`` on one band. ``progress(phase, impl_id[, allowance_s])`` is called
    before each candidate's first call (when it declares one: ``OpImpl.first_call_s``), its parity check and
    warm-up and before the interleaved race, so a supervising process knows which
    candidate was running if this one dies (see ``tune/worker.py``). Every call is made
    inside ``workload_dims(dims)``: a candidate that builds for the served model's sizes
    (``native.vllm``) reads the rows per token there."""
    with workload_dims(dims):
        return _race(op_name, dims, dtype, band, impls, settings, progress)


def _race(op_name, dims, dtype, band, impls, settings, progress) -> Verdict:
    spec = get_op(op_name)
    cap = torch.cuda.get_device_capability() if settings.device == "cuda" else None
    ctx = QualifyContext(settings.device, dtype, cap)
    # inputs, the reference and one clone per candidate must fit; a band that cannot is
    # refused for every candidate instead of crashing the calibration
    need = spec.bytes_moved(band.tokens, dims, dtype) * (len(impls) + 4)
    free = _free_memory(settings.device)
    if need > free * 0.8:
        why = (f"band needs about {need / 2**30:.1f} GiB for inputs and copies; "
               f"{free / 2**30:.1f} GiB free on {settings.device}")
        return Verdict([Outcome(i, "refused", why) for i in impls], None, None, why,
                       spec.bytes_moved(band.tokens, dims, dtype))
    gen = torch.Generator().manual_seed(settings.seed)
    args = spec.make_inputs(band.tokens, dims, dtype, settings.device, gen)
    ref = parity.reference_outputs(spec, args)
    outcomes, passing, failing = [], [], []
    for impl in impls:
        # a candidate that declares it cannot take these arguments (layout, sizes, dtype
        # mix: ``OpImpl.supports_args``) is unqualified here, never run and judged wrong
        why = impl.qualify(ctx) or impl.unsupported(args)
        if why is not None:
            outcomes.append(Outcome(impl, "unqualified", why))
            continue
        if impl.first_call_s:
            # the build or autotune happens here, untimed, under its own allowance
            # (``OpImpl.first_call_s``); a build that fails is refused with its own error
            # (parity would rebuild it under the hang timeout and call that a hang)
            if progress:
                progress("first_call", impl.impl_id, impl.first_call_s)
            try:
                impl.fn(*clone_args(args))
                if settings.device == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:      # noqa: BLE001 (recorded: the candidate's outcome)
                outcomes.append(Outcome(impl, "refused", f"raised in its first call: "
                                                         f"{type(e).__name__}: {e}"))
                continue
        if progress:
            progress("parity", impl.impl_id)
        # parity on the tidy inputs, then on the layouts vLLM passes in serving (strided
        # views, padded rows, mixed dtypes: ``ops/layouts.py``), checked once per shape
        p = parity.check_candidate(spec, impl, args, dims, dtype, reference=ref,
                                   floor=settings.parity_floor)
        # the call the race will time, where it is not fn (OpImpl.timed), computes the op too
        pt = parity.check_timed(spec, impl, args, dtype, reference=ref,
                                floor=settings.parity_floor) if p.passed else None
        if pt is not None and not pt.passed:
            p = pt
            p.reason = f"its timed path (OpImpl.timed): {pt.reason}"
        if p.reason and p.reason.startswith("raised"):
            outcomes.append(Outcome(impl, "refused", p.reason, p))
        elif not p.passed:
            o = Outcome(impl, "parity_failed", p.reason, p)
            outcomes.append(o)
            if settings.time_failing:
                failing.append(o)
        else:
            o = Outcome(impl, "timed", None, p)
            outcomes.append(o)
            passing.append(o)
    del ref
    cold, eager = timing_mode(band, settings)
    copies = _cold_weight_copies(spec, args, settings, graph_timed=not (cold or eager),
                                 candidates=len(passing) + len(failing))
    calls = {}
    for o in passing + failing:
        own = clone_args(args)
        fn = o.impl.timed or o.impl.fn
        calls[o.impl.impl_id] = (cold_weights.rotating_call(fn, own, spec.step_cold_args,
                                                            copies) if copies > 1
                                 else (lambda fn=fn, a=own: fn(*a)))
    # with copies, the graph holds every copy the same number of times (a multiple of
    # them): a replay's last calls are followed by the next replay's first, and only whole
    # cycles keep n - 1 other copies between two uses of one
    graph_calls = (copies * math.ceil(settings.graph_calls / copies) if copies > 1
                   else settings.graph_calls)
    extra = ({"cold_weight_copies": copies,
              "cold_weight_l2_span": round(cold_weights.l2_span(
                  copies, cold_weights.cold_bytes(args, spec.step_cold_args),
                  cold_weights.l2_bytes(settings.device)), 2)} if copies > 1 else None)
    times = timing.time_candidates(calls, settings.device, reps=settings.reps,
                                   budget_s=settings.budget_s, graph_calls=graph_calls,
                                   cold_l2=cold, eager=eager, timer_extra=extra,
                                   progress=progress) if calls else {}
    timed = []
    for o in passing:
        t = times.get(o.impl.impl_id)
        if isinstance(t, timing.Timing):
            o.timing = t
            timed.append(o)
        else:
            o.outcome, o.reason = "refused", f"raised while timing: {type(t).__name__}: {t}"
    for o in failing:
        t = times.get(o.impl.impl_id)
        if isinstance(t, timing.Timing):
            o.timing = t
        else:
            o.outcome, o.reason = "refused", f"raised while timing: {type(t).__name__}: {t}"
    winner, runner_up, reason = pick_winner(timed, settings.margin)
    return Verdict(outcomes, winner, runner_up, reason,
                   spec.bytes_moved(band.tokens, dims, dtype))


