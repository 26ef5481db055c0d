"""Which vLLM configuration this process serves, and token-range arithmetic: the state the
per-range serving reads (``range_lowering``) and the layer seams branch on (``ops``).

Why a module of its own: ``ops`` (the layer seams, at the bottom of this package) needs
:func:`traced` and :func:`in_ranges` for eager per-range decisions, while ``range_lowering``
(the post-grad pass) builds on ``linear_lowering`` -> ``linear_seam`` -> ``ops``; keeping the
state here keeps the package's imports one way (``tests/test_architecture.py``). Imports
nothing of fltune.
"""
from __future__ import annotations


def in_ranges(tokens: int, ranges) -> bool:
    """Whether ``tokens`` lies in one of ``ranges`` [(min, max or None)]."""
    return any(lo <= tokens and (hi is None or tokens <= hi) for lo, hi in ranges)


def covers(start: int, end: int, ranges) -> bool:
    """Whether the compile range [start, end] lies inside one of ``ranges``."""
    return any(lo <= start and (hi is None or end <= hi) for lo, hi in ranges)


#: the vLLM config of the model this process serves, bound by the load_model hook
#: (``hooks.before_load_model``) before the model is built; None elsewhere (another engine
#: reading the same plan, e.g. SGLang, or the plan table at register): no per-range serving
_engine = None


def bind(vllm_config) -> None:
    """The vLLM config the per-range verdicts read (None: unbind)."""
    global _engine
    _engine = vllm_config


def _mode():
    cc = getattr(_engine, "compilation_config", None)
    return (cc.mode, cc.backend) if cc is not None else (None, None)


def traced() -> bool:
    """Whether the vLLM being configured traces the model (any compilation mode but NONE;
    True when no vLLM model is being served here: nothing may branch per call then)."""
    if _engine is None:
        return True
    from vllm.config import CompilationMode

    mode, _ = _mode()
    return mode != CompilationMode.NONE


def has_pass_manager() -> bool:
    """Whether vLLM compiles per compile range with its post-grad pass manager."""
    from vllm.config import CompilationMode

    mode, backend = _mode()
    return mode == CompilationMode.VLLM_COMPILE and backend == "inductor"


def engine():
    """The bound vLLM config (None: no vLLM model served in this process)."""
    return _engine
