"""``benchmarks/relabel_manifest.py``: the shipped H200 DB's picks re-labelled for another
card (a diagnostic for a session lent an H100). The plugin's device check must accept the
result on that card, refuse the original there, and the result must say where it came from."""
from __future__ import annotations

import os
import sys

import pytest

from fltune.dispatch.manifest import device_mismatch, verify_manifest
from fltune.freeze import build_manifest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import relabel_manifest as rl  # noqa: E402

H100 = {"device_type": "cuda", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
        "sms": 132, "memory_bytes": 85_000_000_000, "driver": "580.159.04",
        "device_key": "fcd59d3082ef0033", "label": "NVIDIA H100 80GB HBM3"}


def test_a_relabelled_manifest_passes_the_device_check_and_names_its_source():
    src, _ = build_manifest(os.path.join(ROOT, "db", "NVIDIA-H200_driver-580.159.04.db"),
                            device="H200", check_stack=False)
    assert "H200" in device_mismatch(src, H100, True)        # refused as it is
    out = rl.relabel(src, H100)
    verify_manifest(out)                                      # a fingerprint of its own
    assert out["fingerprint"] != src["fingerprint"]
    assert device_mismatch(out, H100, True) is None
    assert out["ops"] == src["ops"]                           # the same picks
    assert out["relabelled_from"]["device"]["name"] == "NVIDIA H200"
    assert out["relabelled_from"]["fingerprint"] == src["fingerprint"]
    # the source manifest is not changed in place
    assert src["device"]["name"] == "NVIDIA H200"


def test_the_relabel_script_refuses_a_wrong_command_line(capsys):
    assert rl.main([]) == 2
    assert "relabel_manifest.py IN.json OUT.json" in capsys.readouterr().err
