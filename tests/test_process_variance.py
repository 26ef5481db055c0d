"""benchmarks/process_variance.py: the process component of an A/A run's spread (two-way
analysis of variance, process x repetition) read back from synthetic raw samples whose
process offsets are known, and its F tail probability against tabulated values."""
from __future__ import annotations

import importlib.util
import json
import math
import random
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "process_variance.py"
spec = importlib.util.spec_from_file_location("process_variance", SCRIPT)
pv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pv)


def _samples(offsets: list, reps: int, noise: float, seed: int = 3) -> list:
    """One scenario; process i of arm vanilla/aa sits at exp(offsets[i]) of the base time,
    every repetition shares a drift, every sample has its own lognormal noise."""
    rng = random.Random(seed)
    out = []
    for r in range(reps):
        drift = rng.gauss(0, 0.01)
        for i, off in enumerate(offsets):
            arm, rep_ = ("vanilla", i // 2 + 1) if i % 2 == 0 else ("aa", i // 2 + 1)
            out.append({"scenario": "decode_b1", "arm": arm, "replica": rep_, "rep": r,
                        "time_s": 0.002 * math.exp(off + drift + rng.gauss(0, noise))})
    return out


def test_f_tail_matches_tables():
    assert abs(pv.f_sf(4.10, 2, 10) - 0.05) < 0.002       # F(2, 10) 95th percentile
    assert abs(pv.f_sf(2.25, 6, 60) - 0.05) < 0.003       # F(6, 60) 95th percentile
    assert abs(pv.f_sf(1.0, 5, 5) - 0.5) < 1e-6            # symmetric case


def test_offsets_are_found_and_noise_alone_is_not_an_offset():
    offs = [0.02, -0.02, 0.01, -0.01, 0.0, 0.015, -0.015, 0.005]
    c = pv.components(_samples(offs, reps=30, noise=0.005))["decode_b1"]
    true_sd = 100 * (sum((o - sum(offs) / 8) ** 2 for o in offs) / 7) ** 0.5
    assert c["processes"] == 8 and c["reps"] == 30
    assert abs(c["sigma_p_pct"] - true_sd) < 0.35 and c["p_value"] < 1e-6
    flat = pv.components(_samples([0.0] * 8, reps=30, noise=0.005, seed=5))["decode_b1"]
    assert flat["sigma_p_pct"] < 0.3 and flat["p_value"] > 0.001
    # the shared drift of a repetition is not a process offset
    assert flat["rep_effect_sd_pct"] > 0.5


def test_cli_prints_and_writes(tmp_path):
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps({"samples": _samples([0.01, -0.01, 0.0, 0.0], 10, 0.004)}))
    out = tmp_path / "pv.json"
    p = subprocess.run([sys.executable, str(SCRIPT), str(raw), "--json", str(out)],
                       capture_output=True, text=True, check=True)
    assert "decode_b1" in p.stdout and "sigma_p" in p.stdout
    assert json.loads(out.read_text())["scenarios"]["decode_b1"]["processes"] == 4


def _placed(offset_of: str, reps: int = 15, seed: int = 4) -> list:
    """Six processes that move between eight vCPUs from repetition to repetition; the
    offset (1 % steps) belongs to the process or to the vCPU, as ``offset_of`` says."""
    rng = random.Random(seed)
    proc_off = [0.01 * (i - 2.5) for i in range(6)]
    cpu_off = [0.01 * (c - 3.5) for c in range(8)]
    out = []
    for r in range(reps):
        drift = rng.gauss(0, 0.01)
        for i in range(6):
            cpu = rng.randrange(8)
            off = proc_off[i] if offset_of == "process" else cpu_off[cpu]
            arm, rep_ = ("vanilla", i // 2 + 1) if i % 2 == 0 else ("aa", i // 2 + 1)
            out.append({"scenario": "prefill_2048", "arm": arm, "replica": rep_, "rep": r,
                        "host": [{"cpu": cpu}, {"cpu": cpu}],
                        "time_s": 0.02 * math.exp(off + drift + rng.gauss(0, 0.003))})
    return out


def test_the_offset_is_told_apart_as_the_processs_or_the_vcpus():
    """process_or_cpu: an offset that travels with the process reads as the process's (the
    vCPU adds nothing beside it), one that stays with the vCPU as the vCPU's; what pinning
    can fix and what it cannot."""
    (c,) = pv.process_or_cpu(_placed("process")).values()
    assert c["processes"] == 6 and c["cpus"] == 8
    assert c["p_process_given_cpu"] < 0.001 and c["p_cpu_given_process"] > 0.05
    assert c["r2_process"] > 0.8
    (c,) = pv.process_or_cpu(_placed("cpu")).values()
    assert c["p_cpu_given_process"] < 0.001 and c["p_process_given_cpu"] > 0.05
    assert c["r2_cpu"] > 0.8
    # samples without a host record say nothing about vCPUs
    bare = [{k: v for k, v in s.items() if k != "host"} for s in _placed("process")]
    assert pv.process_or_cpu(bare) == {}


def test_a_run_with_generations_is_read_block_by_block():
    """--generations: replica 2 of each block is a new process with a new offset. Read
    block by block and pooled, sigma_p comes back near the one drawn; read as if the
    replicas were the same processes throughout (the generation dropped), the offsets of
    different blocks would cancel into a much smaller one."""
    rng = random.Random(7)
    offs = {(g, arm, j): rng.gauss(0, 0.01) for g in range(6) for arm in ("vanilla", "aa")
            for j in (1, 2, 3)}
    samples = []
    for r in range(24):
        g, drift = r // 4, rng.gauss(0, 0.01)
        for arm in ("vanilla", "aa"):
            for j in (1, 2, 3):
                off = offs[(g, arm, j)]
                samples.append({"scenario": "prefill_2048", "arm": arm, "replica": j,
                                "rep": r, "generation": g,
                                "time_s": 0.02 * math.exp(off + drift + rng.gauss(0, 0.002))})
    (c,) = pv.components(samples).values()
    assert c["generations"] == 6 and c["processes"] == 36 and c["reps"] == 24
    assert 0.6 < c["sigma_p_pct"] < 1.5 and c["p_value"] < 1e-6
    assert "vanilla.p2@g3" in c["offsets_pct"]
    (flat,) = pv.components([{k: v for k, v in s.items() if k != "generation"}
                             for s in samples]).values()
    assert "generations" not in flat and flat["sigma_p_pct"] < 0.7 * c["sigma_p_pct"]
