"""``benchmarks/autotune_draw.py``'s summary of draws (the GPU part cannot run here): draws
are grouped by the launch each drew at the first size given, with the median µs per size;
a draw that outlasts its limit is an error draw, and the file is written after each draw."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import autotune_draw as ad  # noqa: E402


def _draw(grid_at_1, us_at_1, us_at_16):
    k = "triton_per_fused_0"
    return {"sizes": {
        "1": {"launches": {f"{k} grid=[{grid_at_1}, 1, 1] block=[64, 1, 1]": [1.0, us_at_1]},
              "kernels": {k: [1.0, us_at_1]}},
        "16": {"launches": {}, "kernels": {k: [1.0, us_at_16]}}}}


def test_draws_are_grouped_by_the_launch_they_drew_most_drawn_first():
    draws = [_draw(2, 1.6, 1.7), _draw(1, 4.6, 4.7), _draw(2, 1.4, 1.9), _draw(2, 1.5, 1.8),
             {"error": "rc=1: a draw that failed"}]
    fast, slow = ad.summarise(draws, [1, 16])
    assert fast == {"launch_at_smallest": "grid=[2, 1, 1] block=[64, 1, 1]", "draws": 3,
                    "us_per_call": {"1": 1.5, "16": 1.8}}
    assert slow["draws"] == 1 and slow["us_per_call"] == {"1": 4.6, "16": 4.7}


def test_a_draw_of_two_kernels_is_named_by_both_launches():
    launches = {"a grid=[2, 1, 1] block=[64, 1, 1]": [1.0, 1.0],
                "b grid=[8, 1, 1] block=[128, 1, 1]": [1.0, 2.0]}
    assert ad.config_of(launches) == ("grid=[2, 1, 1] block=[64, 1, 1] + "
                                      "grid=[8, 1, 1] block=[128, 1, 1]")


def test_a_draw_past_its_limit_is_an_error_and_the_file_holds_every_draw_made(
        tmp_path, monkeypatch):
    import json
    import subprocess
    import types

    written = []
    calls = {"n": 0}

    def fake_run(cmd, **kw):
        calls["n"] += 1
        path = tmp_path / "autotune-draw-P-op.json"
        written.append(json.loads(path.read_text())["draws"] if path.exists() else None)
        if calls["n"] == 1:
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        return types.SimpleNamespace(returncode=0, stderr="",
                                     stdout="noise\nDRAW " + json.dumps(_draw(2, 1.6, 1.7)))

    monkeypatch.setattr(ad.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["autotune_draw.py", "--profile", "P", "--op", "op",
                                      "--draws", "2", "--sizes", "1,16", "--timeout", "5",
                                      "--out", str(tmp_path)])
    ad.main()
    doc = json.loads((tmp_path / "autotune-draw-P-op.json").read_text())
    assert doc["draws"][0] == {"error": "no result within 5 s"}
    assert "sizes" in doc["draws"][1]
    assert doc["summary"][0]["draws"] == 1
    # before the second draw ran, the first (the timed-out one) was already on disk
    assert written[1] == [{"error": "no result within 5 s"}]

