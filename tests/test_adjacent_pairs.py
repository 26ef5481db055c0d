"""benchmarks/adjacent_pairs.py on synthetic raw files of a 2048-token-prefill A/A: where the
host's slow periods last many runs, neighbouring runs share them (lag correlation near 1)
and the ratio of time-adjacent pairs is steadier than the instrument's per-repetition one;
where every run's slowness is its own, neighbours share nothing."""
from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import adjacent_pairs  # noqa: E402


def _raw(level, reps: int = 12, runs: int = 9, seed: int = 4) -> dict:
    """Two single-process arms, their prefill runs interleaved 30 ms apart; each run's time
    is 17 ms x ``level(i, rng)`` (the host's speed at run ``i`` of the time line) x 1 % of
    noise. ``time_s`` as the instrument records it (the median run)."""
    rng = random.Random(seed)
    samples, i = [], 0
    for r in range(reps):
        per_arm: dict = {"vanilla": ([], []), "aa": ([], [])}
        for _ in range(runs):
            for arm in ("vanilla", "aa"):
                t = 0.017 * level(i, rng) * (1 + 0.01 * rng.gauss(0, 1))
                per_arm[arm][0].append([t])
                per_arm[arm][1].append({"t_mono": 0.03 * i, "probe_us": [700.0, 700.0]})
                i += 1
        for arm, (rs, host) in per_arm.items():
            samples.append({"rep": r, "scenario": "prefill_2048", "arm": arm, "replica": 1,
                            "runs": rs, "host": host,
                            "time_s": sorted(x[0] for x in rs)[len(rs) // 2]})
    return {"baseline": "vanilla", "samples": samples,
            "scenarios": [{"name": "prefill_2048", "kind": "prefill", "batch": 1,
                           "prompt_len": 2048, "output_len": 1}]}


def _long_periods():
    """The host slow (1.8x) or not in periods of ~7 runs, drawn afresh at each switch."""
    state = {"slow": False}

    def level(i, rng):
        if rng.random() < 0.15:
            state["slow"] = rng.random() < 0.5
        return 1.8 if state["slow"] else 1.0
    return level


def test_long_slow_periods_are_shared_by_neighbours_and_cancel_in_adjacent_pairs():
    (row,) = adjacent_pairs.read(_raw(_long_periods()))
    assert row["runs"] == 12 * 9 * 2 and row["reps"] == 12
    assert row["lag_corr"]["1"] > 0.7
    assert row["rep_sd_pct_adjacent"] < 0.5 * row["rep_sd_pct_instrument"], row


def test_a_runs_own_slowness_is_not_shared():
    (row,) = adjacent_pairs.read(_raw(lambda i, rng: 1.8 if rng.random() < 0.3 else 1.0))
    assert abs(row["lag_corr"]["1"]) < 0.2, row


def test_the_script_reads_a_gzipped_raw_file_and_writes_its_rows(tmp_path):
    raw = tmp_path / "e2e-raw.json.gz"
    with gzip.open(raw, "wt") as f:
        json.dump(_raw(_long_periods()), f)
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "adjacent_pairs.py"),
                        str(raw), "--json", str(out)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "prefill_2048" in r.stdout and "adjacent pairs" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["rows"][0]["arm"] == "aa" and "adjacent_pairs.py" in doc["command"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "adjacent_pairs.py"),
                        str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "adjacent_pairs.py:" in r.stderr and "Traceback" not in r.stderr
