"""``benchmarks/compile_state_history.py``: a worker's log says whether its engine compiled the
model or loaded it from vLLM's compile cache (the GPU runs themselves cannot run here)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import compile_state_history as h  # noqa: E402


def test_the_compile_state_history_reads_a_workers_log_for_its_state():
    assert h.log_state(None) == "?"
    assert h.log_state("INFO Directly load AOT compilation from path /x") == "loaded"
    assert h.log_state("INFO saved AOT compiled function to /x") == "compiled"
    assert h.log_state("Compiling a graph ...\\nDirectly load ...") == "both"
    assert h.log_state("nothing said") == "?"


def test_every_generation_of_a_run_is_read(tmp_path):
    """A run with ``--generations 2``: the second generation's repetitions pair its own
    processes (named ``aa@g1``, ``vanilla@g1`` by samples_by_process) and count too."""
    import json
    samples = [{"scenario": "prefill_2048", "arm": arm, "replica": 1, "rep": r,
                "generation": r // 3, "time_s": 0.02 if arm == "vanilla" else 0.01}
               for r in range(6) for arm in ("vanilla", "aa")]
    counters = {"num_backend_compilations": 0}
    raw = {"baseline": "vanilla", "model": "m", "samples": samples, "scenarios": [],
           "arms": {a: {"env": {}, "start_s": 30.0, "compile": {"counters": counters}}
                    for a in ("vanilla", "aa")}}
    (tmp_path / "e2e-raw.json").write_text(json.dumps(raw))
    (row,) = list(h.rows(str(tmp_path)))
    assert row["arm"] == "aa" and row["median_ratio"]["prefill_2048"] == (2.0, 6)
