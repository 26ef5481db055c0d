"""benchmarks/interleave_check.py on a synthetic raw file of a run with two processes per arm
(``fltune bench --e2e --procs 2``): each process is read as an arm of its own against the
baseline's first process, the spread between the baseline engine's processes is printed, and
the instrument's own points (CI over processes and repetitions) come out beside them."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "interleave_check.py"


def _raw(offsets: dict, reps: int = 6) -> dict:
    """Decode at batch 1, three interleaved runs per process and repetition; each process
    sits at its own level (``offsets``), the host adds a shared drift per repetition."""
    rng = random.Random(7)
    samples, t = [], 0.0
    for r in range(reps):
        drift = 1.0 + 0.1 * rng.random()
        for arm, offs in offsets.items():
            for j, off in enumerate(offs, start=1):
                runs, host = [], []
                for _ in range(3):
                    step = 1e-3 * drift * off
                    runs.append([step * (1 + 0.001 * rng.gauss(0, 1)) for _ in range(20)])
                    host.append({"t_mono": t})
                    t += 0.05
                samples.append({"rep": r, "scenario": "decode_b1", "arm": arm, "replica": j,
                                "position": 0, "runs": runs, "host": host})
    arms = {("vanilla" if j == 1 else f"vanilla.p{j}") if a == "vanilla" else
            (a if j == 1 else f"{a}.p{j}"): {"env": {}} for a, offs in offsets.items()
            for j in range(1, len(offs) + 1)}
    return {"baseline": "vanilla", "procs": 2, "arms": arms, "samples": samples,
            "scenarios": [{"name": "decode_b1", "kind": "decode", "batch": 1,
                           "prompt_len": 16, "output_len": 21}]}


def test_every_process_is_read_and_the_points_resample_processes(tmp_path):
    raw = tmp_path / "e2e-raw.json"
    raw.write_text(json.dumps(_raw({"vanilla": [1.0, 1.02], "aa": [0.99, 1.01]})))
    out = tmp_path / "check.json"
    r = subprocess.run([sys.executable, str(SCRIPT), str(raw), "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    rows = {(p["scenario"], p["arm"]): p for p in doc["points"]}
    assert set(rows) == {("decode_b1", a) for a in ("vanilla.p2", "aa", "aa.p2")}
    # vanilla's second process is 2 % slower than its first in every repetition
    assert abs(rows[("decode_b1", "vanilla.p2")]["fast_level"]["median"] - 1 / 1.02) < 0.003
    [sp] = doc["process_spread"]
    assert set(sp["replicas"]) == {"vanilla.p2", "aa", "aa.p2"} and sp["range_pct"] > 2.5
    [p] = doc["arm_points"]
    assert (p["arm"], p["procs_arm"], p["procs_vanilla"]) == ("aa", 2, 2)
    assert p["fast_ci_low"] < 1.0 < p["fast_ci_high"]
    assert "2 processes a side" in r.stdout


def test_the_hierarchical_ci_holds_1_where_a_process_offset_fools_the_repetitions():
    """benchmarks/procs_coverage.py's simulated A/A at the offset session 34 bounded
    (σ_p 0.68 %, fixed seeds): the CI that resamples processes holds the true ratio about
    as often as a 95 % CI should; the repetitions' bootstrap, one process or several
    averaged, holds it far less often: its width says nothing about the process offset."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import procs_coverage
    finally:
        sys.path.remove(str(SCRIPT.parent))
    res = procs_coverage.run(k=3, reps=12, sigma_p=0.0068, sigma_e=0.01, sims=60,
                             resamples=300)
    assert res["K processes, hierarchical"]["coverage"] >= 0.85
    assert res["K processes, reps bootstrap"]["coverage"] <= 0.8
    assert res["one process, reps bootstrap"]["coverage"] <= 0.8
    # no offset at all: every design holds 1 most of the time
    flat = procs_coverage.run(k=3, reps=12, sigma_p=0.0, sigma_e=0.01, sims=60,
                              resamples=300)
    assert all(v["coverage"] >= 0.85 for v in flat.values())


def test_a_later_generations_processes_are_read_against_their_own_generations_baseline(
        tmp_path):
    """``--generations 2``: the second half of the repetitions ran in new processes, named
    ``ARM.pN@g1`` by ``samples_by_process``; each is read against ``vanilla@g1``, the
    baseline process beside it (until session 44 against the first generation's
    ``vanilla``, with which it shared no repetition: every figure came out empty)."""
    levels = {0: {"vanilla": [1.0, 1.02], "aa": [0.99, 1.01]},
              1: {"vanilla": [1.05, 1.0], "aa": [1.05, 0.97]}}
    doc0 = _raw(levels[0], reps=6)
    doc1 = _raw(levels[1], reps=6)
    for s in doc0["samples"]:
        s["generation"] = 0
    for s in doc1["samples"]:       # repetitions 6-11, later on the clock
        s.update(generation=1, rep=s["rep"] + 6)
        for h in s["host"]:
            h["t_mono"] += 100.0
    raw = {**doc0, "samples": doc0["samples"] + doc1["samples"]}
    path, out = tmp_path / "e2e-raw.json", tmp_path / "check.json"
    path.write_text(json.dumps(raw))
    r = subprocess.run([sys.executable, str(SCRIPT), str(path), "--json", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    rows = {p["arm"]: p for p in doc["points"]}
    assert set(rows) == {"vanilla.p2", "aa", "aa.p2", "vanilla.p2@g1", "aa@g1", "aa.p2@g1"}
    assert rows["aa@g1"]["baseline"] == "vanilla@g1" and rows["aa"]["baseline"] == "vanilla"
    # aa's first process of generation 1 sits at vanilla@g1's level: 1.00, not 1.05 / 1.0
    assert abs(rows["aa@g1"]["fast_level"]["median"] - 1.0) < 0.003
    assert abs(rows["aa.p2@g1"]["fast_level"]["median"] - 1.05 / 0.97) < 0.005
    assert all(rows[a]["fast_level"] for a in rows)
    [sp] = doc["process_spread"]
    assert {"aa@g1", "vanilla.p2@g1", "aa.p2@g1"} <= set(sp["replicas"])
