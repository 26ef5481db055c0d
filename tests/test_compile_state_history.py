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
