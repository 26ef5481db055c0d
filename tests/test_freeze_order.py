"""`fltune freeze --order fl`: the baseline manifest the end-to-end A/B serves.

Checked against the report's own FL pick on the shipped H200 DB (real measurements), so
the two code paths that decide "what FL would run" cannot drift apart."""
import json
import os
import subprocess
import sys

import pytest

from fltune.cli.render import render_report
from fltune.evaluate import report
from fltune.freeze import build_manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_DB = os.path.join(ROOT, "db", "NVIDIA-H200_driver-580.159.04.db")


def _band_picks(manifest):
    """(op, dtype, signature) -> [(lo, hi, impl_id)] (adjacent equal bands are merged)."""
    return {(op, t["dtype"], t["signature"]): [(b["lo"], b["hi"], b["impl_id"])
                                               for b in t["bands"]]
            for op, e in manifest["ops"].items() for t in e["tables"]}


def _pick_at(picks, op, dtype, sig, tokens):
    return next(i for lo, hi, i in picks[(op, dtype, sig)] if lo <= tokens <= hi)


def test_fl_order_manifest_picks_what_the_report_says_fl_runs():
    fl, _ = build_manifest(H200_DB, device="NVIDIA", check_stack=False, order="fl")
    measured, _ = build_manifest(H200_DB, device="NVIDIA", check_stack=False)
    assert fl["order"] == "fl" and measured["order"] == "measured"
    assert fl["fingerprint"] != measured["fingerprint"]
    rep = report.build(H200_DB, device="NVIDIA")
    picks = _band_picks(fl)
    checked = 0
    shadowed = {(op, s["dtype"], s["signature"]) for op, e in fl["ops"].items()
                for s in e["shadowed"]}
    for r in rep["rows"]:
        if (r["op"], r["dtype"], r["signature"]) in shadowed:
            continue
        want = r["fl_pick"] if r["fl_outcome"] == "timed" else r["winner"]
        assert _pick_at(picks, r["op"], r["dtype"], r["signature"], r["band_hi"]) == want, r
        checked += 1
    assert checked > 50
    # and the two manifests really differ somewhere (the DB has bands where FL loses)
    assert _band_picks(fl) != _band_picks(measured)


def test_unknown_order_is_refused_by_the_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fltune", "freeze", "--db", H200_DB,
                        "--device", "NVIDIA", "--out", str(tmp_path / "m.json"),
                        "--order", "fastest"], capture_output=True, text=True)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    assert not (tmp_path / "m.json").exists()


def test_cli_writes_the_fl_manifest(tmp_path):
    out = tmp_path / "fl.json"
    r = subprocess.run([sys.executable, "-m", "fltune", "freeze", "--db", H200_DB,
                        "--device", "NVIDIA", "--out", str(out), "--order", "fl", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["order"] == "fl"
    assert json.loads(r.stdout.strip().splitlines()[-1])["fingerprint"] == m["fingerprint"]


def test_report_names_every_model_the_db_holds():
    """The shipped DB holds two models; the header used to name only the newest run's."""
    import io

    from rich.console import Console

    rep = report.build(H200_DB, device="NVIDIA")
    assert {m["model"] for m in rep["models"]} == {"Qwen3.5-0.8B", "Qwen3-0.6B"}
    buf = io.StringIO()
    render_report(rep, Console(file=buf, width=200))
    header = buf.getvalue().splitlines()[:3]
    assert any("Qwen3.5-0.8B" in ln and "Qwen3-0.6B" in ln for ln in header), header
