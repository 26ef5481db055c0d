"""Cold weights at decode bands (tune/cold_weights.py): how many copies, that the timed call
really rotates the weight and only the weight, and when the race turns it on."""
import json

import torch

from fltune.cli.main import build_parser
from fltune.ops import get_op
from fltune.tune import cold_weights as cw
from fltune.tune import race, timing
from fltune.tune.bands import Band

MiB = 2**20


def test_copies_needed_spans_l2_by_the_factor():
    # Qwen3-0.6B's down projection, bf16 [1024, 3072] = 6 MiB, on a 50 MiB L2: the other
    # copies must hold 100 MiB -> 17 others, 18 in all
    assert cw.copies_needed(6 * MiB, 50 * MiB) == 18
    # the other n - 1 copies always span factor x L2
    for nbytes in (2 * MiB, 3 * MiB, 7 * MiB, 33 * MiB):   # (1 MiB would need 101: capped)
        n = cw.copies_needed(nbytes, 50 * MiB)
        assert (n - 1) * nbytes >= 2 * 50 * MiB
        assert (n - 2) * nbytes < 2 * 50 * MiB
    # a weight larger than twice L2 is cold on its own (an LM head): no copies
    assert cw.copies_needed(311 * MiB, 50 * MiB) == 1
    # a tiny weight is capped, nothing to rotate is 1
    assert cw.copies_needed(4096, 50 * MiB) == cw.MAX_COPIES
    assert cw.copies_needed(0, 50 * MiB) == 1


def _linear_args(tokens=4, n=64, k=32, bias=True):
    spec = get_op("linear")
    gen = torch.Generator().manual_seed(0)
    return spec, spec.make_inputs(tokens, {"n": n, "k": k, "bias": bias}, torch.float32,
                                  "cpu", gen)


def test_cold_bytes_counts_the_weight_and_bias_only():
    spec, args = _linear_args(bias=True)
    assert spec.step_cold_args == (1, 2)
    assert cw.cold_bytes(args, spec.step_cold_args) == (64 * 32 + 64) * 4
    spec, args = _linear_args(bias=False)
    assert cw.cold_bytes(args, spec.step_cold_args) == 64 * 32 * 4


def test_rotating_call_cycles_the_weight_and_shares_the_activation():
    spec, args = _linear_args(bias=True)
    seen = []

    def fn(x, w, b):
        seen.append((x.data_ptr(), w.data_ptr(), b.data_ptr()))
        return spec.reference(x, w, b)

    call = cw.rotating_call(fn, args, spec.step_cold_args, 3)
    outs = [call() for _ in range(7)]
    xs, ws, bs = zip(*seen)
    assert len(set(xs)) == 1 and xs[0] == args[0].data_ptr()     # one activation, hot
    assert ws[0] == args[1].data_ptr()                            # copy 0 is the call's own
    assert len(set(ws[:3])) == 3 and len(set(bs[:3])) == 3        # three distinct copies
    assert ws[3:6] == ws[:3] and ws[6] == ws[0]                   # in turn, wrapping
    want = spec.reference(*args)
    for o in outs:                                                # same values every copy
        torch.testing.assert_close(o, want)


def test_rotating_call_keeps_a_missing_bias_missing():
    spec, args = _linear_args(bias=False)
    got = []
    call = cw.rotating_call(lambda x, w, b: got.append(b), args, spec.step_cold_args, 2)
    call(); call()
    assert got == [None, None]


def test_the_race_turns_it_on_only_where_it_means_something(monkeypatch):
    spec, args = _linear_args(tokens=4, n=1024, k=3072, bias=False)   # 12 MiB in fp32
    monkeypatch.setattr(race, "_free_memory", lambda device: 80 * 2**30)
    monkeypatch.setattr(cw, "l2_bytes", lambda device: 50 * MiB)
    on = race.Settings(device="cuda", cold_weights=True)
    assert race._cold_weight_copies(spec, args, on, graph_timed=True) == \
        cw.copies_needed(12 * MiB, 50 * MiB) == 10
    # off by default, off for eager (prefill) bands, off on CPU, off for an op whose
    # arguments a step reads hot (a norm: its input was just written)
    assert race._cold_weight_copies(spec, args, race.Settings(device="cuda"), True) == 1
    assert race._cold_weight_copies(spec, args, on, graph_timed=False) == 1
    assert race._cold_weight_copies(spec, args, race.Settings(device="cpu",
                                                              cold_weights=True), True) == 1
    norm = get_op("rms_norm")
    assert norm.step_cold_args == ()
    assert race._cold_weight_copies(norm, args, on, graph_timed=True) == 1
    # copies that do not fit half of free memory, all candidates together, are cut to fit
    monkeypatch.setattr(race, "_free_memory", lambda device: 2 * 12 * MiB * 6)
    assert race._cold_weight_copies(spec, args, on, graph_timed=True) == 6
    assert race._cold_weight_copies(spec, args, on, graph_timed=True, candidates=2) == 3


def test_settings_record_it_only_when_on():
    assert "cold_weights" not in race.Settings().recorded()
    assert race.Settings(cold_weights=True).recorded()["cold_weights"] is True


def test_a_cpu_race_with_it_on_times_as_before(builtin_registry):
    # on CPU the switch changes nothing (no L2 model there): the race runs, picks a winner
    # and its timers record no copies
    impls = [i for i in builtin_registry.get_implementations("linear")
             if i.impl_id in ("reference.torch", "torch.linear")]
    assert impls
    v = race.race("linear", {"n": 64, "k": 32, "bias": False}, torch.float32, Band(1, 4),
                  impls, race.Settings(device="cpu", cold_weights=True, reps=5))
    timed = [o for o in v.outcomes if o.timing is not None]
    assert v.winner is not None and timed
    assert all("cold_weight_copies" not in o.timing.timer for o in timed)


def test_timer_extra_is_recorded():
    out = timing.time_candidates({"a": lambda: None}, "cpu", reps=5,
                                 timer_extra={"cold_weight_copies": 7})
    assert out["a"].timer["cold_weight_copies"] == 7


def test_calibrate_takes_the_switch():
    a = build_parser().parse_args(["calibrate", "--model", "Qwen3-0.6B", "--cold-weights"])
    assert a.cold_weights is True
    a = build_parser().parse_args(["calibrate", "--model", "Qwen3-0.6B"])
    assert a.cold_weights is False


def test_the_race_hands_rotating_calls_and_whole_cycles_to_the_timer(monkeypatch,
                                                                      builtin_registry):
    # CPU never turns copies on by itself (no L2 model): force 3 copies and look at what the
    # timer is handed — every candidate's call rotates 3 weight sets, the graph holds a
    # whole number of cycles (>= the asked graph_calls), the timer records copies and span
    monkeypatch.setattr(race, "_cold_weight_copies", lambda *a, **k: 3)
    seen = {}
    real = timing.time_candidates

    def spy(calls, device, **kw):
        seen.update(kw, calls=calls)
        return real(calls, device, **kw)
    monkeypatch.setattr(timing, "time_candidates", spy)
    impls = [i for i in builtin_registry.get_implementations("linear")
             if i.impl_id in ("reference.torch", "torch.linear")]
    settings = race.Settings(device="cpu", cold_weights=True, reps=5, graph_calls=20)
    v = race.race("linear", {"n": 64, "k": 32, "bias": True}, torch.float32, Band(1, 4),
                  impls, settings)
    assert seen["graph_calls"] == 21                       # 7 whole cycles of 3, >= 20
    assert all(getattr(c, "copies", None) == 3 and len(c.sets) == 3
               for c in seen["calls"].values())
    assert seen["timer_extra"]["cold_weight_copies"] == 3
    assert seen["timer_extra"]["cold_weight_l2_span"] == round(
        cw.l2_span(3, (64 * 32 + 64) * 4, cw.DEFAULT_L2_BYTES), 2)
    timed = [o for o in v.outcomes if o.timing is not None]
    assert timed and all(o.timing.timer["cold_weight_copies"] == 3 for o in timed)
    # two sets of one call hold different weights but the same activation
    c = next(iter(seen["calls"].values()))
    assert c.sets[0][0] is c.sets[1][0] and c.sets[0][1] is not c.sets[1][1]


def test_verify_re_times_a_cold_band_cold(monkeypatch):
    # a band calibrated with --cold-weights is re-timed with it (its stored timer says so);
    # one calibrated without is re-timed hot
    from fltune.dispatch.registry import OpRegistry
    from fltune.evaluate import verify
    from conftest import make_impl

    spec = get_op("linear")
    reg = OpRegistry()
    reg.register(make_impl("linear", "w.impl", "reference", fn=spec.reference))
    got = []

    class Pool:
        def race(self, op, dims, dtype, band, impls, settings):
            got.append(settings)
            return race.Verdict([], None, None, "none", 0)
    w = {"op": "linear", "signature": "bias=0,k=32,n=64", "dims": '{"n": 64, "k": 32, '
         '"bias": false}', "dtype": "bf16", "band_lo": 1, "band_hi": 4, "impl_id": "w.impl",
         "median_us": 5.0, "runner_up": None, "runner_up_us": None, "noise": 0.01}
    for copies, want in ((18, True), (None, False)):
        timer = {"timer": "cuda-graph", "calls_per_graph": 36, "cold_l2": False}
        if copies:
            timer["cold_weight_copies"] = copies
        meas = {("linear", w["signature"], "bf16", 4, "w.impl"): {"timer": json.dumps(timer)}}
        try:
            verify.verify_band(w, meas, reg, "cpu", pool=Pool(), margin=0.03,
                               noise_floor=0.1, reps=0, budget_s=0.001, graph_calls=20)
        except KeyError:
            pass        # the fake pool timed nothing: only the settings it got matter
        assert got[-1].cold_weights is want and got[-1].graph_calls == 36


def test_no_op_rotates_an_argument_it_writes():
    from fltune.ops import OPS
    for name, spec in OPS.items():
        assert not set(spec.step_cold_args) & set(spec.mutates), name


def test_a_hinted_re_calibration_keeps_the_cold_switches():
    from fltune.store.hints import calibrate_command
    run = {"model": "Qwen3-0.6B", "settings": json.dumps({"cold_l2": True,
                                                         "cold_weights": True})}
    cmd = calibrate_command("x.db", run)
    assert "--cold-l2" in cmd and "--cold-weights" in cmd
    run = {"model": "Qwen3-0.6B", "settings": json.dumps({"cold_l2": False})}
    cmd = calibrate_command("x.db", run)
    assert "--cold" not in cmd


def test_what_it_says_when_it_changed_nothing():
    # the reason named is the first that holds, in the order the race decides
    on = race.Settings(device="cuda", cold_weights=True)
    lin = [("linear", Band(1, 1)), ("linear", Band(1025, 2048))]
    assert race.cold_weights_unused(race.Settings(device="cuda"), [], [], 0) is None
    assert race.cold_weights_unused(on, lin, [], rotated=1) is None
    note = race.cold_weights_unused(race.Settings(device="cpu", cold_weights=True), lin, [], 0)
    assert note.startswith("--cold-weights changed nothing") and "(CPU device)" in note
    note = race.cold_weights_unused(on, [("rms_norm", Band(1, 1))], [], 0)
    assert "no op calibrated reads an argument cold" in note and "rms_norm" in note
    note = race.cold_weights_unused(on, [("linear", Band(1025, 2048))], [], 0)
    assert "no band of linear is timed by CUDA graph replay" in note
    # a resumed run: the decode bands were measured before, only a prefill band was raced
    note = race.cold_weights_unused(on, lin[1:], lin[:1], 0)
    assert "in the DB already, timed with the weights cold" in note and "--force" in note
    note = race.cold_weights_unused(on, lin, [], 0)
    assert "2x L2 on their own" in note
    # --cold-l2 times prefill bands eagerly: a band above 512 tokens is not graph-timed even
    # under a higher graph limit
    high = race.Settings(device="cuda", cold_weights=True, graph_limit=4096)
    assert race.graph_timed(Band(1025, 2048), high)
    assert not race.graph_timed(Band(1025, 2048), race.Settings(cold_l2=True,
                                                                graph_limit=4096))
    assert "2x L2" in race.cold_weights_unused(high, lin[1:], [], 0)


def _calibrate_silu(db, max_tokens: int, *extra):
    """``fltune calibrate`` of tiny-qwen3's silu_and_mul through the CLI, in a child process
    (the process a user runs): (the completed process, its JSON document)."""
    import subprocess
    import sys

    from conftest import child_env

    p = subprocess.run([sys.executable, "-m", "fltune", "calibrate", "--model", "tiny-qwen3",
                        "--ops", "silu_and_mul", "--max-tokens", str(max_tokens),
                        "--budget", "0.003", "--no-isolate", "--db", str(db), "--json",
                        *extra], capture_output=True, text=True, timeout=600, env=child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    return p, json.loads(p.stdout)


def test_calibrate_on_cpu_says_it_changed_nothing(tmp_path):
    # through the CLI: one line on stderr, stdout still one JSON document (which carries the
    # line too); a run without the switch says nothing about it
    def calibrate(*extra):
        return _calibrate_silu(tmp_path / "cw.db", 2, *extra)

    p, doc = calibrate("--cold-weights")
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("--cold-weights")]
    assert lines == ["--cold-weights changed nothing: no band here is timed by CUDA graph "
                     "replay (CPU device); the weights were timed as usual"], p.stderr
    assert doc["notes"] == lines and doc["measured"] == 2
    p, doc = calibrate("--force")
    assert "--cold-weights" not in p.stderr and doc["notes"] == []


def test_timing_regime_names_the_switches_that_change_a_band():
    """What a resumed run must match before it skips a band (``has_band``): on CUDA,
    --cold-weights only where it changes the timing (a graph-timed band of an op with
    step-cold arguments), --cold-l2 only above 512 tokens; on a CPU neither (its timer
    flushes nothing and replays no graph)."""
    lin, norm = get_op("linear"), get_op("rms_norm")
    on = race.Settings(device="cuda", cold_weights=True)
    assert race.timing_regime(lin, Band(9, 16), on) == {"cold_weights": True}
    assert race.timing_regime(lin, Band(9, 16), race.Settings(device="cuda")) == {
        "cold_weights": False}
    assert race.timing_regime(norm, Band(9, 16), on) == {}
    assert race.timing_regime(lin, Band(1025, 2048), on) == {"cold_l2": False}
    assert race.timing_regime(norm, Band(513, 1024), race.Settings(device="cuda",
                                                                   cold_l2=True)) == {
        "cold_l2": True}
    assert race.timing_regime(lin, Band(9, 16), race.Settings(device="cpu",
                                                             cold_weights=True)) == {}
    assert race.timing_regime(norm, Band(513, 1024), race.Settings(device="cpu",
                                                                   cold_l2=True)) == {}


def test_a_resumed_run_re_races_only_the_bands_a_timing_switch_changes(tmp_path, monkeypatch):
    """``calibrate`` asks ``has_band`` with each band's regime: bands timed without a switch
    are raced again by a run with it, only those the switch changes, and a second such run
    finds them all. Run in process on CPU, with the CUDA rule for --cold-l2 (above 512
    tokens) standing in for the device's (on a CPU no switch changes a band: the CLI run
    at the end re-races nothing)."""
    from fltune.tune import calibrate as calmod
    from fltune.tune.bands import bands

    monkeypatch.setattr(calmod, "timing_regime", lambda spec, band, settings: (
        {"cold_l2": bool(settings.cold_l2)} if band.tokens > 512 else {}))
    db = str(tmp_path / "regime.db")

    def calibrate(cold_l2):
        return calmod.calibrate("tiny-qwen3", db, ops=["silu_and_mul"], max_tokens=1024,
                                isolate=False,
                                settings=race.Settings(budget_s=0.003, cold_l2=cold_l2))

    n = len(bands(1024))
    above = len([b for b in bands(1024) if b.tokens > 512])
    assert above >= 1
    assert calibrate(False).measured == n
    cold = calibrate(True)
    assert cold.measured == above and cold.skipped == n - above
    assert calibrate(True).measured == 0
    # and back: the hot-timed rows were replaced, so a plain run re-races those bands
    assert calibrate(False).measured == above
    monkeypatch.undo()
    assert _calibrate_silu(db, 1024)[1]["measured"] == 0     # the CPU's own rule
    assert _calibrate_silu(db, 1024, "--cold-l2")[1]["measured"] == 0


def test_a_hinted_re_calibration_of_a_ray_run_runs_over_ray_again():
    """A run made with ``calibrate --ray`` (its settings name the actors) is repeated with
    ``--ray`` on the same kind of device; a hint for another machine repeats the workload
    only. A plain run gets no ``--ray``."""
    from fltune.store.hints import calibrate_command
    run = {"model": "Qwen3-0.6B", "settings": json.dumps({
        "max_tokens": 512, "ray": {"actors": [{"node": "n1", "gpu": 0}]}})}
    assert calibrate_command("x.db", run).endswith("--max-tokens 512 --ray")
    assert "--ray" not in calibrate_command("x.db", run, same_device=False)
    run = {"model": "Qwen3-0.6B", "settings": json.dumps({"max_tokens": 512})}
    assert "--ray" not in calibrate_command("x.db", run)
