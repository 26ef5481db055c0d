"""Where the in-context instrument runs each arm's host work (fltune/evaluate/pinning.py):
the placement rules, and moving a real process tree between core sets."""
import os
import subprocess
import sys
import time

import pytest

from fltune.evaluate import e2e
from fltune.evaluate.pinning import (Pinning, core_speeds, measure_set_size, measuring,
                                     pin_tree, plan_pinning, process_tree, threads_of)

CPUS = sorted(os.sched_getaffinity(0))


def test_shared_is_one_set_for_every_arm_without_the_first_core():
    p = plan_pinning("shared", range(16))
    assert p.mode == "shared" and p.start == frozenset(range(1, 16))
    assert plan_pinning("shared", [0, 2, 4, 6]).start == {2, 4, 6}
    assert plan_pinning("shared", range(2)) is None          # one core would be left
    assert plan_pinning("measure", range(2)) is None
    assert plan_pinning("off", range(16)) is None
    with pytest.raises(ValueError, match="shared, measure, off"):
        plan_pinning("fastest", range(16))


def test_measure_takes_the_fastest_cores_and_parks_the_rest():
    speeds = {c: 100.0 for c in range(1, 16)}
    speeds.update({7: 130.0, 3: 125.0, 12: 120.0, 9: 119.0, 0: 999.0})   # 0 is the parent's
    p = plan_pinning("measure", range(16), speeds=speeds)
    assert p.mode == "measure"
    assert p.measure == {7, 3, 12, 9} == set(list(p.measure))   # measure_set_size(15) == 4
    assert p.park == set(range(1, 16)) - {7, 3, 12, 9}
    assert p.start == p.park and 0 not in p.measure | p.park and p.parent == {0}
    assert p.describe()["core_speeds"]["7"] == 130.0
    assert plan_pinning("measure", [0, 1, 2], speeds={1: 1.0, 2: 2.0}).measure == {2}
    with pytest.raises(ValueError, match="none to park"):
        plan_pinning("measure", range(4), measure_n=3, speeds={})


def test_measure_set_size_leaves_room_to_park():
    assert [measure_set_size(n) for n in (2, 3, 5, 8, 9, 15, 127)] == [1, 1, 2, 4, 4, 4, 4]


def test_core_speeds_times_every_core_and_restores_the_affinity():
    before = os.sched_getaffinity(0)
    s = core_speeds(CPUS[:2], seconds=0.005, rounds=1)
    assert set(s) == set(CPUS[:2]) and all(v > 0 for v in s.values())
    assert os.sched_getaffinity(0) == before


CHILD = r"""
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(g.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def tree():
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    grandchild = int(p.stdout.readline())
    deadline = time.time() + 10
    while grandchild not in process_tree(p.pid) and time.time() < deadline:
        time.sleep(0.05)
    yield p, grandchild
    for pid in (grandchild, p.pid):
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    p.wait()


def _affinities(pid):
    return {tid: os.sched_getaffinity(tid) for q in process_tree(pid) for tid in threads_of(q)}


def test_pin_tree_moves_every_thread_of_every_descendant(tree):
    p, grandchild = tree
    assert grandchild in process_tree(p.pid)
    # the same tree from every process's parent (kernels without the children file)
    assert sorted(process_tree(p.pid, scan=True)) == sorted(process_tree(p.pid, scan=False))
    for cpu in CPUS[:2]:
        n = pin_tree(p.pid, {cpu})
        aff = _affinities(p.pid)
        assert n == len(aff) >= 3                  # main thread, its sleeper, the grandchild
        assert all(a == {cpu} for a in aff.values()), aff


def test_a_measured_arm_goes_to_the_measurement_set_and_back(tree):
    """What run_e2e does around each timed call (``measured_call``)."""
    p, _ = tree
    if len(CPUS) < 2:
        pytest.skip("needs two cores")
    pin = Pinning("measure", frozenset(CPUS[1:2]), frozenset(CPUS[:1]), frozenset(CPUS[1:2]))
    with measuring(pin, p.pid):
        assert set(map(frozenset, _affinities(p.pid).values())) == {frozenset(CPUS[:1])}
    assert set(map(frozenset, _affinities(p.pid).values())) == {frozenset(CPUS[1:2])}
    with pytest.raises(RuntimeError), measuring(pin, p.pid):      # a failed call parks too
        raise RuntimeError("the worker died")
    assert set(map(frozenset, _affinities(p.pid).values())) == {frozenset(CPUS[1:2])}
    for other in (Pinning("shared", frozenset(CPUS)), None):        # they never move
        with measuring(other, p.pid):
            assert set(map(frozenset, _affinities(p.pid).values())) == {frozenset(CPUS[1:2])}


def test_pin_tree_skips_a_process_that_is_gone():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert pin_tree(p.pid, {CPUS[0]}) == 0


def test_run_e2e_refuses_an_unknown_pinning_before_starting_anything(tmp_path):
    with pytest.raises(ValueError, match="pinning"):
        e2e.run_e2e("Qwen3-0.6B", [e2e.Arm("vanilla", {})], [], pinning="fastest",
                    out_dir=str(tmp_path), device_type="cpu")
    assert not os.listdir(tmp_path)


def test_cli_pinning_belongs_to_e2e():
    r = subprocess.run([sys.executable, "-m", "fltune", "bench", "--model", "Qwen3-0.6B",
                        "--pinning", "measure"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--pinning belongs to `fltune bench --e2e`" in r.stderr
