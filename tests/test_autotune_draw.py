"""``benchmarks/autotune_draw.py``'s summary of draws (the GPU part cannot run here): draws
are grouped by the launch each drew at the smallest size, with the median µs per size."""
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
