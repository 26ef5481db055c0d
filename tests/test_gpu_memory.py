"""The instrument's memory preflight (``fltune.evaluate.gpu_memory``): how many engines of a
later start wave fit the card, from what the first wave's engines measured. The card's
reading (``nvidia-smi``) cannot run on the CPU machine: ``read_card`` is driven here by a
stand-in for ``subprocess.run`` (named as such); the planning and its wiring into the
start order are the real code."""
import subprocess
from dataclasses import dataclass

from fltune.evaluate import e2e
from fltune.evaluate.gpu_memory import plan_wave, read_card

GIB = 1024


@dataclass
class A:
    name: str


def names(xs):
    return [a.name for a in xs]


def replicas(arms, procs):
    """{worker name: (arm, replica)} in the instrument's start order."""
    return {e2e.replica_name(a, j): (a, j) for a, j in e2e.replica_index(arms, procs)}


def test_all_fit_when_the_card_has_room():
    wave = [A("aa"), A("vanilla.p2")]
    plan = plan_wave(wave, engines_up=2, used_before_mib=1 * GIB, used_now_mib=20 * GIB,
                     free_now_mib=60 * GIB, replica_of={"aa": ("aa", 1),
                                                        "vanilla.p2": ("vanilla", 2)})
    assert names(plan.start) == ["aa", "vanilla.p2"] and not plan.left_out
    assert plan.per_engine_mib == 9.5 * GIB and plan.message == ""


def test_whole_replica_levels_are_left_out_from_the_top():
    # four arms x four processes at ~9.4 GiB on an 80 GiB card: the first wave (four
    # engines) is up; twelve more would need ~113 GiB of the ~42 GiB free
    arms = ["vanilla", "cal", "fl", "aa"]
    rep = replicas(arms, 4)
    wave = [A(n) for n in rep if n not in ("vanilla", "cal", "fl")]   # aa shares vanilla's
    plan = plan_wave(wave, engines_up=3, used_before_mib=0, used_now_mib=round(3 * 9.4 * GIB),
                     free_now_mib=round(80 * GIB - 3 * 9.4 * GIB), replica_of=rep)
    # room (51.8 - 2) GiB / 9.4 = 5 engines: aa (level 1) and level 2 (four), not level 3
    assert names(plan.start) == ["aa", "vanilla.p2", "cal.p2", "fl.p2", "aa.p2"]
    assert {rep[n][1] for n in names(plan.left_out)} == {3, 4}
    counts = {}
    for n in ["vanilla", "cal", "fl"] + names(plan.start):
        counts[rep[n][0]] = counts.get(rep[n][0], 0) + 1
    assert set(counts.values()) == {2}                  # every arm two processes
    assert "not started" in plan.message and "--procs" in plan.message
    assert "aa.p4" in plan.message and "9.4 GiB each" in plan.message
    assert "5 started" in plan.message and plan.levels_left_out == [3, 4]


def test_a_level_that_does_not_fit_whole_is_left_out_whole_and_said():
    # room for three: aa, then level 2 (vanilla.p2, cal.p2, fl.p2, aa.p2) is five more,
    # so it goes, the count said is what started (one), and a fresh-cache arm's p2 that
    # started in the first wave is to be stopped too (levels_left_out)
    arms = ["vanilla", "cal", "fl", "aa"]
    rep = replicas(arms, 2)
    wave = [A(n) for n in ["aa", "vanilla.p2", "fl.p2", "aa.p2"]]   # cal.p2: first wave
    plan = plan_wave(wave, engines_up=4, used_before_mib=0, used_now_mib=40 * GIB,
                     free_now_mib=35 * GIB, replica_of=rep)
    assert names(plan.start) == ["aa"] and plan.levels_left_out == [2]
    assert "1 started" in plan.message


def test_first_processes_go_one_by_one_where_the_card_is_nearly_full():
    rep = {"aa": ("aa", 1), "caa2": ("caa2", 1), "caa3": ("caa3", 1)}
    plan = plan_wave([A("aa"), A("caa2"), A("caa3")], engines_up=2, used_before_mib=0,
                     used_now_mib=20 * GIB, free_now_mib=24 * GIB, replica_of=rep)
    assert names(plan.start) == ["aa", "caa2"] and names(plan.left_out) == ["caa3"]


def test_no_footprint_measured_plans_nothing():
    # the card read the same before and after (another process freed memory meanwhile):
    # no basis to leave anything out
    wave = [A("aa")]
    plan = plan_wave(wave, engines_up=1, used_before_mib=30 * GIB, used_now_mib=29 * GIB,
                     free_now_mib=1 * GIB, replica_of={})
    assert names(plan.start) == ["aa"] and not plan.left_out


def test_read_card_parses_nvidia_smi_and_says_none_when_it_cannot():
    def smi(out, rc=0):             # stand-in for subprocess.run (no nvidia-smi here)
        def run(cmd, **kw):
            assert cmd[0] == "nvidia-smi" and "--query-gpu=memory.used,memory.free" in cmd
            return subprocess.CompletedProcess(cmd, rc, stdout=out, stderr="")
        return run
    assert read_card("0", run=smi("12345, 67890\n")) == (12345, 67890)
    assert read_card("0", run=smi("[N/A], [N/A]\n")) is None
    assert read_card("0", run=smi("", rc=9)) is None

    def missing(cmd, **kw):
        raise FileNotFoundError(cmd[0])
    assert read_card("0", run=missing) is None


def test_start_order_starts_only_what_fit_allows_and_restarts_only_those():
    calls = []
    e2e.start_in_order([["vanilla", "cal"], ["aa", "vanilla.p2", "cal.p2"]],
                       lambda wave: calls.append(("start", list(wave))),
                       lambda arms, final: calls.append(("restart", list(arms), final)),
                       lambda wave: wave[:1])
    assert calls == [("start", ["vanilla", "cal"]),
                     ("restart", ["vanilla", "cal"], False),
                     ("start", ["aa"]),
                     ("restart", ["vanilla", "cal", "aa"], True)]
