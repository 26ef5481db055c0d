"""The commands fltune prints as a way out: complete and runnable, never a template.

Why here: an error that says "re-run ``fltune calibrate --db X``" fails when followed
(``--model`` is required), and "``--model NAME``" makes the user guess. The DB knows which
model was calibrated (its ``runs`` table), so a hint built from it is a command a person
can paste. ``tests/test_first_hour.py`` provokes each hint on a real DB and runs it.
"""
from __future__ import annotations

import json
import shlex
from typing import Callable, Optional

from ..util import json_object

#: the model a hint names when the DB cannot say (no DB yet, or no run in it): the first
#: built-in profile README's first hour calibrates
DEFAULT_MODEL = "Qwen3.5-0.8B"


def _q(s) -> str:
    return shlex.quote(str(s))


def last_run(db, device_key: Optional[str] = None, driver: Optional[str] = None) -> Optional[dict]:
    """The latest calibration run in ``db`` (for this device and driver, when given)."""
    try:
        runs = db.runs(device_key)
    except Exception:       # a DB too broken to read runs from: no hint beyond the default
        return None
    if driver is not None:
        runs = [r for r in runs if r.get("driver") == driver] or runs
    return runs[-1] if runs else None


def _settings(run: dict) -> dict:
    return json_object(run.get("settings"))


#: a run's timing switches (its settings key -> the ``calibrate`` flag): they choose how a
#: band is timed, so a re-run must repeat them for the ops they were used for
TIMING_SWITCHES = {"cold_l2": "--cold-l2", "cold_weights": "--cold-weights"}


def calibrate_command(db_path, run: Optional[dict] = None, *, same_device: bool = True,
                      force: bool = False) -> str:
    """``fltune calibrate`` for ``db_path`` that repeats ``run`` (its model, dtype, tp, op
    subset, cold timing switches and, for the same kind of device, its ``--max-tokens`` and
    ``--ray``), or names
    :data:`DEFAULT_MODEL` when there is no run to repeat."""
    parts = ["fltune", "calibrate", "--model", _q(run["model"] if run else DEFAULT_MODEL),
             "--db", _q(db_path)]
    if run:
        if run.get("dtype"):
            parts += ["--dtype", _q(run["dtype"])]
        if run.get("tp") and int(run["tp"]) != 1:
            parts += ["--tp", str(int(run["tp"]))]
        st = _settings(run)
        if st.get("ops"):
            parts += ["--ops", _q(",".join(st["ops"]))]
        if same_device and st.get("max_tokens"):
            parts += ["--max-tokens", str(int(st["max_tokens"]))]
        # the timing regime the run chose: a hinted re-run that dropped it would replace
        # cold-timed winners with hot-timed ones
        parts += [flag for key, flag in TIMING_SWITCHES.items() if st.get(key)]
        # a run over a Ray cluster (its settings name the actors) is repeated over one: on
        # the same kind of device only (a hint for another machine repeats the workload, not
        # the fleet), with Ray's own address resolution (RAY_ADDRESS, else this host's)
        if same_device and st.get("ray"):
            parts.append("--ray")
    if force:
        parts.append("--force")
    return " ".join(parts)


def calibrate_hint(db, device_key: Optional[str] = None, driver: Optional[str] = None, *,
                   device_type: Optional[str] = None, force: bool = False) -> str:
    """The command that (re)calibrates ``db`` (an open :class:`CalibrationDB`) for the
    device ``device_key`` / ``driver``, repeating its last run there. With no run for that
    device: the DB's last run of any device, with its ``--max-tokens`` only when that run
    was on the same kind of device (``device_type``: cpu, cuda)."""
    run = last_run(db, device_key, driver) if device_key else None
    same = run is not None
    if run is None:
        run = last_run(db)
        same = bool(run and device_type and _settings(run).get("device") == device_type)
    return calibrate_command(db.path, run, same_device=same, force=force)


def workload_commands(db, device_key: str, driver: str,
                      models_for: Optional[Callable] = None) -> list[str]:
    """The ``fltune calibrate`` commands that re-measure everything ``db`` holds winners for
    on ``device_key`` / ``driver``: one per (model, dtype, tp) and timing switches — the
    CLI calibrates one model at a time, dtype or tp change the workload itself, and the
    switches how its bands are timed.

    Why not :func:`calibrate_hint`: it repeats the newest run, and the newest run is often
    a partial one (``--ops rotary_embedding`` after a rope change), so on a stack change it
    re-measured one op and left every other winner of the DB measured on the old stack.
    Here each command covers the union of its runs' ops: no ``--ops`` at all when one of
    them calibrated the model's whole workload (a run records ``ops`` only when
    ``--ops`` restricted it) and the highest ``--max-tokens`` any of them reached.

    Runs with different timing switches (``--cold-l2``, ``--cold-weights``) get a command
    each, in the order of their newest runs: a model whose GEMMs a later ``--ops linear
    --cold-weights`` run re-timed cold gets its whole-workload command first, then the cold
    one, so the end state is the one the user built (a band's last race decides its regime,
    ``CalibrationDB.has_band``). One command with the newest run's switches, as before
    session 23, re-timed every op that way, and one with none would replace cold-timed
    winners with hot ones. The runs read are
    those that still hold a winner here: a run whose every band a later one re-measured
    has nothing left to re-measure.

    Winners whose run is gone (an old or merged DB's) name no model. ``models_for``
    (``tune.workload.profiles_running``: {(op, signature, dtype): [profiles]}) names the
    built-in profile that runs each: one more command per (profile, dtype) with those ops
    and their widest band, before the runs' (the freeze warning stays for the ones no
    profile runs, until they are re-measured or the DB is rebuilt: no command is offered
    for them, since the default model's would not re-measure them). With neither a run nor
    an orphan, the newest run's command, as :func:`calibrate_hint` gives it."""
    try:
        winners = db.winners(device_key, driver)
        runs = [r for r in db.runs(device_key) if r.get("driver") == driver]
    except Exception:       # a DB too broken to read: the newest run's hint, as before
        winners, runs = [], []
    held = {w.get("run_id") for w in winners}
    recorded = {r.get("id") for r in runs}
    orphans = [w for w in winners if w.get("run_id") not in recorded]
    runs = [r for r in runs if r.get("id") in held]
    # the orphans' commands first: they carry no timing switches (their run, which knew
    # them, is gone), so the runs' commands, which do, race last and decide their bands'
    # regime (a band's last race decides it, ``CalibrationDB.has_band``)
    cmds = list(dict.fromkeys(_orphan_commands(db, orphans, models_for, runs)
                              + _run_commands(db, runs)))
    if cmds or orphans:     # (orphans no profile runs: no command beats a wrong model's)
        return cmds
    return [calibrate_hint(db, device_key, driver)]


def _orphan_commands(db, orphans: list, models_for: Optional[Callable],
                     runs: list = ()) -> list[str]:
    """One ``calibrate`` per (built-in profile, dtype) covering the winners in ``orphans``
    that profile runs (the first profile that runs a winner takes it), unless one of
    ``runs`` (those :func:`_run_commands` repeats) covers it already: same model and dtype,
    every op (no ``ops`` recorded) or a superset, bands at least as high."""
    if not orphans or models_for is None:
        return []
    try:
        found = models_for({(w["op"], w["signature"], w["dtype"]) for w in orphans})
    except Exception:       # a profile that does not derive: no command rather than none at all
        return []
    groups: dict = {}
    for w in orphans:
        names = found.get((w["op"], w["signature"], w["dtype"])) or []
        if names:
            g = groups.setdefault((names[0], w["dtype"]), {"ops": set(), "max_tokens": 0})
            g["ops"].add(w["op"])
            g["max_tokens"] = max(g["max_tokens"], int(w.get("band_hi") or 0))

    def covered(model, dtype, g) -> bool:
        for r in runs:
            st = _settings(r)
            if (r.get("model") == model and r.get("dtype") == dtype
                    and (not st.get("ops") or g["ops"] <= set(st["ops"]))
                    and int(st.get("max_tokens") or 0) >= g["max_tokens"]):
                return True
        return False
    return [calibrate_command(db.path, {"model": model, "dtype": dtype, "settings": json.dumps(
        {"ops": sorted(g["ops"]), "max_tokens": g["max_tokens"] or None})})
        for (model, dtype), g in sorted(groups.items()) if not covered(model, dtype, g)]


def _run_commands(db, runs: list) -> list[str]:
    """:func:`workload_commands`' commands for the runs that hold winners."""
    groups: dict = {}
    for r in runs:          # db.runs is ordered by id: the last of a group is its newest
        regime = tuple(bool(_settings(r).get(k)) for k in TIMING_SWITCHES)
        groups.setdefault((r["model"], r.get("dtype"), r.get("tp"), regime), []).append(r)
    cmds = []
    # a model's regimes in the order the user last ran them (the newest run of each)
    for group in sorted(groups.values(), key=lambda g: g[-1].get("id") or 0):
        sts = [_settings(r) for r in group]
        ops = (None if any(not s.get("ops") for s in sts)
               else sorted({o for s in sts for o in s["ops"]}))
        tokens = [int(s["max_tokens"]) for s in sts if s.get("max_tokens")]
        st = {**sts[-1], "max_tokens": max(tokens) if tokens else None}
        st.pop("ops", None)
        if ops:
            st["ops"] = ops
        cmd = calibrate_command(db.path, {**group[-1], "settings": json.dumps(st)})
        if cmd not in cmds:
            cmds.append(cmd)
    return cmds


def freeze_command(db_path, out: str = "manifest.json", device: Optional[str] = None) -> str:
    parts = ["fltune", "freeze", "--db", _q(db_path), "--out", _q(out)]
    if device:
        parts += ["--device", _q(device)]
    return " ".join(parts)
