"""``fltune calibrate --ray`` / ``fltune verify --ray`` on a real local Ray cluster (two CPUs, so
two ``num_cpus=1`` actors stand in for two GPUs of one device key: the same code path as on
GPUs) and real SQLite files: the split calibration writes exactly the bands a single-process
calibration writes; killed actors lose nothing already written and the rerun completes; a
drifted winner names its node; without Ray installed, ``--ray`` says how to get it and every
other command works.

Kept small (the tiny model, two ops, bands 1/2/4, 3 ms of timing per candidate, races in
process): the point is the distribution, not the timings."""
from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys

import pytest

from fltune.tune.calibrate import calibrate
from fltune.tune.race import Settings

from conftest import child_env, copy_db

if os.environ.get("CI"):
    import ray      # CI installs it (scripts/setup.sh): a missing install must fail there
else:
    ray = pytest.importorskip("ray", reason="pip install 'fltune[ray]'")

from fltune.evaluate.ray_verify import verify_ray  # noqa: E402
from fltune.tune import ray_calibrate as rc  # noqa: E402

MODEL = "tiny-qwen3"
OPS = ["rms_norm", "silu_and_mul"]      # 3 rms_norm shapes + 1 silu_and_mul: 4 tables
MAX_TOKENS = 4                          # bands 1, 2, 4
N_BANDS = 4 * 3
FAST = Settings(budget_s=0.003)


@pytest.fixture(scope="module")
def cluster():
    """A local cluster of two CPUs on the loopback address, shared by this module."""
    ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
             object_store_memory=80 * 2**20, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


def run_ray(db, **kw):
    kw = {"actors": 2, "max_tokens": MAX_TOKENS, "ops": OPS, "settings": FAST,
          "isolate": False, "warn": lambda line: None, **kw}
    return rc.calibrate_ray(MODEL, str(db), **kw)


def bands_of(db) -> set:
    con = sqlite3.connect(db)
    try:
        return set(con.execute("select op, signature, dtype, band_lo, band_hi from winners"))
    finally:
        con.close()


def candidates_of(db) -> set:
    con = sqlite3.connect(db)
    try:
        return set(con.execute("select op, signature, dtype, band_hi, impl_id from "
                               "measurements"))
    finally:
        con.close()


@pytest.fixture(scope="module")
def single_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("single") / "single.db"
    res = calibrate(MODEL, str(db), max_tokens=MAX_TOKENS, ops=OPS, settings=FAST,
                    isolate=False, warn=lambda line: None)
    assert res.measured == N_BANDS
    return db


@pytest.fixture(scope="module")
def split(cluster, tmp_path_factory):
    db = tmp_path_factory.mktemp("ray") / "ray.db"
    return db, run_ray(db, spread_every=2)


def test_two_actors_write_the_bands_of_a_single_process_calibration(single_db, split):
    db, res = split
    assert not res.incomplete and res.measured == N_BANDS and res.skipped == 0
    # band for band: the same tables, bands and candidates as one process measures
    assert bands_of(db) == bands_of(single_db) and len(bands_of(db)) == N_BANDS
    assert candidates_of(db) == candidates_of(single_db)
    # the work was shared: both actors measured, one device key, one run, written once
    assert [a["bands"] > 0 for a in res.actors] == [True, True]
    assert len(res.groups) == 1 and res.groups[0]["measured"] == N_BANDS
    con = sqlite3.connect(db)
    assert con.execute("select count(*) from winners").fetchone()[0] == N_BANDS
    single = sqlite3.connect(single_db)
    assert {r[0] for r in con.execute("select device_key from winners")} == \
        {r[0] for r in single.execute("select device_key from winners")}
    runs = con.execute("select status, settings from runs").fetchall()
    assert len(runs) == 1 and runs[0][0] == "done"
    assert len(json.loads(runs[0][1])["ray"]["actors"]) == 2
    assert con.execute("pragma integrity_check").fetchone()[0] == "ok"


def test_a_rerun_with_every_band_cached_ends_each_table_once(split, tmp_path):
    """A calibration rerun on a DB that holds every band skips them all, and the progress
    events end each table (``last``) exactly once, as ``calibrate``'s do: until session 46
    a ``--ray`` rerun's skips never ended a table on the progress bar."""
    import shutil

    db = tmp_path / "again.db"
    shutil.copy(split[0], db)
    events: list = []
    res = run_ray(db, spread_every=0, progress=lambda e, **kw: events.append((e, kw)))
    assert res.measured == 0 and res.skipped == N_BANDS
    skips = [kw for e, kw in events if e == "skip"]
    assert len(skips) == N_BANDS and not [e for e, _ in events if e == "band"]
    tables = {(kw["op"], kw["signature"], kw["dtype"]) for kw in skips}
    ended = [(kw["op"], kw["signature"], kw["dtype"]) for kw in skips if kw["last"]]
    assert sorted(ended) == sorted(tables)


def test_sampled_bands_store_their_spread_between_two_actors_as_noise(split):
    db, res = split
    samples = res.groups[0]["spread_samples"]
    # every 2nd band of each table (bands 1 and 4 of 4 tables), raced on the other actor
    assert len(samples) == 8 and {s["band_hi"] for s in samples} == {1, 4}
    con = sqlite3.connect(db)
    rows = con.execute("select phase, spread, median_us from noise_probes where phase like "
                       "'peer-spread %'").fetchall()
    assert len(rows) == sum(s["spread"] is not None for s in samples) > 0
    for s in samples:
        if s["spread"] is None:
            continue
        noise, = con.execute("select noise from winners where op=? and signature=? and "
                             "dtype=? and band_hi=?", [s["op"], s["signature"], s["dtype"],
                                                       s["band_hi"]]).fetchone()
        assert noise >= s["spread"] - 1e-12
        # the spread is the two actors' difference for the winner, relative to the faster
        assert s["spread"] == pytest.approx(abs(s["us"] - s["peer_us"]) /
                                            min(s["us"], s["peer_us"]))


def test_an_actor_dead_before_its_first_band_leaves_the_run_to_the_others(cluster, tmp_path):
    """An actor lost between its start and its start probe (a node gone meanwhile) is left
    out with a warning, and the live one measures every band: until session 46 the probe's
    Ray error ended the whole run."""
    names, warned = [], []

    def progress(event, **kw):
        if event == "start":
            names.extend(kw["actors"])
            kill(ray.get_actor(names[0]))           # after the start, before the probes

    res = run_ray(tmp_path / "early.db", spread_every=0, progress=progress, warn=warned.append)
    assert not res.incomplete and res.measured == N_BANDS
    assert [a["alive"] for a in res.actors] == [False, True]
    assert [a["bands"] for a in res.actors] == [0, N_BANDS]
    assert any("died" in w and res.actors[0]["actor"] in w for w in warned), warned


def test_cold_weights_on_cpu_actors_says_it_changed_nothing(cluster, tmp_path):
    # the actors' device decides (CPU here): the run's warnings carry the one line
    # calibrate prints (race.cold_weights_unused), and it is handed to warn at once
    seen = []
    res = run_ray(tmp_path / "cw.db", ops=["silu_and_mul"], max_tokens=2,
                  settings=Settings(budget_s=0.003, cold_weights=True), warn=seen.append)
    assert res.measured == 2
    notes = [w for w in res.warnings if w.startswith("--cold-weights")]
    assert len(notes) == 1 and "(CPU device)" in notes[0] and notes[0] in seen


def kill(actor, wait_s: float = 60.0):
    """``ray.kill`` and wait until the actor is dead: the kill goes through the GCS and
    returns before it lands, and on a loaded machine the driver could hand the doomed actor
    another band meanwhile (a call queued behind its band raises once it is dead)."""
    import time
    ray.kill(actor)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        time.sleep(0.05)


def test_killed_actors_lose_nothing_written_and_the_rerun_completes(cluster, tmp_path):
    db = tmp_path / "killed.db"
    seen, names = [], []

    def progress(event, **kw):
        if event == "start":
            names.extend(kw["actors"])
        elif event == "band":
            seen.append(kw["actor"])
            if len(seen) == 1:
                kill(ray.get_actor(names[0]))      # one GPU lost: the other goes on
            elif len(seen) == 6:
                kill(ray.get_actor(names[1]))      # the last one lost: run incomplete

    res = run_ray(db, spread_every=0, progress=progress)
    assert res.incomplete
    assert [a["alive"] for a in res.actors] == [False, False]
    done = bands_of(db)
    assert len(done) == res.measured == len(seen) and 0 < res.measured < N_BANDS
    assert res.groups[0]["missing"] == N_BANDS - res.measured
    # between the two kills the survivor took over the dead actor's work (the killed one
    # may still hand in the one band it had finished when it was killed)
    survivor, killed = res.actors[1]["actor"], res.actors[0]["actor"]
    assert seen[1:].count(killed) <= 1
    assert seen[1:].count(survivor) >= len(seen) - 2
    con = sqlite3.connect(db)
    assert con.execute("select status from runs").fetchall() == [("incomplete",)]
    con.close()

    again = run_ray(db, spread_every=0)
    assert not again.incomplete
    assert again.skipped == res.measured and again.measured == N_BANDS - res.measured
    assert done <= bands_of(db) and len(bands_of(db)) == N_BANDS
    con = sqlite3.connect(db)
    assert con.execute("select count(*) from winners").fetchone()[0] == N_BANDS
    assert [r[0] for r in con.execute("select status from runs order by id")] == \
        ["incomplete", "done"]


def test_killed_driver_loses_nothing_written_and_the_rerun_resumes(cluster, tmp_path):
    """``fltune calibrate --ray ADDRESS`` in its own process, joined to this module's cluster,
    SIGKILLed once three bands are in the DB; Ray ends that driver's actors, and the same
    calibration rerun measures exactly the bands that were not written."""
    import signal
    import time

    db = tmp_path / "driver.db"
    address = ray.get_runtime_context().gcs_address
    p = subprocess.Popen([sys.executable, "-m", "fltune", "calibrate", "--model", MODEL,
                          "--db", str(db), "--ops", ",".join(OPS), "--max-tokens",
                          str(MAX_TOKENS), "--budget", "0.003", "--no-isolate", "--quiet",
                          "--ray", address, "--ray-actors", "2", "--ray-spread-every", "0"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=child_env())
    deadline = time.monotonic() + 300
    written = 0
    try:
        while written < 3:
            assert p.poll() is None, f"the driver ended before it was killed: {p.stderr.read()}"
            assert time.monotonic() < deadline, "no 3 bands within 300 s"
            time.sleep(0.2)
            if db.exists():
                con = sqlite3.connect(db)
                try:
                    written = con.execute("select count(*) from winners").fetchone()[0]
                except sqlite3.OperationalError:     # the schema is not there yet
                    written = 0
                con.close()
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    before = bands_of(db)
    assert 3 <= len(before) < N_BANDS
    con = sqlite3.connect(db)
    assert con.execute("select status from runs").fetchall() == [("running",)]
    con.close()

    again = run_ray(db, spread_every=0)
    assert not again.incomplete
    assert again.skipped == len(before) and again.measured == N_BANDS - len(before)
    assert before <= bands_of(db) and len(bands_of(db)) == N_BANDS
    con = sqlite3.connect(db)
    assert con.execute("select count(*) from winners").fetchone()[0] == N_BANDS
    assert con.execute("pragma integrity_check").fetchone()[0] == "ok"


def test_verify_ray_names_the_node_whose_winner_drifted(split, tmp_path):
    db, _ = split
    tampered = tmp_path / "tampered.db"
    con = copy_db(db, tampered)
    # one winner stored a million times faster than it runs, its band's noise cleared: that
    # band, and so this node, drifted. (A factor of 1000 once read "ok" on a loaded CI
    # machine: verify's noise is the re-timing's own p10-p90 spread too, and five samples of
    # a ~10 µs op with one preemption of ~10 ms among them spread 1000x.)
    con.execute("update winners set median_us = median_us / 1e6, noise = 0 "
                "where op='silu_and_mul' and band_hi=2")
    con.commit()
    con.close()
    doc = verify_ray(str(tampered), noise_floor=10.0, budget_s=0.003, isolate=False)
    assert len(doc["nodes"]) == 1
    node = doc["nodes"][0]
    seen = {k: node.get(k) for k in ("status", "error", "counts")}
    seen["tampered"] = [{k: b.get(k) for k in ("status", "ratio", "noise", "reasons")}
                        for b in node["bands"]
                        if (b["op"], b["band_hi"]) == ("silu_and_mul", 2)]
    assert doc["drifted_nodes"] == [node["node"]] and doc["stale"], seen
    assert node["checked"] == N_BANDS
    bad = {(b["op"], b["band_hi"]): b["status"] for b in node["bands"] if b["status"] != "ok"}
    # the tampered band moved; another band's close winner may flip on a loaded machine
    assert bad[("silu_and_mul", 2)] == "moved"


def test_cli_calibrate_and_verify_with_ray(cluster, tmp_path, capsys):
    """The CLI's --ray path, in process on the module's cluster (connect() reuses it)."""
    from fltune.cli.main import main

    db = str(tmp_path / "cli.db")
    rc_ = main(["calibrate", "--model", MODEL, "--db", db, "--ops", "silu_and_mul",
                "--max-tokens", "2", "--budget", "0.003", "--no-isolate", "--ray",
                "--ray-actors", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc_ == 0 and out["measured"] == 2 and out["device_type"] == "cpu"
    assert len(bands_of(db)) == 2
    rc_ = main(["verify", "--db", db, "--ray", "--no-isolate", "--budget", "0.003",
                "--noise-floor", "10", "--json"])
    doc = json.loads(capsys.readouterr().out)
    # whether a close winner flips on re-timing is the loaded machine's noise; the exit
    # code follows what verify found (0 = no node drifted, 1 = some did)
    assert doc["checked"] == 2 and rc_ == (1 if doc["drifted_nodes"] else 0)
    # a GPU-only request on a cluster without GPUs: one line, exit 2, nothing written
    rc_ = main(["calibrate", "--model", MODEL, "--db", str(tmp_path / "none.db"), "--ray",
                "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc_ == 2 and "no GPU" in err and "--device cpu" in err
    assert not os.path.exists(tmp_path / "none.db")


HIDE_RAY = "import sys; sys.modules['ray'] = None\n"


def test_without_ray_every_command_works_and_ray_says_how_to_install(single_db, tmp_path):
    """Ray hidden in a fresh interpreter (``import ray`` raises ImportError there, as when it
    is not installed): --ray is one line naming ``pip install 'fltune[ray]'``, touching no
    file; the same commands without --ray work."""
    before = single_db.read_bytes()
    code = HIDE_RAY + """
import json
from fltune.cli.main import main
import fltune.tune.ray_calibrate            # importable without ray
import fltune.evaluate.ray_verify
db, new = sys.argv[1], sys.argv[2]
out = {
  "cal": main(["calibrate", "--model", "tiny-qwen3", "--db", new, "--ray"]),
  "verify": main(["verify", "--db", db, "--ray"]),
  "actors": main(["calibrate", "--model", "tiny-qwen3", "--db", new, "--ray-actors", "2"]),
  "devices": main(["devices", "--db", db, "--json"]),
}
print("RESULT " + json.dumps(out))
"""
    new = tmp_path / "new.db"
    p = subprocess.run([sys.executable, "-c", code, str(single_db), str(new)],
                       capture_output=True, text=True, timeout=300, env=child_env())
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    assert got == {"cal": 2, "verify": 2, "actors": 2, "devices": 0}, p.stderr
    errs = [x for x in p.stderr.splitlines() if x.startswith("fltune: error:")]
    assert len(errs) == 3
    assert all("pip install 'fltune[ray]'" in e and "leave --ray out" in e for e in errs[:2])
    assert "--ray-actors belongs to --ray" in errs[2]
    assert not new.exists() and single_db.read_bytes() == before


def test_an_address_where_no_cluster_answers_is_one_line_not_a_hang(tmp_path):
    """Ray itself retries such an address for ever; fltune refuses it at once."""
    db = tmp_path / "x.db"
    p = subprocess.run([sys.executable, "-m", "fltune", "calibrate", "--model", MODEL, "--db",
                        str(db), "--ray", "127.0.0.1:1"], capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("fltune: error: --ray 127.0.0.1:1: "
                                                        "nothing answers there")
    assert "ray start --head" in p.stderr and "Traceback" not in p.stderr
    assert not db.exists()


def test_a_held_band_that_cannot_be_saved_does_not_hide_the_runs_error(tmp_path):
    """``_RayCalibration.close`` runs however the run ended: it writes the sampled bands
    still held for a second card, then marks each group's run. After an error, where the
    DB fails too (here its connection already closed under it, as a broken file would),
    each step is warned of and closing goes on, so the error that ended the run is the one
    the user sees; a run that ended well still raises it. No Ray needed (no actors)."""
    import sqlite3

    from fltune.store import CalibrationDB

    def broken_run():
        run = rc._RayCalibration.__new__(rc._RayCalibration)
        warned: list = []
        run.db, run.warn, run.handles, run.started = (
            CalibrationDB(str(tmp_path / "c.db")), warned.append, [], False)
        run.db.close()                                          # the DB gone under it
        run.status = "failed"
        run.groups = [rc.Group({"device_key": "k", "driver": "d"}, {}, "s", [0], run_id=3)]
        job = {"op": "rms_norm", "signature": "h=8", "dtype": "float16", "hi": 4}
        run.held = {rc._band_key(job): (run.groups[0], {"rows": [], "win": None}, job)}
        return run, warned

    run, warned = broken_run()
    run.close(after_error=True)
    assert "rms_norm [h=8] float16 <= 4 was measured but could not be saved" in warned[0]
    assert "run 3 could not be marked failed" in warned[1] and len(warned) >= 2
    run, warned = broken_run()
    with pytest.raises(sqlite3.Error):
        run.close(after_error=False)
