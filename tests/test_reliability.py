"""Faults injected for real: candidates that segfault, abort, hang or return NaN, inside a
real calibration (supervised worker), and four processes calibrating into one DB at once
while readers read. Nothing may be lost and the calibration must go on."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fltune.tune.bands import bands

FIXTURES = Path(__file__).parent / "fixtures" / "bad_backends"
sys.path.insert(0, str(FIXTURES))      # the fixture modules, for tests that import them


def run_fltune(args, env=None, timeout=600):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "fltune", *args], capture_output=True,
                          text=True, timeout=timeout, env=e)


#: loads tests/fixtures/bad_backends (the deliberately broken candidates) into fltune
BAD_BACKENDS_ENV = {"FLTUNE_PLUGIN_MODULES": "fltune_bad_backends",
                    "PYTHONPATH": f"{FIXTURES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_crashing_and_hanging_candidates_are_refused_and_calibration_goes_on(tmp_path):
    db = str(tmp_path / "faults.db")
    p = run_fltune(["calibrate", "--model", "tiny-qwen3", "--db", db, "--ops", "silu_and_mul",
                    "--max-tokens", "4", "--budget", "0.003", "--candidate-timeout", "45",
                    "--quiet", "--json"], env=BAD_BACKENDS_ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    n_bands = len(bands(4))
    assert res["measured"] == n_bands
    # segfault, abort, hang: once each, then known bad for the rest of the run
    assert res["worker_restarts"] >= 3
    c = sqlite3.connect(db)
    rows = {(r[0], r[1]): (r[2], r[3]) for r in c.execute(
        "select impl_id, band_hi, outcome, reason from measurements")}
    first = min(b.hi for b in bands(4))
    assert rows[("vendor.segfault", first)][0] == "refused"
    assert "SIGSEGV" in rows[("vendor.segfault", first)][1]
    assert "SIGABRT" in rows[("vendor.abort", first)][1]
    assert rows[("vendor.hang", first)][0] == "refused" and "hung" in rows[("vendor.hang", first)][1]
    assert rows[("vendor.nan", first)][0] == "parity_failed"
    for b in bands(4):
        for bad in ("vendor.segfault", "vendor.abort", "vendor.hang"):
            assert rows[(bad, b.hi)][0] == "refused"
        assert rows[("vendor.slow", b.hi)][0] == "timed"      # good candidates still race
        assert rows[("reference.torch", b.hi)][0] == "timed"
    winners = c.execute("select band_hi, impl_id from winners").fetchall()
    assert len(winners) == n_bands
    assert not {w[1] for w in winners} & {"vendor.segfault", "vendor.abort", "vendor.hang",
                                          "vendor.nan"}
    assert c.execute("pragma integrity_check").fetchone()[0] == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_candidate_that_corrupts_the_cuda_context_is_refused_and_calibration_goes_on(tmp_path):
    """GPU only (run on the H200 through the device tool): a Triton kernel with an illegal
    memory access poisons its process's CUDA context; the supervised worker reports it,
    is replaced, and every other candidate still races in every band."""
    db = str(tmp_path / "cuda_fault.db")
    p = run_fltune(["calibrate", "--model", "tiny-qwen3", "--db", db, "--ops", "silu_and_mul",
                    "--device", "cuda", "--max-tokens", "64", "--candidate-timeout", "60",
                    "--quiet", "--json"], env=BAD_BACKENDS_ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["measured"] == len(bands(64)) and res["worker_restarts"] >= 1
    c = sqlite3.connect(db)
    rows = {(r[0], r[1]): (r[2], r[3]) for r in c.execute(
        "select impl_id, band_hi, outcome, reason from measurements")}
    first = min(b.hi for b in bands(64))
    outcome, reason = rows[("vendor.illegal_access", first)]
    assert outcome == "refused" and "CUDA" in reason, reason
    for b in bands(64):
        assert rows[("vendor.illegal_access", b.hi)][0] == "refused"
        assert rows[("reference.torch", b.hi)][0] == "timed"   # the next worker is healthy
    winners = {w[0] for w in c.execute("select impl_id from winners")}
    assert "vendor.illegal_access" not in winners and len(winners) >= 1
    assert c.execute("pragma integrity_check").fetchone()[0] == "ok"


def test_four_concurrent_calibrations_and_readers(tmp_path):
    """FlagGems #6121 ("database is locked" at TP=4) is the failure to beat."""
    db = str(tmp_path / "shared.db")
    jobs = [("Qwen3-0.6B", "silu_and_mul"), ("Qwen3-0.6B", "rms_norm"),
            ("Llama-3.1-8B", "silu_and_mul"), ("Qwen3-0.6B", "fused_add_rms_norm")]
    procs = [subprocess.Popen([sys.executable, "-m", "fltune", "calibrate", "--model", m,
                               "--db", db, "--ops", op, "--max-tokens", "16", "--budget",
                               "0.002", "--no-isolate", "--quiet", "--json"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for m, op in jobs]
    read_errors, reads = [], [0]
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            if not os.path.exists(db):
                time.sleep(0.05)
                continue
            p = subprocess.run([sys.executable, "-m", "fltune", "devices", "--db", db, "--json"],
                               capture_output=True, text=True, timeout=120)
            if p.returncode != 0 and "does not exist" not in p.stderr:
                read_errors.append(p.stderr[-500:])
            reads[0] += 1
    t = threading.Thread(target=reader)
    t.start()
    outs = [p.communicate(timeout=900) for p in procs]
    stop.set()
    t.join()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "locked" not in err
    assert not read_errors, read_errors[:2]
    assert reads[0] >= 1
    c = sqlite3.connect(db)
    assert c.execute("pragma integrity_check").fetchone()[0] == "ok"
    n = len(bands(16))
    # Qwen3-0.6B rms_norm: 3 shapes; the others 1 shape each; Llama silu has its own shape
    expected = (1 + 3 + 1 + 1) * n
    assert c.execute("select count(*) from winners").fetchone()[0] == expected
    measured = sum(json.loads(o)["measured"] for o, _ in outs)
    assert measured == expected
    assert c.execute("select count(*) from runs where status='done'").fetchone()[0] == 4


def test_edited_manifest_and_other_device_manifest_refused(tmp_path):
    """A manifest edited after freezing, and one for another device: clear errors naming the
    file, nothing overwritten."""
    from fltune.dispatch.manifest import ManifestError, load_manifest
    from fltune.freeze import check_device

    db = str(tmp_path / "m.db")
    p = run_fltune(["calibrate", "--model", "tiny-qwen3", "--db", db, "--ops", "silu_and_mul",
                    "--max-tokens", "2", "--budget", "0.002", "--no-isolate", "--quiet"])
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "m.json"
    assert run_fltune(["freeze", "--db", db, "--out", str(out)]).returncode == 0
    m = json.loads(out.read_text())
    assert check_device(m) is None
    band = m["ops"]["silu_and_mul"]["tables"][0]["bands"][0]
    # another winner than the frozen one (session 46's CI: on a loaded machine the
    # reference itself won the band, so "editing" it to the reference changed nothing)
    band["impl_id"] = "reference.torch" if band["impl_id"] != "reference.torch" else "native.vllm"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(m))
    before = edited.read_bytes()
    with pytest.raises(ManifestError) as e:
        load_manifest(str(edited))
    assert str(edited) in str(e.value) and "fingerprint" in str(e.value)
    assert edited.read_bytes() == before
    other = json.loads(out.read_text())
    other["device"]["device_key"] = "0000deadbeef0000"
    other["device"]["name"] = "NVIDIA H200"
    why = check_device(other)
    assert why and "NVIDIA H200" in why


def test_truncated_db_is_refused_and_left_untouched(tmp_path):
    db = tmp_path / "t.db"
    p = run_fltune(["calibrate", "--model", "tiny-qwen3", "--db", str(db), "--ops", "silu_and_mul",
                    "--max-tokens", "8", "--budget", "0.002", "--no-isolate", "--quiet"])
    assert p.returncode == 0, p.stderr[-2000:]
    with open(db, "r+b") as f:
        f.truncate(os.path.getsize(db) // 3)
    before = db.read_bytes()
    for args in (["report", "--db", str(db)],
                 ["calibrate", "--model", "tiny-qwen3", "--db", str(db), "--max-tokens", "2",
                  "--no-isolate", "--quiet"]):
        p = run_fltune(args)
        assert p.returncode == 2, (args, p.stderr[-1000:])
        assert str(db) in p.stderr and "left untouched" in p.stderr
        assert db.read_bytes() == before


def test_band_too_big_for_memory_is_refused_not_crashed(monkeypatch):
    import torch

    from fltune.dispatch import get_default_manager
    from fltune.tune import race as adj
    from fltune.tune.bands import Band

    monkeypatch.setattr(adj, "_free_memory", lambda device: 1 << 20)     # 1 MiB "free"
    impls = get_default_manager().registry.get_implementations("silu_and_mul")
    v = adj.race("silu_and_mul", {"intermediate": 3584}, torch.bfloat16, Band(513, 1024),
                       impls, adj.Settings(device="cpu"))
    assert v.winner is None
    assert {o.outcome for o in v.outcomes} == {"refused"}
    assert all("GiB" in o.reason for o in v.outcomes)


def test_gpu_manifest_on_a_cpu_machine_is_a_clear_mismatch():
    """The shipped H200 manifest, checked here (no CUDA): a reason, not a crash."""
    import torch

    from fltune.freeze import check_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    m = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" /
                    "h200-serve-2026-11-29" / "manifest.json").read_text())
    why = check_device(m)
    assert why and "NVIDIA H200" in why and "CUDA" in why


def test_a_declared_first_call_gets_its_allowance_and_an_undeclared_one_hangs(monkeypatch):
    """A candidate whose first call builds its kernel for longer than the hang timeout
    (FlashInfer's GDN JIT on the H200: minutes) races when it declares it
    (``OpImpl.first_call_s``: one untimed call under that allowance before parity), and is
    refused as hung when it does not, or when its build outlasts what it declared (then
    blamed on it by name, known bad for the run, and the band still has a winner); the same
    supervised worker as in calibration."""
    import fltune_slow_first_call as fx  # noqa: E402  (tests/fixtures/bad_backends)

    from fltune.ops import get_op
    from fltune.tune.bands import Band
    from fltune.tune.race import Settings
    from fltune.tune.worker import WorkerPool

    from fltune.dispatch.manager import get_default_manager

    spec = get_op("silu_and_mul")
    impls = {i.impl_id: i for i in fx.implementations()}
    impls["reference.torch"] = get_default_manager().registry.get("silu_and_mul",
                                                                 "reference.torch")
    # builds of 10 s, a hang timeout of 5 s (wide enough for a loaded 2-core machine's
    # gaps between a healthy candidate's progress messages)
    env = {"FLTUNE_PLUGIN_MODULES": "fltune_slow_first_call", "FLTUNE_TEST_BUILD_S": "10"}
    settings = Settings(device="cpu", reps=3)
    with WorkerPool(timeout_s=5.0, env=env) as pool:
        v = pool.adjudicate("silu_and_mul", spec.default_dims, torch.float32, Band(1, 4),
                            list(impls.values()), settings)
        known_bad = set(i for _, _, i in pool.known_bad)
    out = {o.impl.impl_id: o for o in v.outcomes}
    assert out["vendor.jit_declared"].outcome == "timed"
    assert out["vendor.jit_declared"].timing.median_us < 1e6     # the build was not timed
    assert out["vendor.jit_undeclared"].outcome == "refused"
    assert "hung" in out["vendor.jit_undeclared"].reason
    # a build longer than its own allowance: blamed on it, by name, in its first call
    assert out["vendor.jit_short"].outcome == "refused"
    assert "first-call allowance" in out["vendor.jit_short"].reason
    assert "during first_call" in out["vendor.jit_short"].reason
    assert {"vendor.jit_short", "vendor.jit_undeclared"} <= known_bad
    assert out["reference.torch"].outcome == "timed" and v.winner is not None
