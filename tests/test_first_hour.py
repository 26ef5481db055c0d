"""The first hour (issue 10, item 6), through the real CLI in subprocesses:

- every flag of every subcommand has help text;
- ``calibrate`` ends with the next commands to run, and they work;
- every hint fltune prints (a command in backticks) is complete: each is provoked on a real
  tiny DB and the printed command is run as printed;
- Ctrl-C during calibrate: one line, exit 130, no traceback (the worker's neither), and a
  rerun of the same command resumes;
- a pipe gets plain progress lines, one per finished op, with counts and an ETA;
- ``report``, ``diff`` and ``candidates`` at 80 columns: no line longer, a legend, signatures
  whole; ``--wide`` prints the full tables.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fltune.cli.main import build_parser

from conftest import REPO, child_env, copy_db

SHIPPED = REPO / "db" / "NVIDIA-H200_driver-580.159.04.db"
#: a tiny calibration: tiny-qwen3's silu_and_mul table, bands 1..16 (5 bands)
TINY = ["--model", "tiny-qwen3", "--max-tokens", "16", "--ops", "silu_and_mul",
        "--budget", "0.003"]
#: the hint commands the tests run name the DB's own model and settings, except where the
#: DB cannot know them (no DB yet): there the hint names Qwen3.5-0.8B, and the test runs it
#: restricted to one op and 16 tokens so that it stays a test (same command otherwise)
SMALL = ["--max-tokens", "16", "--ops", "silu_and_mul"]
BACKTICKED = re.compile(r"`(fltune [^`]+)`")


def fltune(*args, cwd=None, env=None, check=True, timeout=600):
    p = subprocess.run([sys.executable, "-m", "fltune", *args], capture_output=True,
                       text=True, timeout=timeout, cwd=cwd, env=env or child_env())
    if check and p.returncode != 0:
        raise AssertionError(f"fltune {shlex.join(args)} failed ({p.returncode}):\n"
                             f"{p.stderr[-3000:]}")
    return p


def hints(text: str) -> list[str]:
    """The commands a message tells the user to run (in backticks), in order."""
    return list(dict.fromkeys(BACKTICKED.findall(text)))


def run_hint(cmd: str, cwd, extra=(), check=True):
    argv = shlex.split(cmd)
    assert argv[0] == "fltune"
    return fltune(*argv[1:], *extra, cwd=cwd, check=check)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A real calibration of this machine into a fresh DB, output to pipes (not --quiet)."""
    d = tmp_path_factory.mktemp("first_hour")
    db = d / "tiny.db"
    p = fltune("calibrate", *TINY, "--db", str(db), cwd=d)
    return {"db": db, "dir": d, "stderr": p.stderr, "stdout": p.stdout}


def _db(tiny, tmp_path, name, *sql):
    """A copy of the tiny DB with ``sql`` applied."""
    copy = tmp_path / name
    c = copy_db(tiny["db"], copy)
    for q in sql:
        c.execute(q)
    c.commit()
    c.close()
    return copy


# ---- help ------------------------------------------------------------------------------

def test_every_flag_has_help():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, sp in subs.choices.items():
        for act in sp._actions:
            if isinstance(act, argparse._HelpAction):
                continue
            if not act.help or act.help == argparse.SUPPRESS or not act.help.strip():
                missing.append(f"{name} {'/'.join(act.option_strings) or act.dest}")
    assert not missing, f"flags without help: {missing}"
    assert len(subs.choices) >= 10
    for name in ("calibrate", "bench", "refine"):
        model = next(a for a in subs.choices[name]._actions if "--model" in a.option_strings)
        assert "fltune/profiles" in model.help and "calibrate/profiles" not in model.help


# ---- calibrate: plain progress on a pipe, and the next command -------------------------------

def test_pipe_gets_plain_progress_lines_and_the_next_command(tiny):
    err = tiny["stderr"]
    assert "\x1b[" not in err and "\r" not in err          # no live bar, no colour codes
    lines = [ln for ln in err.splitlines() if ln.startswith("calibrate ")]
    # one line per finished op table: op, shape, bands of it, done/total, elapsed, ETA
    assert len(lines) == 1, err
    assert re.fullmatch(r"calibrate silu_and_mul \[intermediate=\d+\] bf16: 5 bands; 5/5 "
                        r"bands done, \S+ elapsed, ETA \S+", lines[0]), lines
    nxt = [ln for ln in err.splitlines() if ln.startswith("next: ")]
    assert len(nxt) == 1
    cmds = hints(nxt[0])
    assert any(c.startswith("fltune report --db ") for c in cmds)
    assert any(c.startswith("fltune freeze --db ") and "--out" in c for c in cmds)
    for c in cmds:                                        # they work as printed
        assert str(tiny["db"]) in c
        run_hint(c, tiny["dir"])
    assert (tiny["dir"] / "manifest.json").exists()


def test_pipe_progress_lines_several_ops_and_quiet(tmp_path):
    db = tmp_path / "two.db"
    p = fltune("calibrate", "--model", "tiny-qwen3", "--max-tokens", "2", "--ops",
               "silu_and_mul,rms_norm", "--budget", "0.003", "--no-isolate", "--db", str(db))
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("calibrate ")]
    # tiny-qwen3 has 3 rms_norm tables and one silu_and_mul table, 2 bands each
    assert len(lines) == 4, p.stderr
    assert [ln.split("; ")[1].split(" bands")[0] for ln in lines] == ["2/8", "4/8", "6/8", "8/8"]
    q = fltune("calibrate", "--model", "tiny-qwen3", "--max-tokens", "2", "--ops",
               "silu_and_mul", "--budget", "0.003", "--no-isolate", "--db",
               str(tmp_path / "q.db"), "--quiet")
    assert not [ln for ln in q.stderr.splitlines()
                if ln.startswith(("calibrate ", "next:", "calibrated "))], q.stderr


# ---- every hint works when followed --------------------------------------------------------

def test_hint_missing_db(tmp_path):
    missing = tmp_path / "new" / "fresh.db"
    p = fltune("report", "--db", str(missing), check=False)
    assert p.returncode == 2
    (cmd,) = hints(p.stderr)
    assert cmd.startswith("fltune calibrate --model ") and str(missing) in cmd
    run_hint(cmd, tmp_path, SMALL)
    fltune("report", "--db", str(missing))


def test_hint_no_calibration_for_this_device(tiny, tmp_path):
    foreign = _db(tiny, tmp_path, "foreign.db",
                  *(f"update {t} set device_key='ffff' || substr(device_key, 5)"
                    for t in ("devices", "runs", "measurements", "winners")))
    p = fltune("freeze", "--db", str(foreign), "--out", str(tmp_path / "m.json"), check=False)
    assert p.returncode == 2 and "no calibration for this device" in p.stderr
    (cmd,) = hints(p.stderr)
    # the model, op subset and band range of the DB's run (the same kind of device)
    assert "--model tiny-qwen3" in cmd and "--ops silu_and_mul" in cmd and "--max-tokens 16" in cmd
    run_hint(cmd, tmp_path)
    fltune("freeze", "--db", str(foreign), "--out", str(tmp_path / "m.json"))


def test_hint_no_winners(tiny, tmp_path):
    # measured, but no band has a winner (every candidate failed, say): a plain rerun would
    # skip every band, so the hint must re-measure
    empty = _db(tiny, tmp_path, "nowin.db", "delete from winners")
    p = fltune("freeze", "--db", str(empty), "--out", str(tmp_path / "m.json"), check=False)
    assert p.returncode == 2 and "no winners" in p.stderr
    (cmd,) = hints(p.stderr)
    run_hint(cmd, tmp_path)
    fltune("freeze", "--db", str(empty), "--out", str(tmp_path / "m.json"))


def _old_stack(tiny, tmp_path, name, *extra):
    copy = _db(tiny, tmp_path, name, *extra)
    _age_stack(copy)
    return copy


def _age_stack(copy):
    """Every row of the DB at ``copy`` measured on another stack (torch 0.0.1-old)."""
    c = sqlite3.connect(copy)
    c.execute("update winners set stack_key='old-stack'")
    c.execute("update measurements set stack_key='old-stack'")
    for rid, st in c.execute("select id, stack from runs").fetchall():
        s = json.loads(st)
        s["torch"] = "0.0.1-old"
        c.execute("update runs set stack=?, stack_key='old-stack' where id=?", (json.dumps(s), rid))
    c.commit()
    c.close()


def test_hint_stack_changed(tiny, tmp_path):
    old = _old_stack(tiny, tmp_path, "old.db")
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    assert "software stack changed" in p.stderr
    cmds = hints(p.stderr)
    assert [c.split()[1] for c in cmds] == ["calibrate", "verify"], cmds
    v = run_hint(cmds[1], tmp_path, check=False)
    assert v.returncode in (0, 1), v.stderr[-2000:]      # 1: stale, verify's documented result
    run_hint(cmds[0], tmp_path)                           # re-measures with this stack
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    assert "software stack changed" not in p.stderr


def test_hint_stack_changed_re_measures_every_run_and_model(tiny, tmp_path):
    # the tiny DB's silu_and_mul run, then a run of another op and one of another model: the
    # hint used to repeat the newest run only (Qwen3-0.6B), so following it left tiny-qwen3's
    # winners on the old stack and freeze kept warning
    multi = _db(tiny, tmp_path, "multi.db")
    fast = ("--budget", "0.003", "--no-isolate", "--quiet", "--db", str(multi))
    fltune("calibrate", "--model", "tiny-qwen3", "--max-tokens", "16", "--ops",
           "rotary_embedding", *fast)
    fltune("calibrate", "--model", "Qwen3-0.6B", "--max-tokens", "2", "--ops",
           "silu_and_mul", *fast)
    _age_stack(multi)
    p = fltune("freeze", "--db", str(multi), "--out", str(tmp_path / "m.json"))
    assert "software stack changed" in p.stderr
    cmds = hints(p.stderr)
    assert [c.split()[1] for c in cmds] == ["calibrate", "calibrate", "verify"], cmds
    tiny_cmd, qwen_cmd = cmds[:2]
    # one command per model, with the union of its runs' ops and the widest band range
    assert "--model tiny-qwen3" in tiny_cmd and "--max-tokens 16" in tiny_cmd
    assert "--ops rotary_embedding,silu_and_mul" in tiny_cmd, tiny_cmd
    assert "--model Qwen3-0.6B" in qwen_cmd and "--max-tokens 2" in qwen_cmd
    assert "--ops silu_and_mul" in qwen_cmd, qwen_cmd
    for c in cmds[:2]:                           # followed, they leave nothing on the old stack
        run_hint(c, tmp_path, ("--budget", "0.003", "--no-isolate"))
    p = fltune("freeze", "--db", str(multi), "--out", str(tmp_path / "m.json"))
    assert "software stack changed" not in p.stderr


def _whole_run_then_one_op(tiny, tmp_path, name, later: dict):
    """The tiny DB on an old stack, its run made a whole-workload one (no ``ops``
    recorded), then a later run of silu_and_mul with ``later`` settings that still holds
    a winner (the 1-token band). Returns the hints freeze prints."""
    old = _old_stack(tiny, tmp_path, name)
    c = sqlite3.connect(old)
    (settings,) = c.execute("select settings from runs").fetchone()
    st = json.loads(settings)
    del st["ops"]
    c.execute("update runs set settings=?", (json.dumps(st),))
    c.execute("insert into runs (device_key, driver, model, dtype, tp, settings, stack, "
              "stack_key, status, started) select device_key, driver, model, dtype, tp, ?, "
              "stack, stack_key, 'done', started + 1 from runs",
              (json.dumps({**st, "ops": ["silu_and_mul"], **later}),))
    c.execute("update winners set run_id=(select max(id) from runs) where band_hi=1")
    c.commit()
    c.close()
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    return hints(p.stderr)


def test_hint_stack_changed_whole_workload_run_needs_no_ops(tiny, tmp_path):
    # a run that calibrated the whole workload records no ops: the model's command then has
    # no --ops, whatever op subsets its other runs had
    cmds = _whole_run_then_one_op(tiny, tmp_path, "whole.db", {"max_tokens": 4})
    assert [c.split()[1] for c in cmds] == ["calibrate", "verify"], cmds
    assert "--model tiny-qwen3" in cmds[0] and "--ops" not in cmds[0], cmds[0]
    assert "--max-tokens 16" in cmds[0], cmds[0]


def test_hint_stack_changed_keeps_each_runs_timing_switches(tiny, tmp_path):
    # a whole-workload run, then one op re-timed with --cold-weights (which still holds the
    # 1-token band): one command per timing regime, the newest regime's last, so following
    # them re-times that op cold again instead of hot (or every op cold)
    cmds = _whole_run_then_one_op(tiny, tmp_path, "regimes.db", {"cold_weights": True})
    assert [c.split()[1] for c in cmds] == ["calibrate", "calibrate", "verify"], cmds
    whole, cold = cmds[:2]
    assert "--ops" not in whole and "--cold-weights" not in whole, whole
    assert "--ops silu_and_mul" in cold and "--cold-weights" in cold, cold
    assert "--model tiny-qwen3" in whole and "--model tiny-qwen3" in cold


def test_hint_stack_changed_names_the_model_of_winners_whose_run_is_gone(tiny, tmp_path):
    # a DB whose runs table lost the run its winners came from (an older or merged DB's):
    # their stack is unknown (freeze used to say nothing: the stack is read from the runs),
    # and they name no model (the hint named the default one); now freeze warns, and the
    # built-in profile whose workload runs their signature is the hint's model: following
    # it re-measures them on this stack
    old = _old_stack(tiny, tmp_path, "orphans.db", "delete from runs")
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    assert "software stack unknown for 5 winners" in p.stderr, p.stderr
    assert fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"), "--strict",
                  check=False).returncode != 0
    cmds = hints(p.stderr)
    assert [c.split()[1] for c in cmds] == ["calibrate", "verify"], cmds
    assert "--model tiny-qwen3" in cmds[0] and "--ops silu_and_mul" in cmds[0], cmds[0]
    assert "--max-tokens 16" in cmds[0] and "--dtype" in cmds[0], cmds[0]
    run_hint(cmds[0], tmp_path, ("--budget", "0.003", "--no-isolate"))
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    assert "software stack" not in p.stderr, p.stderr


def test_hint_stack_unknown_for_winners_no_profile_runs_offers_no_wrong_model(tiny, tmp_path):
    # orphans of a model no built-in profile is (a config directory's): the warning says
    # how many and what to do; no `calibrate` of the default model is offered (it would
    # re-measure something else and leave the warning standing)
    old = _old_stack(tiny, tmp_path, "lost.db", "delete from runs",
                     "update winners set signature='intermediate=77'")
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    assert "software stack unknown for 5 winners" in p.stderr, p.stderr
    assert "no built-in profile runs 5 of them" in p.stderr, p.stderr
    assert [c.split()[1] for c in hints(p.stderr)] == ["verify"], p.stderr


def test_hint_orphans_of_a_run_still_recorded_get_one_command(tiny, tmp_path):
    # winners that lost their run id while the run is still there (its stack recorded):
    # the run's command covers the orphans (same model, ops, a higher band): it is given once
    old = _old_stack(tiny, tmp_path, "nullrun.db",
                     "update winners set run_id=NULL where band_hi=1")
    p = fltune("freeze", "--db", str(old), "--out", str(tmp_path / "m.json"))
    assert "software stack changed" in p.stderr
    cmds = hints(p.stderr)
    assert [c.split()[1] for c in cmds] == ["calibrate", "verify"], cmds
    assert "--model tiny-qwen3" in cmds[0]


def test_hint_refine_skipped_for_old_stack(tiny, tmp_path):
    # two adjacent bands with different winners, measured with another stack
    old = _old_stack(tiny, tmp_path, "refold.db",
                     "update winners set impl_id = case impl_id when 'reference.torch' then "
                     "'vendor.vllm' else 'reference.torch' end where band_hi = 16")
    p = fltune("refine", "--db", str(old), "--no-isolate")
    assert "skipped" in p.stdout
    (cmd,) = hints(p.stdout)
    assert cmd.startswith("fltune calibrate --model tiny-qwen3")
    run_hint(cmd, tmp_path)
    p = fltune("refine", "--db", str(old), "--no-isolate", "--json")
    assert all(r["status"] != "skipped" for r in json.loads(p.stdout)["pairs"])


def test_hint_verify_stale(tiny, tmp_path):
    # a million-fold, the stored noise cleared: a loaded machine's stall (an oversubscribed
    # OpenMP loop takes ~6 ms where it takes 12 µs) or a noise stored 550 by the 3 ms budget
    # hid a thousand-fold tamper in one band
    slow = _db(tiny, tmp_path, "stale.db",
               "update winners set median_us = median_us * 1e6, noise = 0")
    p = fltune("verify", "--db", str(slow), "--no-isolate", "--noise-floor", "0.5",
               check=False, env=child_env(OMP_NUM_THREADS="1"))
    assert p.returncode == 1 and "stale" in p.stdout, p.stdout + p.stderr
    (cmd,) = hints(p.stdout)
    assert "--force" in cmd and "--model tiny-qwen3" in cmd
    run_hint(cmd, tmp_path)


# ---- Ctrl-C --------------------------------------------------------------------------------

def _winners(db) -> int:
    try:
        c = sqlite3.connect(db, timeout=5)
        n = c.execute("select count(*) from winners").fetchone()[0]
        c.close()
        return n
    except sqlite3.Error:
        return 0


def test_ctrl_c_one_line_exit_130_then_resume(tmp_path):
    db = tmp_path / "int.db"
    args = [sys.executable, "-m", "fltune", "calibrate", "--model", "tiny-qwen3", "--db",
            str(db), "--max-tokens", "64", "--ops", "silu_and_mul,rms_norm", "--budget", "0.01"]
    # its own process group, as a shell runs a foreground job: Ctrl-C reaches the
    # calibrating process and its supervised worker alike
    # and SIGINT's default action restored, as a shell does for a foreground job: a suite
    # started in the background (`.ci/run &` in a script) runs with SIGINT ignored, which
    # every child inherits, and Python then installs no Ctrl-C handler at all
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and _winners(db) < 1:
        time.sleep(0.05)
    assert proc.poll() is None, "finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    # Python's multiprocessing resource tracker (a process of its own, in the same group)
    # may warn about a semaphore the killed worker left; that is Python's line, not fltune's
    tracker = [i for i, ln in enumerate(err.splitlines()) if "resource_tracker" in ln]
    raw = err.splitlines()
    skip = {j for i in tracker for j in (i, i + 1)}
    lines = [ln for i, ln in enumerate(raw) if ln.strip() and i not in skip]
    intr = [ln for ln in lines if ln.startswith("interrupted")]
    assert len(intr) == 1 and lines[-1] == intr[0], err[-3000:]
    m = re.fullmatch(r"interrupted: (\d+) bands saved; rerun the same command to resume",
                     intr[0])
    assert m, intr
    saved = int(m.group(1))
    assert saved >= 1 and saved == _winners(db)
    c = sqlite3.connect(db)
    assert c.execute("select status from runs order by id desc").fetchone()[0] == "interrupted"
    c.close()
    # the same command resumes: what was saved is not measured again
    done = subprocess.run(args + ["--json"], capture_output=True, text=True, timeout=600,
                          env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(done.stdout)
    assert res["skipped"] == saved and res["measured"] + saved == 4 * 7


# ---- 80 columns ----------------------------------------------------------------------------

def _cols(*args, columns="80"):
    env = child_env(COLUMNS=columns)
    p = fltune(*args, env=env)
    return p.stdout


def _longest(text: str) -> int:
    return max((len(ln) for ln in text.splitlines()), default=0)


def _unwrapped(text: str) -> str:
    """The output with its wrapped lines joined (titles wrap inside a signature)."""
    return "".join(ln.rstrip() for ln in text.splitlines())


@pytest.mark.parametrize("extra", [[], ["--op", "mrope"], ["--op", "rms_norm"]])
def test_report_at_80_columns(extra):
    out = _cols("report", "--db", str(SHIPPED), "--device", "H200", *extra)
    assert _longest(out) <= 80, out
    assert "…" not in out                                   # no cut cell
    assert "columns:" in out
    for col in ("tokens", "winner", "runner-up", "gap", "FL pick", "vs FL"):
        assert re.search(rf"^\s+{re.escape(col)}: \S", out, re.M), col
    rep = json.loads(fltune("report", "--db", str(SHIPPED), "--device", "H200", *extra,
                            "--json").stdout)
    flat = _unwrapped(out)
    sigs = {r["signature"] for r in rep["rows"]}
    for sig in sigs:                                        # each table's signature whole
        assert f"[{sig}]" in flat, sig
    wide = _cols("report", "--db", str(SHIPPED), "--device", "H200", *extra, "--wide")
    assert "FL µs" in wide and "GB/s" in wide and "parity" in wide
    assert _longest(wide) > 80
    for col in ("FL µs", "parity", "GB/s"):
        assert re.search(rf"^\s+{re.escape(col)}: \S", wide, re.M), col


def test_diff_at_80_columns(tmp_path):
    # B: the same DB with every rms_norm table's first band won by another candidate
    b = tmp_path / "b.db"
    c = copy_db(SHIPPED, b)
    c.execute("update winners set impl_id = case impl_id when 'inductor.standalone' then "
              "'reference.torch' else 'inductor.standalone' end where op='rms_norm' and "
              "band_hi=1")
    c.commit()
    c.close()
    changed = {r["signature"] for r in json.loads(fltune(
        "diff", str(SHIPPED), str(b), "--json").stdout)["rows"] if r["status"] == "changed"}
    assert len(changed) >= 2                   # several rms_norm shapes: distinct signatures
    out = _cols("diff", str(SHIPPED), str(b))
    assert _longest(out) <= 80, out
    assert "…" not in out
    flat = _unwrapped(out)
    for sig in changed:
        assert f"[{sig}]" in flat, sig
    for col in ("status", "B/A", "A on B", "B on A"):
        assert re.search(rf"^\s+{re.escape(col)}: \S", out, re.M), col
    wide = _cols("diff", str(SHIPPED), str(b), "--wide")
    assert "A's pick on B" in wide and _longest(wide) > 80
    for sig in changed:
        assert sig in wide


def test_candidates_at_80_columns():
    out = _cols("candidates")
    assert _longest(out) <= 80, out
    assert "…" not in out
    assert re.search(r"^\s+FL pick: \S", out, re.M) and re.search(r"^\s+why not: \S", out, re.M)
    wide = _cols("candidates", "--wide")
    header = next(ln for ln in wide.splitlines() if "kind/prio" in ln)
    assert "FL pick" in header and "why not" in header
