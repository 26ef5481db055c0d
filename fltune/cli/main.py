"""The ``fltune`` command: one verb per stage of the data flow.

  candidates   every op x candidate on this machine: qualified or why not; the FL pick
  calibrate    model -> workload -> adjudication -> calibration DB
  freeze       DB -> frozen manifest (fingerprinted)
  report       rich tables (or --json) of what won where, against the fixed FL order
  devices      the device keys a DB holds
  serve        vLLM with a calibrated DB (freeze for this device, then exec vLLM's server)
  bench        manifest pick vs fixed FL order vs each backend vs oracle, measured now
               (``--e2e``: vLLM end to end, arms alternated, ratio to vanilla with a CI)
  adjudicate   route or leave native, per op, by the model's measured step time
  verify       re-measure a DB's winners; exit 1 when it is stale
  refine       bisect the crossover between neighbouring bands' winners into the DB
  diff         two DBs (or two devices of one) side by side
  merge        several DBs into one fleet DB; every conflict resolved by a stated rule

Each ``cmd_*`` is a thin driver: it calls the stage that does the work, which returns a
document (a dict); ``--json`` prints that document, otherwise ``cli/render.py`` (the only
module that imports rich) draws it.
Errors that are the user's to fix (unknown model, bad DB, bad policy) print one line naming
the problem and the way out, and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys

from ..store import DEFAULT_DB
from ..util import write_json_atomic


def _console(quiet=False):
    from .render import err_console
    return err_console(quiet)


class UsageError(ValueError):
    """An argument that parses but cannot be used on this machine; one line, exit 2."""


class Interrupted(Exception):
    """Ctrl-C during a command: the one line to print (what was saved, how to go on)."""


#: exit status after Ctrl-C (128 + SIGINT), as a shell reports a process it interrupted
EXIT_INTERRUPTED = 130


def _interruptible(what):
    """Run ``what()``; a Ctrl-C becomes :class:`Interrupted` with the line
    ``note()`` returns (a zero-argument callable: the counts are read when it happens)."""
    def wrap(fn, note):
        try:
            return fn()
        except KeyboardInterrupt:
            raise Interrupted(note()) from None
    return wrap(*what)


def _device(a) -> str:
    import torch
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device cuda: this machine has no usable CUDA device (torch "
                         f"{torch.__version__}); use --device cpu or leave --device out")
    return a.device or ("cuda" if torch.cuda.is_available() else "cpu")


# ---- argument types: a bad value is refused by argparse (exit 2, one line naming the
# argument and the valid range) before any work starts or any file is touched ------------

#: the largest --max-tokens band edge accepted (1M tokens) and the most --reps
MAX_TOKENS_LIMIT = 1 << 20
MAX_REPS = 1_000_000


def _number(kind, s: str):
    """``int(s)`` or ``float(s)`` of an ASCII spelling only: Python also reads other
    scripts' digits ('١٢' is 12), which a flag's value should not be taken as
    (found by tests/test_cli_properties.py)."""
    if not s.isascii():
        raise ValueError(f"not an ASCII number: {s!r}")
    return kind(s)


def _int(s: str) -> int:
    """An integer flag whose range is checked later (``--tp``: against the model)."""
    try:
        return _number(int, s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None


def _int_in(lo, hi):
    def parse(s):
        try:
            v = _number(int, s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {s!r}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"{v} is out of range [{lo}, {hi}]")
        return v
    return parse


def _float_in(lo, hi=None, lo_open=False):
    rng = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}{')' if hi is None else ']'}"

    def parse(s):
        import math
        try:
            v = _number(float, s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {rng}, got {s!r}")
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{s!r} is out of range {rng}")
        return v
    return parse


def _dtype_arg(s):
    from ..ops import dtype_from_name
    try:
        dtype_from_name(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return s


def _op_arg(s):
    from ..ops import OPS
    if s not in OPS:
        raise argparse.ArgumentTypeError(f"unknown op {s!r}; ops: {', '.join(OPS)}")
    return s


def _ops_arg(s):
    """A comma-separated list of known op names; returned normalized (no blanks, no repeats)."""
    from ..ops import OPS
    names = list(dict.fromkeys(n.strip() for n in s.split(",") if n.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"no op names in {s!r}; ops: {', '.join(OPS)}")
    unknown = [n for n in names if n not in OPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown op {', '.join(map(repr, unknown))}; ops: "
                                         f"{', '.join(OPS)}")
    return ",".join(names)


def _probe_gate(v: str) -> float:
    try:
        f = _number(float, v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None
    if f != 0 and not f > 1:
        raise argparse.ArgumentTypeError(f"0 (off) or a factor above 1, got {v}")
    return f


def _out_arg(s):
    """A file to write: not a directory, in a directory that exists (checked before the work,
    so a long bench or verify does not end in an unwritable path)."""
    import os
    if not s:
        raise argparse.ArgumentTypeError("empty path")
    if os.path.isdir(s):
        raise argparse.ArgumentTypeError(f"{s} is a directory; name a file to write")
    parent = os.path.dirname(os.path.abspath(s))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"directory {parent} does not exist")
    return s


def cmd_candidates(a) -> int:
    import torch

    from ..dispatch.manager import get_default_manager
    from ..dispatch.policy import fl_pick
    from ..dispatch.types import QualifyContext
    from ..ops import OPS, dtype_from_name

    m = get_default_manager()
    dt = dtype_from_name(a.dtype)
    dev = _device(a)
    ctx = QualifyContext(dev, dt, torch.cuda.get_device_capability() if dev == "cuda" else None)
    out = []
    for op in OPS:
        ordered = m.policy.order(op, m.registry.get_implementations(op))
        cands = [{"impl_id": i.impl_id, "backend": i.backend, "kind": i.kind.value,
                  "vendor": i.vendor, "priority": i.priority, "qualified": (r := i.qualify(ctx)) is None,
                  "reason": r, "callable": i.callable_path} for i in ordered]
        qual = {c["impl_id"]: "qualified" if c["qualified"] else "unqualified" for c in cands}
        fl, _ = fl_pick(m.policy, op, ordered, qual.get)
        out.append({"op": op, "fl_pick": fl, "candidates": cands,
                    "qualified": sum(c["qualified"] for c in cands)})
    doc = {"device": dev, "dtype": a.dtype, "policy": m.policy.to_dict(), "ops": out,
           "discovery": {"loaded": m.discovery.loaded, "failed": m.discovery.failed}}
    if a.json:
        print(json.dumps(doc, indent=1))
        return 0
    from .render import render_candidates
    render_candidates(doc, m.policy.prefer, wide=a.wide)
    return 0


def _group(kw) -> str:
    """What a progress line is about: the op and its shape (and dtype) when known."""
    sig = kw.get("signature")
    return f"{kw['op']} [{sig}] {kw.get('dtype') or ''}".rstrip() if sig else kw["op"]


class _BandProgress:
    """The progress callback of a calibration (one process or ``--ray``): a bar over the
    workload's bands, a line per band (its winner, or "cached"), and the count of bands
    saved, for the Ctrl-C line. ``on_start(**kw)`` prints what a variant adds at start."""

    def __init__(self, prog, title: str, on_start=None):
        self.prog, self.title, self.on_start = prog, title, on_start
        self.task = None
        self.saved = 0

    def __call__(self, event, **kw):
        if event == "start":
            self.task = self.prog.add_task(self.title, total=kw["total"])
            if self.on_start:
                self.on_start(**kw)
        elif event in ("band", "skip"):
            self.saved += event == "band"
            w = kw.get("winner")
            desc = f"{kw['op']} ≤{kw['band'].hi}" + (f" → {w['impl_id']}" if w else
                                                     (" (cached)" if event == "skip" else ""))
            self.prog.update(self.task, advance=1, description=desc, group=_group(kw),
                             group_done=kw.get("last", False))

    def interrupted(self) -> str:
        return f"interrupted: {self.saved} bands saved; rerun the same command to resume"


def cmd_calibrate(a) -> int:
    if getattr(a, "ray", None) is not None:
        return cmd_calibrate_ray(a)
    _no_ray_options(a)
    from ..store.hints import freeze_command
    from ..tune.calibrate import calibrate
    from ..tune.race import Settings
    from .render import progress_bar

    dev = _device(a)
    settings = Settings(device=dev, parity_floor=a.parity_floor, margin=a.margin,
                        cold_l2=a.cold_l2, cold_weights=a.cold_weights, reps=a.reps,
                        budget_s=a.budget)
    con = _console(a.quiet or a.json)
    prog = progress_bar(con, "calibrate", a.quiet or a.json)
    progress = _BandProgress(prog, a.model)

    def run():
        with prog:
            return calibrate(a.model, a.db, tp=a.tp, dtype=a.dtype, max_tokens=a.max_tokens,
                             settings=settings, ops=a.ops.split(",") if a.ops else None,
                             force=a.force, progress=progress, isolate=a.isolate,
                             candidate_timeout=a.candidate_timeout)

    res = _interruptible((run, progress.interrupted))
    if a.json:
        print(json.dumps(res.as_dict(), indent=1))
    else:
        con.print(f"calibrated {res.workload.model} on {res.device['name']}: "
                  f"{res.measured} bands measured, {res.skipped} already in the DB, "
                  f"{res.wall_s:.1f} s → {res.db_path}")
        db = shlex.quote(str(res.db_path))
        con.print(f"next: `fltune report --db {db}` (what won where), then "
                  f"`{freeze_command(res.db_path)}` (the manifest the vLLM plugin serves)")
    return 0


def cmd_freeze(a) -> int:
    from ..dispatch.manager import get_default_manager
    from ..dispatch.policy import SelectionPolicy
    from ..freeze import build_manifest, write_manifest

    manifest, warnings = build_manifest(a.db, device=a.device, strict=a.strict,
                                        policy=SelectionPolicy.from_env(),
                                        registry=get_default_manager().registry,
                                        order=a.order)
    con = _console(a.json)
    for w in warnings:
        con.print(f"[yellow]warning:[/] {w}")
    write_manifest(manifest, a.out)
    if a.json:
        print(json.dumps({"out": a.out, "fingerprint": manifest["fingerprint"],
                          "warnings": warnings, "ops": sorted(manifest["ops"])}))
    else:
        con.print(f"froze {len(manifest['ops'])} ops for {manifest['device']['name']} → {a.out}\n"
                  f"fingerprint {manifest['fingerprint']}")
    return 0


def cmd_report(a) -> int:
    from ..dispatch.policy import SelectionPolicy
    from ..evaluate import report
    from .render import render_report

    rep = report.build(a.db, device=a.device, op=a.op, policy=SelectionPolicy.from_env())
    if a.json:
        print(json.dumps(rep, indent=1, default=str))
    else:
        render_report(rep, wide=a.wide)
    return 0


def cmd_devices(a) -> int:
    from ..store import CalibrationDB
    db = CalibrationDB(a.db, create=False)
    rows = db.devices()
    db.close()
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    from .render import render_devices
    render_devices(rows, a.db)
    return 0


def cmd_serve(a) -> int:
    try:
        from ..integrations.vllm.serve import serve
    except ImportError as e:
        print(f"fltune: error: the vLLM integration is not available ({e})", file=sys.stderr)
        return 2
    args = a.vllm_args[1:] if a.vllm_args[:1] == ["--"] else a.vllm_args
    return serve(a.db or a.manifest, strict=a.strict, vllm_args=args)


def _progress(con, title, disabled, unit="bands"):
    from .render import progress_bar
    return progress_bar(con, title, disabled, unit)


def _measured_only(cmd: str):
    return lambda: (f"interrupted: nothing saved ({cmd} writes no DB); rerun the same "
                    f"command to start again")


def _write_json(doc, out):
    if out:
        write_json_atomic(out, doc, indent=1, default=str)


def cmd_bench(a) -> int:
    if a.e2e:
        return cmd_bench_e2e(a)
    from ..evaluate import bench
    from .render import render_bench

    if a.out is not None:
        try:
            _out_arg(a.out)
        except argparse.ArgumentTypeError as e:
            raise UsageError(f"argument --out: {e}") from None
    for flag_, v in (("--arm", a.arm), ("--scenarios", a.scenarios), ("--warmup", a.warmup),
                     ("--engine", a.engine), ("--engine-process", a.engine_process),
                     ("--pinning", a.pinning), ("--probe-gate", a.probe_gate),
                     ("--time-limit", a.time_limit), ("--start-state", a.start_state),
                     ("--inner", a.inner), ("--prefill-inner", a.prefill_inner),
                     ("--interleave", a.interleave), ("--procs", a.procs),
                     ("--generations", a.generations)):
        if v is not None:
            raise UsageError(f"{flag_} belongs to `fltune bench --e2e`")
    a.db = a.db or DEFAULT_DB
    dev = _device(a)
    settings = bench.BenchSettings(device=dev, reps=a.reps, budget_s=a.budget,
                                   cold_l2=a.cold_l2, copy_mib=a.copy_mib)
    con = _console(a.quiet or a.json)
    prog = _progress(con, "bench", a.quiet or a.json)
    task = None

    def progress(event, **kw):
        nonlocal task
        if event == "start":
            task = prog.add_task(a.model, total=kw["total"])
        else:
            prog.update(task, advance=1, description=f"{kw['op']} ≤{kw['band'].hi}",
                        group=_group({**(kw.get("record") or {}), "op": kw["op"]}))

    def run():
        with prog:
            return bench.run_bench(a.model, a.db, tp=a.tp, dtype=a.dtype,
                                   max_tokens=a.max_tokens, settings=settings,
                                   ops=a.ops.split(",") if a.ops else None,
                                   device=a.db_device, isolate=a.isolate,
                                   candidate_timeout=a.candidate_timeout, progress=progress)

    doc = _interruptible((run, _measured_only("bench")))
    _write_json(doc, a.out)
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_bench(doc)
        if a.out:
            con.print(f"wrote {a.out}")
    return 0


def _command_line(a) -> str:
    """The command as the user typed it, for the documents that record their provenance."""
    argv = getattr(a, "argv", None)
    return "fltune " + shlex.join(argv if argv is not None else sys.argv[1:])


def _engine_json(a):
    """``--engine JSON`` as a dict (None when not given), or a usage error naming it."""
    if not a.engine:
        return None
    try:
        engine = json.loads(a.engine)
    except ValueError:
        engine = None
    if not isinstance(engine, dict):
        raise UsageError(f"--engine: expected a JSON object, got {a.engine!r}")
    return engine


def _e2e_scenarios(a, dev: str):
    """``--scenarios`` parsed for the device, or None for the device's defaults."""
    from ..evaluate import e2e

    if not a.scenarios:
        return None
    try:
        return e2e.scenarios_by_name([n.strip() for n in a.scenarios.split(",")
                                      if n.strip()], dev)
    except ValueError as e:
        raise UsageError(f"--scenarios: {e}") from None


def _served_picks(model: str, arms: list, engine) -> tuple:
    """``engine_pick.apply_served_picks`` for the model's key (as vLLM will be given it:
    the instrument's one model path per config), each note printed."""
    from ..dispatch.manifest import model_key
    from ..evaluate import e2e, engine_pick
    from ..evaluate.model_dir import config_of, stable_model_dir

    if not any(engine_pick.serves_from(x) for x in arms):
        return arms, []
    key = model_key(config_of(stable_model_dir(model)), tp=e2e.engine_tp(engine))
    arms, notes = engine_pick.apply_served_picks(arms, key, engine)
    for n in notes:
        print(f"fltune bench: {n}", file=sys.stderr, flush=True)
    return arms, notes


def cmd_bench_e2e(a) -> int:
    """`fltune bench --e2e`: vLLM arms in separate processes, alternated, ratio to vanilla
    with a bootstrap CI per scenario (evaluate/e2e.py)."""
    import os

    from ..evaluate import e2e
    from .render import render_e2e

    dev = _device(a)
    try:
        arms = [e2e.parse_arm(x) for x in (a.arm or [])]
    except ValueError as e:
        raise UsageError(f"--arm: {e}") from None
    if not arms:
        arms = [e2e.Arm("vanilla", {}), e2e.Arm("aa", {})]
        if a.db:
            arms.append(e2e.Arm("calibrated", {"FLTUNE_DB": os.path.abspath(a.db)}))
    if a.baseline not in [x.name for x in arms]:
        arms.insert(0, e2e.Arm(a.baseline, {}))
    names = [x.name for x in arms]
    if len(set(names)) != len(names):
        raise UsageError(f"--arm: arm names must be unique, got {', '.join(names)}")
    for x in arms:
        for k in ("FLTUNE_DB", "FLTUNE_MANIFEST"):
            if k in x.env and not os.path.isfile(x.env[k]):
                raise UsageError(f"--arm {x.name}: {x.env[k]} does not exist")
    scenarios = _e2e_scenarios(a, dev) or e2e.default_scenarios(dev)
    engine = _engine_json(a)
    if a.out and os.path.isfile(a.out):
        raise UsageError(f"--out {a.out}: with --e2e, --out names a directory")
    # an arm db:/manifest: stands for `fltune serve`: it gets the engine-wide picks serve adds
    arms, served_notes = _served_picks(a.model, arms, engine)
    reps = a.reps or 10
    if a.generations and a.generations > reps:
        raise UsageError(f"--generations {a.generations} is more than --reps {reps}: each "
                         f"generation measures at least one repetition; raise --reps or "
                         f"lower --generations")
    warmup = 2 if a.warmup is None else a.warmup
    con = _console(a.quiet or a.json)

    def progress(event, **kw):
        if event == "starting":
            con.print(f"starting arm {kw['arm']} ...")
        elif event == "started" and not kw["ok"]:
            con.print(f"[yellow]arm {kw['arm']} did not start:[/] {kw['error']}")
        elif event == "rep":
            n = ("" if kw.get("generation") else f" {kw['rep'] + 1}") if kw["warmup"] \
                else f" {kw['measured_rep'] + 1}"
            con.print(f"{'warm-up' if kw['warmup'] else 'rep'}{n} {kw['scenario']}"
                      + (f" (generation {kw['generation'] + 1})" if kw.get("generation") else ""))
        elif event == "generation":
            con.print(f"generation {kw['generation'] + 1}: every worker started again"
                      + (f"; [yellow]did not start:[/] {', '.join(kw['failed'])}"
                         if kw["failed"] else ""))
        elif event == "profiled":
            con.print(f"kernel profile round {kw.get('round', 0) + 1} {kw['scenario']}")
        elif event == "host_profiled":
            con.print(f"host profile {kw['scenario']}")
        elif event == "time_limit":
            con.print(f"[yellow]time limit:[/] {kw['reps_done']} of {kw['reps']} repetitions "
                      "measured, then the kernel profile")

    def run():
        try:
            return _run_e2e()
        except e2e.RunConfigError as e:     # before any engine started: a usage error
            raise UsageError(f"bench --e2e: {e}") from None

    def _run_e2e():
        return e2e.run_e2e(a.model, arms, scenarios, reps=reps, warmup=warmup,
                           baseline=a.baseline, engine=engine, kernel_profile=a.kernel_profile,
                           out_dir=a.out, progress=progress, device_type=dev,
                           engine_process=a.engine_process or "in-process",
                           pinning=a.pinning, probe_gate=a.probe_gate,
                           time_limit_s=a.time_limit, host_profile=a.host_profile,
                           start_state=a.start_state, inner=a.inner,
                           prefill_inner=a.prefill_inner, interleave=a.interleave,
                           procs=a.procs, generations=a.generations,
                           extra_notes=served_notes)

    if a.kernel_profile and a.engine_process == "multiprocess":
        raise UsageError("--kernel-profile needs --engine-process in-process: the multiprocess "
                         "engine runs the kernels outside the arm's profiler")
    res = _interruptible((run, _measured_only("bench --e2e")))
    device = res.device_name
    if device is None:
        from ..store import device as devmod
        device = devmod.current(dev).get("name", dev)
    command = _command_line(a)
    doc = res.to_summary(device=device, model=a.model, vllm=res.vllm_version or "?",
                         command=command)
    from ..evaluate.model_step import read_against_aa
    doc["against_aa"] = read_against_aa(doc)
    if a.out:
        _write_json(doc, os.path.join(a.out, "e2e-summary.json"))
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_e2e(doc)
        if a.out:
            con.print(f"wrote {os.path.join(a.out, 'e2e-summary.json')} and e2e-raw.json")
    return 0 if doc["points"] else 1


def _compile_aa(a):
    """--compile-aa auto|on|off|N -> None (the stage decides by device) | True | False | N
    (that many draws, ``model_step.compile_aa_draws``)."""
    v = getattr(a, "compile_aa", "auto")
    return {"auto": None, "on": True, "off": False}.get(v, v)


def _compile_aa_arg(text: str):
    """argparse type of --compile-aa: auto, on, off, or a number of draws (0 = off)."""
    if text in ("auto", "on", "off"):
        return text
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected auto, on, off or a number of draws "
                                         f"(0, 1, 2, ...), got {text!r}")
    return n


def cmd_adjudicate(a) -> int:
    """`fltune adjudicate`: per op the DB would route for the model, one vLLM arm routing it
    alone against vanilla (evaluate/model_step.py); decisions stored in the DB."""
    if a.engine_choice or a.list_values:
        return cmd_adjudicate_engine(a)
    import os

    from ..evaluate import model_step
    from ..integrations.vllm.linear_seam import SEAMED_OPS as LINEAR_SEAMED
    from ..integrations.vllm.ops import SEAMED_OPS
    from .render import render_adjudication

    # every arm, vanilla included (e.g. vLLM's compile ranges at the edges the linear
    # lowering needs: `fltune serve` prints them)
    engine = _engine_json(a)
    dev = _device(a)
    if not os.path.isfile(a.db):
        raise UsageError(f"--db {a.db} does not exist: calibrate first "
                         f"(fltune calibrate --model {a.model} --db {a.db})")
    scenarios = _e2e_scenarios(a, dev)
    per_range = None
    if a.per_range is not None:
        try:
            per_range = model_step.parse_range_edges(a.per_range)
        except ValueError as e:
            raise UsageError(str(e)) from None
    con = _console(a.quiet or a.json)
    command = _command_line(a)

    def progress(event, **kw):
        if event == "starting":
            con.print(f"starting arm {kw['arm']} ...")
        elif event == "rep":
            con.print(f"{'warm-up' if kw['warmup'] else 'rep'} {kw['rep'] + 1} {kw['scenario']}")

    def run():
        return model_step.adjudicate(a.db, a.model, device=a.db_device, scenarios=scenarios,
                                     reps=a.reps, warmup=a.warmup,
                                     ops=a.ops.split(",") if a.ops else None,
                                     seamed=SEAMED_OPS | LINEAR_SEAMED, out_dir=a.out,
                                     progress=progress, engine=engine,
                                     command=command, per_range=per_range,
                                     compile_aa=_compile_aa(a),
                                     confirm={"auto": None, "on": True, "off": False}[
                                         getattr(a, "confirm", "auto")])

    from ..evaluate.e2e import RunConfigError
    try:
        doc = _interruptible((run, _measured_only("adjudicate")))
    except RunConfigError as e:     # an FLTUNE_E2E_* setting, before any engine started
        raise UsageError(f"adjudicate: {e}") from None
    if a.out:
        os.makedirs(a.out, exist_ok=True)     # no e2e run (all native) created it
        _write_json(doc, os.path.join(a.out, "adjudication.json"))
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_adjudication(doc)
    return 0


def cmd_adjudicate_engine(a) -> int:
    """`fltune adjudicate --engine-choice NAME[=V1,V2]`: one vLLM arm per value of an
    engine-wide setting against vLLM's own default (evaluate/engine_pick.py); the pick is
    stored in the DB. With --list-values: what this vLLM offers here, nothing measured."""
    import os

    from ..evaluate import engine_pick
    from .render import render_engine_adjudication, render_engine_listing

    dev = _device(a)
    for flag_, v in (("--ops", a.ops), ("--db-device", a.db_device)):
        if v is not None:
            raise UsageError(f"{flag_} belongs to the per-op adjudication, not --engine-choice "
                             f"(engine picks are measured on this machine)")
    try:
        specs = [engine_pick.parse_choice_spec(x) for x in (a.engine_choice or [])]
    except ValueError as e:
        raise UsageError(f"--engine-choice: {e}") from None
    if a.list_values:
        names = [n for n, _ in specs] or list(engine_pick.CHOICES)
        docs = [engine_pick.available(n, a.model, dev).to_json() for n in names]
        if a.json:
            print(json.dumps({"listings": docs}, indent=1, default=str))
        else:
            render_engine_listing(docs)
        return 0
    if not os.path.isfile(a.db):
        raise UsageError(f"--db {a.db} does not exist: calibrate first "
                         f"(fltune calibrate --model {a.model} --db {a.db})")
    engine = _engine_json(a)
    scenarios = _e2e_scenarios(a, dev)
    con = _console(a.quiet or a.json)
    command = _command_line(a)

    def progress(event, **kw):
        if event == "starting":
            con.print(f"starting arm {kw['arm']} ...")
        elif event == "started" and not kw.get("ok", True):
            con.print(f"[yellow]arm {kw['arm']} did not start:[/] {kw.get('error')}")
        elif event == "rep":
            con.print(f"{'warm-up' if kw['warmup'] else 'rep'} {kw['rep'] + 1} {kw['scenario']}")

    docs = []
    for name, values in specs:
        out = os.path.join(a.out, name) if a.out else None

        def run():
            return engine_pick.adjudicate_engine(
                a.db, a.model, name, values, device_type=dev, scenarios=scenarios,
                reps=a.reps, warmup=a.warmup, engine=engine, out_dir=out, progress=progress,
                command=command, compile_aa=_compile_aa(a), on_picks=not a.alone)
        try:
            doc = _interruptible((run, _measured_only("adjudicate --engine-choice")))
        except ValueError as e:
            raise UsageError(f"--engine-choice {name}: {e}") from None
        if out:
            os.makedirs(out, exist_ok=True)
            _write_json(doc, os.path.join(out, "engine-pick.json"))
        docs.append(doc)
        if not a.json:
            render_engine_adjudication(doc)
    if a.json:
        print(json.dumps({"engine_picks": docs}, indent=1, default=str))
    return 0


def cmd_verify(a) -> int:
    if getattr(a, "ray", None) is not None:
        return cmd_verify_ray(a)
    from ..evaluate import verify
    from .render import render_verify

    con = _console(a.quiet or a.json)
    prog = _progress(con, "verify", a.quiet or a.json)
    task = None

    def progress(event, **kw):
        nonlocal task
        if event == "start":
            task = prog.add_task(a.db, total=kw["total"])
        else:
            r = kw["record"]
            prog.update(task, advance=1, description=f"{r['op']} ≤{r['band_hi']}: {r['status']}",
                        group=_group(r))

    def run():
        with prog:
            return verify.run_verify(a.db, device=a.device,
                                     ops=a.ops.split(",") if a.ops else None,
                                     noise_floor=a.noise_floor, reps=a.reps, budget_s=a.budget,
                                     isolate=a.isolate, candidate_timeout=a.candidate_timeout,
                                     progress=progress)

    doc = _interruptible((run, _measured_only("verify")))
    _write_json(doc, a.out)
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_verify(doc, all_bands=a.all)
    return 1 if doc["stale"] else 0


def cmd_refine(a) -> int:
    from ..tune import crossover
    from .render import render_refine

    con = _console(a.quiet or a.json)
    prog = _progress(con, "refine", a.quiet or a.json, unit="pairs")
    task = None
    saved = 0

    def progress(event, **kw):
        nonlocal task, saved
        if event == "start":
            task = prog.add_task(a.db, total=kw["total"])
        elif event == "probe":
            prog.update(task, description=f"{kw['op']} @{kw['tokens']} tokens")
        elif event == "pair":
            r = kw["record"]
            saved += r["status"] == "refined"
            prog.update(task, advance=1, description=f"{r['op']} ≤{r['lower_hi']}|≤{r['upper_hi']}: "
                                                     f"{r['status']}",
                        group=f"{_group(r)} ≤{r['lower_hi']}|≤{r['upper_hi']} {r['status']}",
                        group_done=True)

    def run():
        with prog:
            return crossover.refine(a.db, device=a.device,
                                    ops=a.ops.split(",") if a.ops else None, model=a.model,
                                    force=a.force, max_probes=a.max_probes, isolate=a.isolate,
                                    candidate_timeout=a.candidate_timeout, progress=progress)

    doc = _interruptible((run, lambda: f"interrupted: {saved} crossovers saved; rerun the "
                                       f"same command to resume"))
    _write_json(doc, a.out)
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_refine(doc)
    return 0


def cmd_diff(a) -> int:
    from ..evaluate import diff
    from .render import render_diff

    doc = diff.run_diff(a.a, a.b, device_a=a.device_a, device_b=a.device_b,
                        threshold=a.threshold)
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_diff(doc, all_bands=a.all, wide=a.wide)
    return 0


def cmd_merge(a) -> int:
    """`fltune merge A.db B.db ... -o fleet.db` (store/merge.py)."""
    from ..store.merge import merge
    from .render import render_merge

    doc = merge(a.inputs, a.out).as_dict()
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        render_merge(doc)
    return 0


# ---- --ray (tune/ray_calibrate.py): Ray is an optional extra, imported only here --------

def _ray_args(c, calibrate: bool) -> None:
    """``--ray [ADDRESS]`` (and, for calibrate, ``--ray-actors`` and ``--ray-spread-every``).
    Ray is imported only when ``--ray`` is given, so without it installed every command
    works as before and ``--ray`` says how to install it."""
    g = c.add_argument_group("many GPUs (Ray; pip install 'fltune[ray]')")
    what = ("one calibrating actor per GPU of the cluster (num_gpus=1; on a cluster without "
            "GPUs, or with --device cpu, one num_cpus=1 actor per node); GPUs of one device "
            "key share the work, the DB is written here" if calibrate else
            "re-time the winners on every node of the cluster (one GPU, or one CPU, each) "
            "and name the nodes that drifted")
    g.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help=f"{what}. ADDRESS: none (RAY_ADDRESS, else the cluster running on this "
                        f"host, else a new local one), auto (an existing cluster only), "
                        f"HOST:PORT (the head's GCS port) or ray://HOST:PORT")
    if calibrate:
        g.add_argument("--ray-actors", type=_int_in(1, 4096),
                       help="with --ray: how many actors (default: one per GPU; on CPU one "
                            "per node)")
        g.add_argument("--ray-spread-every", type=_int_in(0, 1 << 20), default=None,
                       help="with --ray: every Nth band of each table is raced again on a "
                            "second GPU of its kind and the spread stored as noise (default "
                            "4; 0: none)")


def _no_ray_options(a) -> None:
    for flag_, v in (("--ray-actors", getattr(a, "ray_actors", None)),
                     ("--ray-spread-every", getattr(a, "ray_spread_every", None))):
        if v is not None:
            raise UsageError(f"{flag_} belongs to --ray (add --ray [ADDRESS], or leave "
                             f"{flag_} out)")


def cmd_calibrate_ray(a) -> int:
    """`fltune calibrate --ray [ADDRESS]`: the workload measured by one actor per GPU of a
    Ray cluster, written here into the one DB (tune/ray_calibrate.py)."""
    from ..store.hints import freeze_command
    from ..tune import ray_calibrate as rc
    from ..tune.race import Settings

    try:
        rc.import_ray()
    except rc.RayError as e:
        raise UsageError(str(e)) from None
    settings = Settings(parity_floor=a.parity_floor, margin=a.margin, cold_l2=a.cold_l2,
                        cold_weights=a.cold_weights, reps=a.reps, budget_s=a.budget)
    con = _console(a.quiet or a.json)
    prog = _progress(con, "calibrate --ray", a.quiet or a.json)
    progress = _BandProgress(prog, a.model, on_start=lambda **kw: con.print(
        f"{len(kw['places'])} actors: {', '.join(kw['places'])}"))

    def run():
        with prog:
            return rc.calibrate_ray(
                a.model, a.db, address=None if a.ray == "local" else a.ray, device=a.device,
                actors=a.ray_actors, tp=a.tp, dtype=a.dtype, max_tokens=a.max_tokens,
                settings=settings, ops=a.ops.split(",") if a.ops else None, force=a.force,
                isolate=a.isolate, candidate_timeout=a.candidate_timeout,
                spread_every=rc.SPREAD_EVERY if a.ray_spread_every is None
                else a.ray_spread_every, progress=progress,
                warn=lambda line: con.print(line))

    try:
        res = _interruptible((run, progress.interrupted))
    except rc.RayError as e:
        raise UsageError(str(e)) from None
    if a.json:
        print(json.dumps(res.as_dict(), indent=1))
    else:
        for g in res.groups:
            d = g["device"]
            sp = (f"; GPU-to-GPU spread median {g['spread_median']:.1%}, max "
                  f"{g['spread_max']:.1%} over {len(g['spread_samples'])} bands"
                  if g["spread_max"] is not None else "")
            con.print(f"calibrated {res.model} on {d['name']} [{d['device_key']}] driver "
                      f"{d['driver']} ({len(g['actors'])} actors: {', '.join(g['actors'])}): "
                      f"{g['measured']} bands measured, {g['skipped']} already in the DB, "
                      f"{g['missing']} missing{sp}")
        con.print(f"{res.wall_s:.1f} s → {res.db_path}")
        if not res.incomplete:
            db = shlex.quote(str(res.db_path))
            con.print(f"next: `fltune report --db {db}` (what won where), then "
                      f"`{freeze_command(res.db_path)}` (the manifest the vLLM plugin serves)")
    if res.incomplete:
        missing = sum(g["missing"] for g in res.groups)
        con.print(f"incomplete: {missing} bands not measured (every actor of their device "
                  f"died); rerun the same command to resume")
        return 1
    return 0


def cmd_verify_ray(a) -> int:
    """`fltune verify --ray [ADDRESS]`: every node's winners re-timed on that node; names
    the nodes that drifted (tune/ray_calibrate.py)."""
    from ..evaluate import ray_verify
    from ..tune import ray_calibrate as rc
    from .render import render_verify

    if a.device is not None and a.device not in ("cpu", "cuda"):
        raise UsageError(f"--device {a.device!r}: with --ray, --device is the kind of actor "
                         f"(cpu or cuda); every node verifies its own device's winners")
    try:
        rc.import_ray()
        doc = _interruptible((lambda: ray_verify.verify_ray(
            a.db, address=None if a.ray == "local" else a.ray, device=a.device,
            ops=a.ops.split(",") if a.ops else None, noise_floor=a.noise_floor, reps=a.reps,
            budget_s=a.budget, isolate=a.isolate, candidate_timeout=a.candidate_timeout),
            _measured_only("verify --ray")))
    except rc.RayError as e:
        raise UsageError(str(e)) from None
    _write_json(doc, a.out)
    if a.json:
        print(json.dumps(doc, indent=1, default=str))
    else:
        con = _console(a.quiet)
        for node in doc["nodes"]:
            con.print(f"[bold]node {node['node']}[/]: {node['status']}")
            if node.get("db_device"):
                render_verify(node, all_bands=a.all)
            elif node["status"] == "uncalibrated":
                me = node["device"]
                con.print(f"  the DB holds no calibration for its device {me['name']} "
                          f"[{me['device_key']}] driver {me['driver']}; calibrate it with "
                          f"`fltune calibrate --model MODEL --db {shlex.quote(a.db)} --ray`")
            elif node["status"] == "failed":
                con.print(f"  verification failed there: {node.get('error')}")
        if doc["drifted_nodes"]:
            con.print(f"[bold red]drifted nodes[/]: {', '.join(doc['drifted_nodes'])}")
        else:
            con.print(f"[bold green]no node drifted[/] ({len(doc['nodes'])} nodes, "
                      f"{doc['checked']} bands re-measured, {doc['wall_s']:.1f} s)")
        for what in ("uncalibrated_nodes", "failed_nodes", "skipped_nodes"):
            if doc[what]:
                con.print(f"{what.replace('_', ' ')}: {', '.join(doc[what])}")
    return 1 if doc["stale"] else 0


def _isolate_args(c, what: str = "race") -> None:
    """``--no-isolate`` and ``--candidate-timeout``: where the races run (see
    ``tune/worker.py``); the same two flags for calibrate, refine, bench and verify."""
    c.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help=f"{what} in this process instead of a supervised worker (faster start; "
                        "a crashing candidate then ends the run)")
    c.add_argument("--candidate-timeout", type=_float_in(0.0, 86400.0, lo_open=True),
                   default=120.0,
                   help="seconds without progress before a candidate counts as hung "
                        "(default 120)")


MODEL_HELP = ("a built-in profile name (in fltune/profiles, package data: Qwen3.5-0.8B, "
              "Qwen3-0.6B, tiny-qwen3, ...), a model directory or its config.json")
DB_HELP = f"calibration DB (default: {DEFAULT_DB}; FLTUNE_DB_PATH overrides it)"
JSON_HELP = "print the result as a JSON document on stdout instead of tables"
QUIET_HELP = "no progress and no messages on stderr"
WIDE_HELP = "the full table with every column, however wide (default: fit the terminal)"
DB_DEVICE_HELP = ("the DB's device (key prefix or name, optionally @DRIVER; default: this "
                  "machine's)")
OUT_HELP = "also write the JSON document to this file"


def _add_candidates(sub) -> None:
    c = sub.add_parser("candidates", help="every op x candidate on this machine")
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.add_argument("--dtype", default="bf16", type=_dtype_arg,
                   help="dtype to qualify for: bf16 (default), fp16, fp32")
    c.add_argument("--device", choices=["cpu", "cuda"],
                   help="device to qualify for (default: cuda when available, else cpu)")
    c.add_argument("--wide", action="store_true", help=WIDE_HELP)
    c.set_defaults(fn=cmd_candidates)


def _add_calibrate(sub) -> None:
    c = sub.add_parser("calibrate", help="measure a model's workload into the DB")
    c.add_argument("--model", required=True, help=MODEL_HELP)
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--tp", type=_int, default=1, help="tensor-parallel size: per-rank shapes")
    c.add_argument("--dtype", type=_dtype_arg,
                   help="override the config's dtype (bf16, fp16, fp32)")
    c.add_argument("--max-tokens", type=_int_in(1, MAX_TOKENS_LIMIT),
                   help="largest token band (default 16384 on GPU, 2048 on CPU)")
    c.add_argument("--parity-floor", type=_float_in(0.0, 1.0), default=0.99,
                   help="fraction of output elements that must match the reference within "
                        "tolerance (default 0.99)")
    c.add_argument("--margin", type=_float_in(0.0, 1.0), default=0.03,
                   help="win margin: candidates this close to the fastest compete on "
                        "precision (default 0.03)")
    c.add_argument("--cold-l2", action="store_true", help="cold-L2 eager timing above 512 tokens")
    c.add_argument("--cold-weights", action="store_true",
                   help="CUDA decode bands: a GEMM's weight rotated through copies that "
                        "overflow L2, cold as in a model step (tune/cold_weights.py)")
    c.add_argument("--reps", type=_int_in(0, MAX_REPS), default=0,
                   help="timing samples (0 = adaptive)")
    c.add_argument("--budget", type=_float_in(0.0, 3600.0, lo_open=True), default=0.05,
                   help="seconds of timing per candidate when adaptive (default 0.05)")
    c.add_argument("--ops", type=_ops_arg, help="comma-separated subset of ops")
    c.add_argument("--device", choices=["cpu", "cuda"],
                   help="device to calibrate (default: cuda when available, else cpu)")
    c.add_argument("--force", action="store_true", help="re-measure what the DB already has")
    _isolate_args(c)
    _ray_args(c, calibrate=True)
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_calibrate)


def _add_freeze(sub) -> None:
    c = sub.add_parser("freeze", help="DB -> frozen dispatch manifest")
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--out", required=True, type=_out_arg,
                   help="the manifest file to write (JSON, e.g. manifest.json)")
    c.add_argument("--device", help="device key prefix or name (default: this machine)")
    c.add_argument("--strict", action="store_true", help="refuse if the stack changed")
    c.add_argument("--order", choices=["measured", "fl"], default="measured",
                   help="what each band picks: the measured winner (default) or the fixed FL "
                        "order's pick (a baseline manifest for A/B runs)")
    c.add_argument("--json", action="store_true",
                   help="print the output path, fingerprint and warnings as JSON")
    c.set_defaults(fn=cmd_freeze)


def _add_report(sub) -> None:
    c = sub.add_parser("report", help="what won where, against the fixed FL order")
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--device", help=DB_DEVICE_HELP)
    c.add_argument("--op", type=_op_arg, help="only this op's tables")
    c.add_argument("--wide", action="store_true", help=WIDE_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_report)


def _add_devices(sub) -> None:
    c = sub.add_parser("devices", help="device keys held by a DB")
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_devices)


def _add_serve(sub) -> None:
    c = sub.add_parser("serve", help="run vLLM's OpenAI server with a calibrated DB")
    c.add_argument("--db", help="calibration DB to freeze for this device before starting")
    c.add_argument("--manifest", help="a manifest from `fltune freeze` (instead of --db)")
    c.add_argument("--strict", action="store_true",
                   help="refuse to start without a calibration for this device")
    c.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="after --: the arguments of `vllm serve` (e.g. -- --model DIR)")
    c.set_defaults(fn=cmd_serve)


def _add_bench(sub) -> None:
    c = sub.add_parser("bench", help="manifest pick vs fixed FL order vs every backend vs "
                                     "the oracle, measured now")
    c.add_argument("--model", required=True, help=MODEL_HELP)
    c.add_argument("--db", help=DB_HELP + "; with --e2e, adds the arm calibrated=db:DB")
    c.add_argument("--db-device", help="the DB's device row to freeze (key prefix or name; "
                                       "default: this machine's)")
    c.add_argument("--tp", type=_int, default=1, help="tensor-parallel size: per-rank shapes")
    c.add_argument("--dtype", type=_dtype_arg,
                   help="override the config's dtype (bf16, fp16, fp32)")
    c.add_argument("--max-tokens", type=_int_in(1, MAX_TOKENS_LIMIT),
                   help="largest token band (default 16384 on GPU, 2048 on CPU)")
    c.add_argument("--ops", type=_ops_arg, help="comma-separated subset of the workload's ops")
    c.add_argument("--reps", type=_int_in(0, MAX_REPS), default=0,
                   help="timing samples (0 = adaptive); with --e2e, measured repetitions "
                        "(0 = 10)")
    c.add_argument("--budget", type=_float_in(0.0, 3600.0, lo_open=True), default=0.05,
                   help="seconds of timing per candidate when adaptive (default 0.05)")
    c.add_argument("--cold-l2", action="store_true", help="cold-L2 eager timing above 512 tokens")
    c.add_argument("--copy-mib", type=_int_in(1, 1 << 20),
                   help="copy-bandwidth buffer in MiB (default 1024 GPU, 256 CPU)")
    c.add_argument("--device", choices=["cpu", "cuda"],
                   help="device to measure on (default: cuda when available, else cpu)")
    _isolate_args(c, "race")
    e = c.add_argument_group("end to end (--e2e)")
    e.add_argument("--e2e", action="store_true",
                   help="measure vLLM end to end instead: one engine process per arm, arms "
                        "alternated, ratio to vanilla with a 95%% bootstrap CI per scenario")
    e.add_argument("--arm", action="append", metavar="NAME=SPEC",
                   help="SPEC: vanilla | recompiled (vanilla compiled afresh into empty "
                        "caches of its own: a compile A/A) | first-start (the same, "
                        "measured as it compiled: a server's first start) | db:PATH[:ROUTE] | "
                        "manifest:PATH[:ROUTE] (repeat; "
                        "default: vanilla, aa=vanilla, and calibrated=db:DB when --db is given)")
    e.add_argument("--scenarios", help="comma-separated: decode_bB[_oN], prefill_N (default: "
                                       "decode_b1,b16,b64 and prefill_2048,8192 on CUDA)")
    e.add_argument("--warmup", type=_int_in(0, 1000), help="unmeasured rounds (default 2)")
    e.add_argument("--baseline", default="vanilla", help="the arm ratios are taken against")
    e.add_argument("--engine", help="JSON object of vLLM engine arguments over the defaults")
    e.add_argument("--kernel-profile", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU kernel time per step from torch.profiler (default: on CUDA)")
    e.add_argument("--host-profile", action=argparse.BooleanOptionalAction, default=None,
                   help="after the repetitions, each arm runs each scenario under cProfile: "
                        "host time per Python function, and where an arm spends more than "
                        "the baseline (e2e-raw.json host_profiles; FLTUNE_E2E_HOST_PROFILE=1)")
    e.add_argument("--engine-process", choices=["in-process", "multiprocess"],
                   help="each arm's vLLM engine core in the arm's process (default; the kernel "
                        "profile needs it) or in its own process, as vLLM runs for its users")
    e.add_argument("--pinning", choices=["shared", "measure", "off"],
                   help="CUDA: where the arms' host work runs — one core set for all "
                        "(shared, the default; FLTUNE_E2E_PINNING), the measured arm moved "
                        "onto the fastest few cores for each call and the others parked "
                        "(measure), or not pinned (off)")
    e.add_argument("--time-limit", type=_float_in(0.0, lo_open=True), metavar="SECONDS",
                   help="end within this many seconds, engine starts included: fewer "
                        "repetitions when the next and the kernel profile would not fit, "
                        "none when the engine starts ate the limit (FLTUNE_E2E_TIME_LIMIT; "
                        "it also reaches `fltune adjudicate`, per instrument run)")
    e.add_argument("--start-state", choices=["loaded", "as-started"],
                   help="loaded: an arm whose engine compiled the model at its start is "
                        "started again (it then loads it from vLLM's compile cache), so every "
                        "arm is measured as a loaded engine (default on CUDA: a compiled one "
                        "ran a host-bound prefill 6-8 %% slower on the H200); as-started: "
                        "each as its start left it (default on CPU; FLTUNE_E2E_START_STATE). "
                        "The arm spec first-start keeps its compiled state either way")
    e.add_argument("--inner", type=_int_in(1, 100), metavar="K",
                   help="timed runs per arm and decode scenario in a repetition (default 3); "
                        "the repetition's time is their median (and, as a second figure, "
                        "the host's fast level)")
    e.add_argument("--prefill-inner", type=_int_in(1, 300), metavar="K",
                   help="timed runs per arm and prefill scenario in a repetition (default "
                        "3x --inner: a prefill run is one or two engine steps, and the "
                        "fastest of a few often still sits in a slow period of the host)")
    e.add_argument("--procs", type=_int_in(1, 16), metavar="K",
                   help="worker processes per arm (default 1; FLTUNE_E2E_PROCS), each timed "
                        "in every repetition; the CI resamples processes as well as "
                        "repetitions, so an offset of one process reads as noise, not as an "
                        "effect (engine starts and run time grow K-fold)")
    e.add_argument("--generations", type=_int_in(1, 64), metavar="G",
                   help="start every worker again G-1 times during the run (default 1; "
                        "FLTUNE_E2E_GENERATIONS): the repetitions in G blocks, each on new "
                        "processes after a warm-up of its own, and the CI resamples the "
                        "blocks, so a process's own offset averages over processes x "
                        "generations (at most --reps; each restart costs an engine start)")
    e.add_argument("--interleave", choices=["runs", "arms"],
                   help="runs (default; FLTUNE_E2E_INTERLEAVE): a repetition's runs one per "
                        "arm in turn, A B C A B C ..., so a slow second of the host lands on "
                        "every arm; arms: each arm's runs back to back")
    e.add_argument("--probe-gate", type=_probe_gate, metavar="FACTOR",
                   help="a timed run counts only while a fixed Python loop (the host probe, "
                        "before and after it) reads within FACTOR of the arm's speed floor "
                        "(the 10th percentile of its probes); slow "
                        "runs are taken again (default 1.25 on CUDA, 0 = off on CPU; "
                        "FLTUNE_E2E_PROBE_GATE)")
    c.add_argument("--out", help=OUT_HELP + " (with --e2e: a directory for e2e-summary.json, "
                                            "e2e-raw.json and the worker logs)")
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_bench)


#: fltune.evaluate.model_step.DEFAULT_RANGE_EDGES (spelled here: the parser imports no stage)
_DEFAULT_RANGE_EDGES = (512,)


def _add_verify(sub) -> None:
    c = sub.add_parser("adjudicate", help="route or leave native, per op, by the model's "
                                          "measured step time with and without it (vLLM)")
    c.add_argument("--model", required=True, help=MODEL_HELP)
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--db-device", help="the DB's device row (key prefix or name; default: "
                                       "this machine's)")
    c.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    c.add_argument("--ops", type=_ops_arg, help="comma-separated subset of the ops to measure")
    c.add_argument("--scenarios", help="comma-separated e2e scenarios (default: the device's)")
    c.add_argument("--reps", type=_int, default=10, help="measured repetitions per arm")
    c.add_argument("--warmup", type=_int, default=2, help="unmeasured rounds first")
    c.add_argument("--out", help="a directory for adjudication.json, the e2e raw data and "
                                 "the worker logs")
    c.add_argument("--per-range", nargs="?", const=",".join(
                       str(e) for e in _DEFAULT_RANGE_EDGES), metavar="EDGES",
                   help="decide each op per token range (vLLM compiles one graph per range): "
                        "the same arm's points split by each scenario's tokens per step at "
                        "these comma-separated edges (default 512: decode vs prefill), or "
                        "'bands': each op's frozen bands' edges between vLLM's path and "
                        "another pick; serving routes the op only in the ranges decided "
                        "route")
    g = c.add_argument_group("engine-wide choices (instead of the per-op routing)")
    g.add_argument("--engine-choice", action="append", metavar="NAME[=V1,V2]",
                   help="measure an engine-wide vLLM setting instead: one arm per value "
                        "against vLLM's own default, the pick stored in the DB (repeat for "
                        "several). NAME: attention_backend, gdn_prefill_backend, "
                        "moe_backend, linear_backend, allreduce_rms_fusion (TP > 1), "
                        "cudagraph_max_size (judged by wall time), "
                        "flash_attn_max_splits; "
                        "values default to those this vLLM "
                        "offers on this device for the model. Every arm runs with the DB's "
                        "other picks for the model, as served (--alone: without them)")
    g.add_argument("--alone", action="store_true",
                   help="--engine-choice: measure against bare vLLM, without the DB's "
                        "other engine-wide picks for the model")
    g.add_argument("--list-values", action="store_true",
                   help="print the values each --engine-choice (default: every choice) "
                        "offers on this vLLM and device for the model; measure nothing")
    c.add_argument("--engine", help="JSON object of vLLM engine arguments every arm gets "
                                    "(vanilla too), over the instrument's defaults")
    c.add_argument("--compile-aa", type=_compile_aa_arg, default="auto",
                   metavar="auto|on|off|N",
                   help="add an arm that is vanilla vLLM compiled afresh (into empty "
                        "caches of its own): its kernel-time CI against vanilla, one draw of "
                        "Inductor's autotuning, widens the 1%% kernel floor per scenario "
                        "(an arm that differs from vanilla compiles the model itself). "
                        "auto: on CUDA; N: N such arms, the floor the widest draw's "
                        "(each one more engine at start)")
    c.add_argument("--confirm", choices=["auto", "on", "off"], default="auto",
                   help="--per-range: an op split (route in some token ranges, vLLM's path "
                        "in others) is measured once more as it will be served, against "
                        "vanilla; measurably slower anywhere makes it native at every size "
                        "(the split compiles each range apart). auto: on CUDA")
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_adjudicate)

    c = sub.add_parser("verify", help="re-measure the DB's winners now; exit 1 if stale")
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--device", help="the DB's device row (key prefix or name, @DRIVER); must "
                                    "be this machine's device (default: this machine's)")
    c.add_argument("--ops", type=_ops_arg, help="comma-separated subset of ops")
    c.add_argument("--noise-floor", type=_float_in(0.0), default=0.10,
                   help="smallest relative change counted as drift (default 0.10)")
    c.add_argument("--reps", type=_int_in(0, MAX_REPS), default=0,
                   help="timing samples (0 = adaptive)")
    c.add_argument("--budget", type=_float_in(0.0, 3600.0, lo_open=True), default=0.05,
                   help="seconds of timing per candidate when adaptive (default 0.05)")
    c.add_argument("--all", action="store_true", help="show every band, not only drifted ones")
    _isolate_args(c, "race")
    _ray_args(c, calibrate=False)
    c.add_argument("--out", type=_out_arg, help=OUT_HELP)
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_verify)


def _add_refine(sub) -> None:
    c = sub.add_parser("refine", help="bisect the token count where neighbouring bands' "
                                      "winners cross; the edges go into the DB and the manifest")
    c.add_argument("--db", default=DEFAULT_DB, help=DB_HELP)
    c.add_argument("--device", help="the DB's device row (key prefix or name); must be this "
                                    "machine's device (default: this machine's)")
    c.add_argument("--ops", type=_ops_arg, help="comma-separated subset of ops")
    c.add_argument("--model", help="only the tables of this model's workload (" + MODEL_HELP
                                   + ")")
    c.add_argument("--max-probes", type=_int_in(1, 64), default=6,
                   help="most probes per pair of bands (default 6)")
    c.add_argument("--force", action="store_true", help="re-measure crossovers already stored")
    _isolate_args(c, "time")
    c.add_argument("--out", type=_out_arg, help=OUT_HELP)
    c.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_refine)


def _add_diff(sub) -> None:
    c = sub.add_parser("diff", help="winners of two DBs, or two devices of one DB, side by side")
    c.add_argument("a", help="calibration DB A")
    c.add_argument("b", nargs="?", help="calibration DB B (omit to compare two devices of A)")
    c.add_argument("--device-a", help="A's device (key prefix or name, optionally @DRIVER)")
    c.add_argument("--device-b", help="B's device (key prefix or name, optionally @DRIVER)")
    c.add_argument("--threshold", type=_float_in(0.0), default=0.05,
                   help="winner-time ratio beyond which a band counts as moved (default 0.05)")
    c.add_argument("--all", action="store_true", help="show every band")
    c.add_argument("--wide", action="store_true", help=WIDE_HELP)
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_diff)


def _add_merge(sub) -> None:
    c = sub.add_parser("merge", help="several calibration DBs -> one fleet DB (union by "
                                     "device, driver and stack; conflicts listed)")
    c.add_argument("inputs", nargs="+", metavar="DB",
                   help="calibration DBs to merge (read only, never modified)")
    c.add_argument("-o", "--out", required=True, type=_out_arg,
                   help="the merged DB to write: a new file, not one of the inputs")
    c.add_argument("--json", action="store_true", help=JSON_HELP)
    c.set_defaults(fn=cmd_merge)


#: one function per subcommand, in the order ``fltune --help`` lists them
SUBCOMMANDS = (_add_candidates, _add_calibrate, _add_freeze, _add_report, _add_devices, _add_serve, _add_bench, _add_verify, _add_refine, _add_diff, _add_merge)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fltune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv=None) -> int:
    from ..dispatch.frozen import ManifestError
    from ..dispatch.policy import PolicyError
    from ..freeze import StackMismatch
    from ..store import DBError
    from ..tune.workload import ModelConfigError

    a = build_parser().parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return a.fn(a)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (DBError, ModelConfigError, PolicyError, ManifestError, StackMismatch,
            UsageError) as e:
        print(f"fltune: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # a path the OS refuses (too long, no permission, disk full, ...)
        what = f"{e.filename}: " if e.filename else ""
        print(f"fltune: error: {what}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
