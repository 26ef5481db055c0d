"""benchmarks/aa_design.py: from an A/A run's variance components, the processes a side an
A/A within the target needs, and whether that many engines fit the card. Synthetic A/A
samples with known process offsets and noise stand in for a GPU run (the CI and the
simulation are the real code: ``hierarchical_ci`` via ``procs_coverage.run``)."""
from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "aa_design.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("aa_design", SCRIPT)
aad = importlib.util.module_from_spec(spec)
spec.loader.exec_module(aad)

FAST = {"sims": 40, "resamples": 300}


def _raw(sigma_p: float, sigma_e: float, procs: int = 4, reps: int = 12, seed: int = 1):
    """An A/A raw file: vanilla and aa, ``procs`` processes each, one scenario."""
    rng = random.Random(seed)
    off = {(arm, j): rng.gauss(0, sigma_p) for arm in ("vanilla", "aa")
           for j in range(1, procs + 1)}
    samples = []
    for r in range(reps):
        level = rng.gauss(0, 0.03)
        for (arm, j), o in off.items():
            samples.append({"scenario": "prefill_2048", "arm": arm, "replica": j, "rep": r,
                            "time_s": 0.03 * math.exp(level + o + rng.gauss(0, sigma_e))})
    return {"baseline": "vanilla", "scenarios": [], "samples": samples, "points": []}


def test_quiet_processes_reach_the_target_with_few():
    rows = aad.design(_raw(0.0005, 0.004), target=1.0, arms=2, **FAST)
    (row,) = rows
    assert row["procs_needed"] == 2 and row["fits_card"]
    assert "reachable" in aad.verdict(row, 1.0)


def test_a_large_process_offset_needs_more_processes_than_the_card_holds():
    # sigma_p ~1.5 %: processes alone would need far more than 80 GiB / 9.4 GiB holds
    raw = _raw(0.015, 0.004, procs=4, reps=12)
    (row,) = aad.design(raw, target=1.0, arms=3, max_procs=6, **FAST)
    assert row["sigma_p_pct"] > 0.8
    assert row["procs_needed"] is None
    assert row["by_procs"][6] > 1.0 and row["by_procs"][2] > row["by_procs"][6]
    v = aad.verdict(row, 1.0)
    assert "sigma_p must fall" in v and "the 2 a side that fit" in v     # 8 engines, 3 arms
    # the one-process CI leaves sigma_p out: narrow, and dishonest (coverage well below 95 %)
    assert row["coverage"][1] < 0.8


def test_the_model_check_compares_with_the_runs_own_reading():
    raw = _raw(0.01, 0.01, procs=3, reps=10)
    raw["points"] = [{"scenario": "prefill_2048", "arm": "aa", "n": 10, "ci_low": 0.98,
                      "ci_high": 1.02, "procs_arm": 3, "procs_vanilla": 3}]
    (row,) = aad.design(raw, target=1.0, arms=2, max_procs=2, **FAST)
    assert row["observed"]["procs"] == 3 and abs(row["observed"]["half_width_pct"] - 2.0) < 1e-9
    assert row["model_check_pct"] > 0.5


def test_engine_memory_comes_from_the_runs_preflight_where_recorded():
    assert aad.engine_gib_of({"host": {}}) is None
    raw = {"host": {"memory_preflight": [{"per_engine_mib": 6000}, {"per_engine_mib": 6400}]}}
    assert aad.engine_gib_of(raw) == 6.25


def test_cli_writes_json_and_refuses_a_bad_file(tmp_path):
    raw = tmp_path / "e2e-raw.json"
    raw.write_text(json.dumps(_raw(0.0005, 0.004)))
    out = tmp_path / "design.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(raw), "--arms", "2", "--sims", "30",
                        "--max-procs", "3", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "prefill_2048" in p.stdout and "sigma_p" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["procs_needed"] == 2 and doc["engine_gib"] == 9.4
    bad = tmp_path / "summary.json"
    bad.write_text(json.dumps({"points": []}))
    p = subprocess.run([sys.executable, str(SCRIPT), str(bad)], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 2 and "e2e-summary.json?" in p.stderr


def test_only_the_vanilla_arms_make_the_components():
    # an A/B arm 5 % slower with its own processes, and a point of its own listed first:
    # neither may enter the A/A's components or its reading
    raw = _raw(0.0005, 0.004, procs=2, reps=10)
    raw["samples"] += [{**s, "arm": "calibrated", "time_s": s["time_s"] * (1.05 + 0.02 * s["replica"])}
                       for s in raw["samples"] if s["arm"] == "aa"]
    raw["arms"] = {"vanilla": {"env": {}}, "aa": {"env": {}},
                   "calibrated": {"env": {"FLTUNE_DB": "x.db"}},
                   "vanilla.p2": {"env": {}, "arm": "vanilla", "replica": 2},
                   "aa.p2": {"env": {}, "arm": "aa", "replica": 2},
                   "calibrated.p2": {"env": {"FLTUNE_DB": "x.db"}, "arm": "calibrated",
                                     "replica": 2}}
    raw["points"] = [{"scenario": "prefill_2048", "arm": "calibrated", "ci_low": 0.9,
                      "ci_high": 0.96, "procs_arm": 2, "procs_vanilla": 2},
                     {"scenario": "prefill_2048", "arm": "aa", "ci_low": 0.995,
                      "ci_high": 1.005, "procs_arm": 2, "procs_vanilla": 2}]
    assert aad.vanilla_arms(raw) == {"vanilla", "aa"}
    (row,) = aad.design(raw, target=1.0, arms=2, max_procs=2, **FAST)
    assert row["sigma_p_pct"] < 0.3                      # the A/B's offsets kept out
    assert row["observed"]["arm"] == "aa"
    assert abs(row["observed"]["half_width_pct"] - 0.5) < 1e-9


def test_where_the_processes_that_fit_fall_short_fresh_generations_are_planned():
    """sigma_p ~1 % with little sample noise: the two processes a side that fit (3 arms,
    80 GiB) cannot reach ±1 %, started afresh in enough generations they can; the plan
    counts only a design whose simulated CI is honest (coverage at least ``HONEST``), and
    the verdict names the flag."""
    raw = _raw(0.01, 0.003, procs=4, reps=12, seed=2)
    (row,) = aad.design(raw, target=1.0, arms=3, max_procs=3, **FAST)
    assert not row["fits_card"]
    gen = row["with_generations"]
    assert gen["procs"] == 2 and gen["generations_needed"] in aad.GENERATIONS
    g = gen["generations_needed"]
    assert gen["by_generations"][g] <= 1.0 and gen["coverage"][g] >= aad.HONEST
    assert gen["reps"] == max(row["reps_plan"], 2 * g)
    # every smaller generation count tried fell short of the target or of honesty
    assert all(hw > 1.0 or gen["coverage"][k] < aad.HONEST
               for k, hw in gen["by_generations"].items() if k < g)
    assert f"--generations {g}" in aad.verdict(row, 1.0)
    (quiet,) = aad.design(_raw(0.0005, 0.004), target=1.0, arms=2, **FAST)
    assert "with_generations" not in quiet                 # nothing to plan where K fits


def _clocked(raw: dict, rep_s: float, *, began=None, restarts=(), first_start=None,
             loaded=40.0) -> dict:
    """``raw`` with each sample's runs on the clock: a repetition takes ``rep_s`` seconds
    spread evenly over its samples (one run each), 100 s between repetitions."""
    by_rep: dict = {}
    for s in raw["samples"]:
        by_rep.setdefault(s["rep"], []).append(s)
    for r, ss in by_rep.items():
        for i, s in enumerate(ss):
            s["host"] = [{"t_mono": 1000.0 + 100.0 * r + rep_s * i / (len(ss) - 1)}]
    raw["arms"] = {"vanilla": {"env": {}, "start_s": loaded,
                               "first_start": {"start_s": first_start} if first_start else None},
                   "aa": {"env": {}, "start_s": loaded}}
    raw["host"] = {"generations": {"restarts": [{"s": x} for x in restarts]}}
    if began is not None:       # ready 10 s before the first timed run (the warm-ups)
        raw["host"]["clock"] = {"began_mono": began, "ready_mono": 990.0}
    raw["warmup"] = 2
    return raw


def test_the_runs_own_clock_prices_a_planned_run():
    """run_costs reads a repetition's time per engine, the restart and the start from the
    run; call_seconds adds them up for a plan, as rep_plan lays the run out."""
    # 8 engines (4 a side), a repetition 4 s: 0.5 s per engine; restarts 40, 44, 48 s
    raw = _clocked(_raw(0.001, 0.004, procs=4, reps=6), 4.0, restarts=(40.0, 48.0, 44.0),
                   first_start=90.0, loaded=40.0)
    c = aad.run_costs(raw)
    assert c["rep_engine_s"] == 0.5 and c["restart_s"] == 44.0
    assert c["start_s"] == 90.0 + 2 * 40.0          # no clock: first wave + two loaded starts
    # a run with its clock: the start is from its beginning to every engine up (before
    # the warm-ups, which call_seconds counts as repetitions)
    assert aad.run_costs(_clocked(_raw(0.001, 0.004, procs=4, reps=6), 4.0,
                                  began=850.0))["start_s"] == 140.0
    # 5 generations of 15 reps, 2 arms x 4: 170 + 4 x 44 + (2 + 15 + 4) x 0.5 x 8
    assert aad.call_seconds(c, procs=4, arms=2, reps=15, generations=5) == 170 + 176 + 84
    assert aad.run_costs({"samples": [{"rep": 0, "arm": "a", "host": [{}]}]}) is None


def test_a_design_says_whether_it_fits_one_device_call():
    raw = _clocked(_raw(0.01, 0.003, procs=4, reps=12, seed=2), 4.0,
                   restarts=(44.0,), first_start=90.0)
    (row,) = aad.design(raw, target=1.0, arms=3, max_procs=3, **FAST)
    gen = row["with_generations"]
    g = gen["generations_needed"]
    assert gen["call_s"] == aad.call_seconds(aad.run_costs(raw, "prefill_2048"), procs=2,
                                             arms=3, reps=gen["reps"], generations=g)
    assert gen["fits_call"] == (gen["call_s"] <= aad.CALL_S)
    (tight,) = aad.design(raw, target=1.0, arms=3, max_procs=3, call_s=100.0, **FAST)
    assert tight["with_generations"]["fits_call"] is False
    assert "more than one 100-s call" in aad.verdict(tight, 1.0, 100.0)
