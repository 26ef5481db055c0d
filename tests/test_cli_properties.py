"""Property-based tests over ``fltune`` command lines (issue 6, item 5).

Hypothesis draws hostile and odd invocations of every subcommand but ``serve`` (which
execs vLLM; ``refine`` included since issue 10): unknown or odd ``--model`` values (missing names, directories, files of random
bytes, JSON that is not an object, empty, unicode), out-of-range or non-numeric ``--tp``,
``--max-tokens``, ``--parity-floor``, ``--margin``, ``--reps``, ``--budget``,
``--candidate-timeout``, ``--noise-floor``, ``--threshold``, ``--copy-mib``,
``--max-probes``, garbage
``--dtype``/``--order``/``--op``/``--ops``, ``--device`` keys that match nothing, and DB
paths that do not exist, are directories, random bytes, empty, a text file, a foreign SQLite
DB or an fltune DB of a newer schema — mixed with valid values, so some runs do real (tiny)
work.

The properties, for every invocation:
- the command succeeds (exit 0; ``verify`` may exit 1, "stale"), or exits 2 with exactly one
  ``fltune...: error:`` line, last on stderr, and never a Python traceback;
- an argument known to be invalid (drawn from the invalid side) is refused (exit 2), and the
  error line names one of the invalid arguments (its flag or its value);
- it never creates or modifies a file it was not asked to write: the whole scratch tree
  (files, sizes, mtimes, sha256) is identical afterwards except the calibrate (and
  refine) ``--db`` (and its SQLite side files) and, on success, the ``--out`` file. An invalid DB passed in is
  byte-identical afterwards.

``fltune.cli.main(argv)`` runs in this process (argparse errors arrive as ``SystemExit``);
three invocations also run as real ``python -m fltune`` processes.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fltune.cli.main import main

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = REPO / "tests" / "fixtures" / "tiny_qwen3"
#: settings that keep every real measurement tiny
CHEAP = ["--budget", "0.001"]

# ---- the scratch tree every invocation runs in ------------------------------------------
# Path arguments are drawn as symbolic names and resolved inside a fresh tree per example:
#   root/              snapshotted whole (a stray file next to the workspace is caught too)
#   root/ws/           the cwd; holds the inputs below
GOOD, EMPTY, RAND, TEXT, FOREIGN, NEWER, DIR, MISSING = (
    "good.db", "empty.db", "rand.bin", "notes.txt", "foreign.db", "newer.db", "adir",
    "missing.db")
#: DB inputs a reader must refuse, naming the file
BAD_DBS = [RAND, TEXT, FOREIGN, NEWER, DIR, MISSING, "nodir/missing.db"]
CFG_LIST, CFG_BYTES, CFG_EMPTY, CFG_DIR, CFG_UNICODE = (
    "list.json", "bytes.json", "empty.json", "cfgdir", "ünï©ødé.json")


@pytest.fixture(scope="module")
def good_db(tmp_path_factory):
    """A real calibration of this machine: tiny-qwen3, silu_and_mul, bands 1 and 2."""
    db = tmp_path_factory.mktemp("cli_props") / "good.db"
    rc, _, err = run_cli(["calibrate", "--model", "tiny-qwen3", "--db", str(db), "--ops",
                          "silu_and_mul", "--max-tokens", "2", "--no-isolate", "--quiet",
                          *CHEAP])
    assert rc == 0, err
    c = sqlite3.connect(db)
    key, name = c.execute("select device_key, name from devices").fetchone()
    c.close()
    return {"path": db, "key": key, "name": name}


def make_tree(root: Path, good: Path, rand_bytes: bytes) -> Path:
    ws = root / "ws"
    ws.mkdir()
    shutil.copy(good, ws / GOOD)
    shutil.copy(good, ws / NEWER)
    c = sqlite3.connect(ws / NEWER)
    c.execute("update meta set value='99' where key='schema_version'")
    c.commit()
    c.close()
    (ws / EMPTY).write_bytes(b"")
    (ws / RAND).write_bytes(rand_bytes)
    (ws / TEXT).write_text("not a database\n")
    c = sqlite3.connect(ws / FOREIGN)
    c.execute("create table people(name text)")
    c.commit()
    c.close()
    (ws / DIR).mkdir()
    (ws / CFG_LIST).write_text("[1, 2, 3]")
    (ws / CFG_BYTES).write_bytes(b"\xff\xfe\x00" + rand_bytes)
    (ws / CFG_EMPTY).write_text("")
    (ws / CFG_DIR).mkdir()
    (ws / CFG_DIR / "config.json").write_text('{"model_type": "qwen3", "hidden_size": "x"}')
    (ws / CFG_UNICODE).write_text('{"model_type": "ñø"}')
    return ws


def snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            st_ = os.stat(p)
            with open(p, "rb") as fh:
                digest = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.relpath(p, root)] = (st_.st_size, st_.st_mtime_ns, digest)
    return out


def run_cli(argv) -> tuple:
    """``fltune.cli.main(argv)`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:          # argparse: usage + one error line, status 2
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:            # anything else is a finding: keep its traceback
            import traceback
            traceback.print_exc()
            rc = "uncaught"
    return rc, out.getvalue(), err.getvalue()


# ---- argument strategies: (value, invalid?) ---------------------------------------------
# Each argument is drawn as (argv tokens, names) where ``names`` is None for a valid value
# and, for an invalid one, the strings of which the error line must contain at least one.

def _arg(flag, valid, invalid, omit=True):
    """``flag`` with a value from ``valid`` (expected to be accepted) or ``invalid`` (must
    be refused, and the refusal names the flag or the value); ``omit``: may be left out."""
    return flag, valid, invalid, omit


nan_inf = st.sampled_from(["nan", "inf", "-inf", "NaN", "1e400"])
not_a_number = st.sampled_from(["", "abc", "1,5", "0x10", "½", "١٢", "1e", " "])
huge_int = st.integers(min_value=2**40, max_value=2**80).map(str)
neg_int = st.integers(max_value=-1).map(str)


def ints(valid, lo_bad=None, hi_bad=None):
    bad = [not_a_number, neg_int, st.sampled_from(["1.5", "2.0"])]
    if lo_bad is not None:
        bad.append(st.just(str(lo_bad)))
    if hi_bad is not None:
        bad.append(st.integers(min_value=hi_bad, max_value=hi_bad * 4).map(str))
    return st.sampled_from(valid), st.one_of(*bad)


def floats(valid, bad_extra=()):
    neg = st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False).map(repr)
    return st.sampled_from(valid), st.one_of(nan_inf, not_a_number, neg,
                                               st.sampled_from(list(bad_extra) or ["-0.5"]))


unicode_junk = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                       min_size=0, max_size=30)
MODEL_BAD = st.one_of(
    st.sampled_from(["no-such-model", "Qwen3.5-0.8", "tiny_qwen3", "../tiny-qwen3", "/",
                     "a" * 300, CFG_LIST, CFG_BYTES, CFG_EMPTY, CFG_DIR, CFG_UNICODE, RAND,
                     TEXT, DIR, EMPTY, "Ω-模型"]),
    unicode_junk.filter(lambda s: s not in ("tiny-qwen3", ".", "") and not s.startswith("-")))
model_arg = _arg("--model", st.sampled_from(["tiny-qwen3", str(TINY_DIR),
                                             str(TINY_DIR / "config.json")]),
                 MODEL_BAD, omit=False)

TINY_OPS = ("fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul")
OPS_BAD = st.one_of(
    st.sampled_from(["", ",", " , ", "nope", "silu_and_mul,nope", "SILU_AND_MUL",
                     "silu-and-mul", "mrope", "gemma_rms_norm,silu_and_mul", "ü"]),
    unicode_junk.filter(lambda s: not {n.strip() for n in s.split(",") if n.strip()}
                        <= set(TINY_OPS) or not s.strip(", ")))
ops_arg = _arg("--ops", st.sampled_from(["silu_and_mul", "silu_and_mul,silu_and_mul",
                                         " silu_and_mul ,"]), OPS_BAD, omit=False)
dtype_arg = _arg("--dtype", st.sampled_from(["bf16", "fp32", "bfloat16", "FP16"]),
                 st.one_of(st.sampled_from(["garbage", "int8", "fp8", "float64", "", "bf 16"]),
                           unicode_junk.filter(lambda s: s.lower().strip() not in (
                               "bf16", "fp16", "fp32", "bfloat16", "float16", "half",
                               "float32", "float") and not s.startswith("-"))))
tp_arg = _arg("--tp", st.just("1"), st.one_of(st.sampled_from(["0", "1025", "1.0", "two"]),
                                               neg_int, huge_int))
max_tokens_arg = _arg("--max-tokens", *ints(["1", "2"], lo_bad=0, hi_bad=2**20 + 1), omit=False)
reps_arg = _arg("--reps", *ints(["0", "3"], hi_bad=10**6 + 1))
budget_arg = _arg("--budget", *floats(["0.001", "0.002"], ["0", "-0.0", "3601"]), omit=False)
parity_arg = _arg("--parity-floor", *floats(["0.99", "0.5", "1", "0"], ["1.0001", "2", "-1"]))
margin_arg = _arg("--margin", *floats(["0.03", "0", "1"], ["1.5", "-0.01"]))
timeout_arg = _arg("--candidate-timeout", *floats(["30", "120"], ["0", "86401"]))
noise_arg = _arg("--noise-floor", *floats(["9", "0.1"]))
threshold_arg = _arg("--threshold", *floats(["0.05", "0", "3"]))
copy_arg = _arg("--copy-mib", *ints(["1"], lo_bad=0, hi_bad=2**20 + 1), omit=False)
probes_arg = _arg("--max-probes", *ints(["1", "6"], lo_bad=0, hi_bad=65))
refine_ops_arg = _arg("--ops", ops_arg[1], OPS_BAD)
refine_model_arg = _arg("--model", model_arg[1], MODEL_BAD)
flag = st.sampled_from([[], ["--json"], ["--quiet"], ["--quiet", "--json"]])

#: read-side DB arguments: the valid one, the empty one (reads as empty), the bad ones
read_db = st.one_of(st.just((GOOD, None)), st.just((EMPTY, "maybe")),
                    st.sampled_from(BAD_DBS).map(lambda p: (p, "bad")))


#: --device-like values: omitted, ones that match the DB's one device (a prefix of its key,
#: its name, ""), ones that match nothing ("!": must be refused), and junk that may match
device_value = st.one_of(
    st.just(None), st.sampled_from(["<key>", "<key8>", "<name>", ""]),
    st.sampled_from(["!zzzz", "!no-such-gpu", "!<key>@nodriver", "!\u00fc\u00df"]),
    unicode_junk.filter(lambda s: not s.startswith(("-", "!", "<"))).map(lambda s: s or "?"))


@st.composite
def invocation(draw):
    """(argv with symbolic paths, names of the invalid arguments, names of arguments that
    may be refused, the paths it may write, the --out path or None)."""
    cmd = draw(st.sampled_from(["calibrate", "freeze", "report", "devices", "verify", "diff",
                                "bench", "candidates", "refine"]))
    # one invocation in four is clean (every argument valid: real, tiny work); the others
    # mix valid, omitted and invalid arguments
    clean = draw(st.integers(0, 3)) == 0
    parts, bad, may, writes, out = [cmd], [], [], [], None

    def add(arg):
        flag_, valid, invalid, omit = arg
        how = draw(st.sampled_from(["valid"] + (["omit"] if omit else []) +
                                   ([] if clean else ["invalid"])))
        if how == "omit":
            return
        v = draw(valid if how == "valid" else invalid)
        parts.extend([flag_, v])
        if how == "invalid":
            bad.append([flag_, v])

    def db_opt(flag_="--db", positional=False):
        path, kind = (GOOD, None) if clean else draw(read_db)
        parts.extend([path] if positional else [flag_, path])
        if kind == "bad":
            bad.append([path])
        elif kind == "maybe":
            may.append([path])
        return path, kind

    def dev_opt(flag_):
        v = draw(st.sampled_from([None, "<key>", "<name>"]) if clean else device_value)
        if v is not None:
            parts.extend([flag_, v])
            (bad if v.startswith("!") else may).append([flag_, v])
        return v

    def out_opt(required=False):
        choice = draw(st.sampled_from(["out.json", "sub/out.json"] + ([] if required else [None])
                                      + ([] if clean else ["", DIR, "nodir/out.json", "."])))
        if choice is None:
            return None
        parts.extend(["--out", choice])
        if choice in ("out.json", "sub/out.json"):
            return choice
        bad.append(["--out"])
        return None

    if cmd == "calibrate":
        add(model_arg)
        dbp = draw(st.sampled_from([GOOD, "new.db", "deep/er/new.db", EMPTY] +
                                   ([] if clean else [RAND, TEXT, FOREIGN, NEWER, DIR])))
        parts.extend(["--db", dbp])
        if dbp in (RAND, TEXT, FOREIGN, NEWER, DIR):
            bad.append([dbp])       # refused, and left byte-identical
        else:
            writes.append(dbp)
        for a in (tp_arg, dtype_arg, max_tokens_arg, parity_arg, margin_arg, reps_arg,
                  timeout_arg, ops_arg):
            add(a)
        add(budget_arg)        # always a budget and a max: keep real work tiny
        parts.append("--no-isolate")
        parts.extend(draw(flag))
    elif cmd == "freeze":
        db_opt()
        out = out_opt(required=True)
        if out is None and "--out" not in parts:
            parts.extend(["--out", "out.json"])
            out = "out.json"
        dev_opt("--device")
        o = draw(st.sampled_from([None, "measured", "fl"] +
                                 ([] if clean else ["fastest", "", "FL"])))
        if o is not None:
            parts.extend(["--order", o])
            if o not in ("measured", "fl"):
                bad.append(["--order"])
        parts.extend(draw(st.sampled_from([[], ["--json"], ["--strict"]])))
    elif cmd == "report":
        db_opt()
        dev_opt("--device")
        op = draw(st.sampled_from([None, "silu_and_mul", "rms_norm"] +
                                  ([] if clean else ["nope", "", "ü"])))
        if op is not None:
            parts.extend(["--op", op])
            if op in ("nope", "", "ü"):
                bad.append(["--op"])
        parts.extend(draw(st.sampled_from([[], ["--json"]])))
    elif cmd == "devices":
        db_opt()
        parts.extend(draw(st.sampled_from([[], ["--json"]])))
    elif cmd == "verify":
        db_opt()
        dev_opt("--device")
        for a in (ops_arg, noise_arg, reps_arg):
            add(a)
        add(budget_arg)
        out = out_opt()
        parts.extend(draw(st.sampled_from([["--quiet"], ["--json"], ["--quiet", "--all"]])))
    elif cmd == "diff":
        db_opt(positional=True)
        two = clean or draw(st.booleans())
        if two:
            db_opt(positional=True)
        a, b = dev_opt("--device-a"), dev_opt("--device-b")
        if not two and not (a and b):   # one DB: two devices of it, named
            bad.append(["--device-a", "--device-b"])
        add(threshold_arg)
        parts.extend(draw(st.sampled_from([[], ["--json"], ["--all"]])))
    elif cmd == "bench":
        add(model_arg)
        db_opt()
        dev_opt("--db-device")
        for a in (tp_arg, dtype_arg, max_tokens_arg, ops_arg, reps_arg, copy_arg, budget_arg):
            add(a)
        out = out_opt()
        parts.extend(draw(flag))
    elif cmd == "refine":
        path, kind = db_opt()
        if kind is None:
            writes.append(path)     # refine stores its run and the crossovers in the DB
        dev_opt("--device")
        for a in (refine_ops_arg, refine_model_arg, probes_arg, timeout_arg):
            add(a)
        out = out_opt()
        parts.append("--no-isolate")
        parts.extend(draw(flag))
    else:  # candidates
        add(dtype_arg)
        parts.append("--json")
    dev = draw(st.sampled_from([None, "cpu"] + ([] if clean else ["cuda", "tpu"]))) \
        if cmd in ("calibrate", "bench", "candidates") else None
    if dev is not None:
        parts.extend(["--device", dev])
        if dev == "tpu" or (dev == "cuda" and not torch.cuda.is_available()):
            bad.append(["--device"])
    return parts, bad, may, writes, out


def resolve(parts, ws: Path, dev: dict) -> list:
    """Symbolic names -> paths in this example's tree; device placeholders -> values."""
    names = {GOOD, EMPTY, RAND, TEXT, FOREIGN, NEWER, DIR, MISSING, "nodir/missing.db",
             "new.db", "deep/er/new.db", CFG_LIST, CFG_BYTES, CFG_EMPTY, CFG_DIR, CFG_UNICODE,
             "out.json", "sub/out.json", "nodir/out.json"}
    out = []
    for i, p in enumerate(parts):
        if p in names and i > 0:
            p = str(ws / p)
        elif p.startswith("<key") or p == "<name>" or p.startswith("!"):
            p = (p.lstrip("!").replace("<key8>", dev["key"][:8]).replace("<key>", dev["key"])
                 .replace("<name>", dev["name"]))
        out.append(p)
    return out


def _resolved_bad(bad, ws: Path, dev: dict) -> list:
    return [[resolve(["x", n], ws, dev)[1] for n in names] for names in bad]


@contextlib.contextmanager
def _chdir(path):
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def check_invocation(inv, good_db, rand_bytes=b"\x00garbage"):
    parts, bad, may, writes, out = inv
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        ws = make_tree(root, good_db["path"], rand_bytes)
        (ws / "sub").mkdir()
        argv = resolve(parts, ws, good_db)
        names = _resolved_bad(bad, ws, good_db)
        maybe = _resolved_bad(may, ws, good_db)
        before = snapshot(root)
        with _chdir(ws):
            rc, stdout, stderr = run_cli(argv[:])
        after = snapshot(root)
    ctx = f"argv={argv!r}\nrc={rc!r}\nstderr:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, ctx
    assert rc in (0, 1, 2), ctx
    if rc == 1:
        assert parts[0] == "verify", ctx            # only "stale" exits 1
    if rc == 2:
        lines = [ln for ln in stderr.split("\n") if ln.strip()]
        errs = [ln for ln in lines if ln.startswith("fltune") and ": error: " in ln]
        assert len(errs) == 1 and lines[-1] == errs[0], ctx
        if names:      # the line names one of the invalid arguments: flag, value or path
            assert any(n in errs[0] or repr(n)[1:-1] in errs[0]
                       for ns in names + maybe for n in ns), ctx
    if names:
        assert rc == 2, "an invalid argument was accepted\n" + ctx
    # no file created or modified except what the command was asked to write
    allowed = set()
    for w in writes:
        rel = os.path.relpath(ws / w, root)
        allowed |= {rel, rel + "-wal", rel + "-shm", rel + "-journal"}
        parent = os.path.dirname(rel)
        while parent and parent != "ws":
            allowed.add(parent)
            parent = os.path.dirname(parent)
    if out and (rc == 0 or (rc == 1 and parts[0] == "verify")):   # stale is a result
        allowed.add(os.path.relpath(ws / out, root))
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed <= allowed, f"touched {sorted(changed - allowed)}\n" + ctx
    return rc


# 40 random invocations per CI run (each a real CLI process, ~1.4 s; 80 took 110-255 s of a
# CI near its 45-minute budget): every run draws new ones, and the bugs found stay as
# @example below. FLTUNE_CLI_EXAMPLES=400 for a deeper search.
@settings(max_examples=int(os.environ.get("FLTUNE_CLI_EXAMPLES", 40)), deadline=None,
          database=None, suppress_health_check=[HealthCheck.too_slow,
                                                HealthCheck.function_scoped_fixture])
@given(inv=invocation(), rand_bytes=st.binary(min_size=1, max_size=2048))
# the bugs this property found, kept (each exited 0 or with a traceback, or wrote a file):
# --max-tokens 0 silently meant 2048; -3 raised ValueError
@example(inv=(["calibrate", "--model", "tiny-qwen3", "--db", "new.db", "--max-tokens", "0",
               "--ops", "silu_and_mul", "--budget", "0.001", "--no-isolate"],
              [["--max-tokens"]], [], ["new.db"], None), rand_bytes=b"x")
# NaN / out-of-range settings were stored and used
@example(inv=(["calibrate", "--model", "tiny-qwen3", "--db", "new.db", "--max-tokens", "1",
               "--ops", "silu_and_mul", "--parity-floor", "nan", "--margin", "-1",
               "--budget", "0.001", "--no-isolate"],
              [["--parity-floor"], ["--margin"]], [], ["new.db"], None), rand_bytes=b"x")
# unknown --ops: exit 0 and a run row with nothing measured
@example(inv=(["calibrate", "--model", "tiny-qwen3", "--db", "new.db", "--max-tokens", "1",
               "--ops", "nope", "--budget", "0.001", "--no-isolate"],
              [["--ops"]], [], ["new.db"], None), rand_bytes=b"x")
@example(inv=(["calibrate", "--model", "tiny-qwen3", "--db", "new.db", "--max-tokens", "1",
               "--ops", "mrope", "--budget", "0.001", "--no-isolate"],
              [["--ops"]], [], ["new.db"], None), rand_bytes=b"x")
# verify --ops naming an op the DB never calibrated read "ok: 0 bands re-measured" (CI, s12)
@example(inv=(["verify", "--db", GOOD, "--ops", "mrope", "--reps", "0", "--budget", "0.001",
               "--quiet"], [["--ops", "mrope"]], [], [], None), rand_bytes=b"\x00")
# a model config that is not UTF-8: UnicodeDecodeError
@example(inv=(["calibrate", "--model", CFG_BYTES, "--db", "new.db", "--max-tokens", "1",
               "--ops", "silu_and_mul", "--budget", "0.001", "--no-isolate"],
              [["--model", CFG_BYTES]], [], ["new.db"], None), rand_bytes=b"x")
# a file shorter than SQLite's header: calibrate overwrote it, readers read it as empty
@example(inv=(["calibrate", "--model", "tiny-qwen3", "--db", RAND, "--max-tokens", "1",
               "--ops", "silu_and_mul", "--budget", "0.001", "--no-isolate"],
              [[RAND]], [], [], None), rand_bytes=b"\x00")
@example(inv=(["devices", "--db", RAND], [[RAND]], [], [], None), rand_bytes=b"\x00")
# an empty file passed to a reader was turned into an fltune DB
@example(inv=(["report", "--db", EMPTY], [], [[EMPTY]], [], None), rand_bytes=b"x")
# --device cuda without CUDA: AssertionError
@example(inv=(["candidates", "--json", "--device", "cuda"],
              [] if torch.cuda.is_available() else [["--device"]], [], [], None),
         rand_bytes=b"x")
# --out a directory: IsADirectoryError after the work, and a stray temp file beside it
@example(inv=(["freeze", "--db", GOOD, "--out", DIR], [["--out"]], [], [], None),
         rand_bytes=b"x")
# refine took --ops, --max-probes and --out unchecked (no validators): an unknown op, no
# probe at all, a directory as --out after the work
@example(inv=(["refine", "--db", GOOD, "--ops", "nope", "--no-isolate"], [["--ops"]], [],
              [GOOD], None), rand_bytes=b"x")
@example(inv=(["refine", "--db", GOOD, "--max-probes", "0", "--no-isolate"],
              [["--max-probes"]], [], [GOOD], None), rand_bytes=b"x")
@example(inv=(["refine", "--db", GOOD, "--out", DIR, "--no-isolate"], [["--out"]], [],
              [GOOD], None), rand_bytes=b"x")
@example(inv=(["refine", "--db", EMPTY, "--no-isolate"], [], [[EMPTY]], [], None),
         rand_bytes=b"x")
# --threshold -1: ZeroDivisionError; --copy-mib -1: a negative tensor size
@example(inv=(["diff", GOOD, GOOD, "--threshold", "-1"], [["--threshold"]], [], [], None),
         rand_bytes=b"x")
# --threshold '١٢' (Arabic-Indic digits): Python's float() reads it as 12 and it was accepted
# (CI, 2026-12-01); every numeric flag now takes ASCII spellings only
@example(inv=(["diff", GOOD, GOOD, "--threshold", "١٢"], [["--threshold"]], [], [], None),
         rand_bytes=b"x")
@example(inv=(["bench", "--model", "tiny-qwen3", "--db", GOOD, "--ops", "silu_and_mul",
               "--max-tokens", "1", "--copy-mib", "-1", "--budget", "0.001", "--quiet"],
              [["--copy-mib"]], [], [], None), rand_bytes=b"x")
def test_property_cli_refuses_cleanly_and_touches_only_its_outputs(inv, rand_bytes, good_db):
    check_invocation(inv, good_db, rand_bytes)


# ---- a few real processes: the same property through `python -m fltune` ------------------

@pytest.mark.parametrize("argv, bad_path", [
    (["calibrate", "--model", "tiny-qwen3", "--db", RAND, "--margin", "0.03", "--ops",
      "silu_and_mul", "--max-tokens", "1", "--no-isolate"], RAND),
    (["report", "--db", FOREIGN], FOREIGN),
    (["freeze", "--db", GOOD, "--out", DIR], None),
])
def test_subprocess_cli_one_line_errors(tmp_path, good_db, argv, bad_path):
    ws = make_tree(tmp_path, good_db["path"], os.urandom(512))
    before = snapshot(tmp_path)
    p = subprocess.run([sys.executable, "-m", "fltune", *argv], cwd=ws, capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}"
                                                        f"{os.environ.get('PYTHONPATH', '')}"})
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1]
    assert last.startswith("fltune") and ": error: " in last
    if bad_path:
        assert bad_path in last and "left untouched" in last
    assert snapshot(tmp_path) == before
