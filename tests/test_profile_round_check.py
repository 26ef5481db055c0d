"""benchmarks/profile_round_check.py: does the kernel profile's first round (since session
40 taken during the warm-up) read like the later ones? Synthetic rounds for the cases the
verdict must tell apart, and session 38's recorded H100 rounds (all taken alike, after the
timed runs) as the real yardstick that must read 'ok'."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prc():
    spec = importlib.util.spec_from_file_location(
        "profile_round_check", ROOT / "benchmarks" / "profile_round_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _raw(round0: dict, *, cost=None, arms=("vanilla", "calibrated", "aa")):
    """Kernel rounds for 4 scenarios x ``arms``: later rounds within ±0.1 % of 1000 µs,
    round 0 at ``round0[arm]`` times that (default 1: taken alike)."""
    jitter = [1.0, 1.001, 0.999, 1.0005]
    kernels = {}
    for i, sc in enumerate(("decode_b1", "decode_b16", "prefill_2048", "prefill_8192")):
        kernels[sc] = {}
        for j, arm in enumerate(arms):
            base = 1000.0 * (1 + i) * (1 + 0.01 * j)
            later = [base * jitter[(i + j + k) % 4] for k in range(2)]
            kernels[sc][arm] = {"rounds_us": [base * round0.get(arm, 1.0)] + later}
    host = {"profile_cost": cost} if cost else {}
    return {"baseline": "vanilla", "kernels": kernels, "host": host}


def test_rounds_taken_alike_read_ok(prc):
    v = prc.verdict(prc.round_offsets(_raw({})))
    assert v["points"] == 12 and v["off"] is False


def test_an_offset_all_arms_share_is_off_in_kernel_time_but_cancels_in_the_ratio(prc):
    raw = _raw({"vanilla": 1.03, "calibrated": 1.03, "aa": 1.03})
    v = prc.verdict(prc.round_offsets(raw))
    assert v["kernel_time"]["off"] is True and v["ratio"]["off"] is False
    assert v["off"] is True


def test_an_offset_of_one_arm_moves_its_ratio(prc):
    rows = prc.round_offsets(_raw({"calibrated": 0.97}))
    cal = [r for r in rows if r["arm"] == "calibrated"]
    assert all(r["ratio_shift_pct"] > 2.5 for r in cal)
    assert not any("ratio_shift_pct" in r for r in rows if r["arm"] == "vanilla")
    v = prc.verdict(rows)
    assert v["ratio"]["off"] is True
    assert v["ratio"]["arms"]["calibrated"]["off"] is True
    assert v["ratio"]["arms"]["aa"]["off"] is False


def test_the_cli_prints_the_cost_and_writes_its_json(prc, tmp_path, capsys):
    cost = {"first_round_s": 4.0, "reserved_s": 8.0, "spent_s": 11.0,
            "round_s": {"decode_b1": [1.0, 1.5, 1.5], "prefill_2048": [3.0, 2.0, 2.5]}}
    p = tmp_path / "e2e-raw.json"
    p.write_text(json.dumps(_raw({"vanilla": 1.03, "calibrated": 1.03, "aa": 1.03},
                                 cost=cost)))
    out = tmp_path / "rounds.json"
    assert prc.main([str(p), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SYSTEMATICALLY OFF" in text and "first_round_s=4.0" in text
    got = json.loads(out.read_text())
    # (1.5 + 1.5 + 2.0 + 2.5) over the two later rounds: 3.75 s a round, vs 4.0 reserved each
    assert got["profile_cost"]["later_round_s"] == pytest.approx(3.75)
    assert got["verdict"]["off"] is True and len(got["rows"]) == 12


def test_session_38s_recorded_h100_rounds_read_ok(prc):
    """Rounds all taken after the timed runs (before session 40): no lean in round 0."""
    raw = prc.read_json(str(ROOT / "benchmarks/results/h100-2026-12-06-s38/q35draws-e2e-raw.json.gz"))
    v = prc.verdict(prc.round_offsets(raw))
    assert v["points"] == 16 and v["off"] is False
    assert prc.profile_cost(raw) == {}


def test_a_missing_or_corrupt_file_is_named_with_the_way_out(prc, tmp_path, capsys):
    assert prc.main([str(tmp_path / "gone.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "e2e-raw.json"
    bad.write_text("{not json")
    assert prc.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not JSON" in err and "--out DIR" in err
