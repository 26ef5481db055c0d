"""``inductor``: ``torch.compile`` of the op's reference, the way vLLM runs its native path.

Kind REFERENCE with priority 40 (PyTorch code; ranked below FL's reference so the fixed
FL order is unchanged — see ``dispatch/types.py``).

Compiled once per op with a **dynamic token dimension** (``dynamic=True``), because that is
the form vLLM runs it in: one graph for a whole token range. The H200 probe showed the
static form is up to 2.4x faster on large inputs, so timing the static form would promise
a speed the server never gets. The first call of each (op, dtype) pays the compile; the
calibrator warms up before timing, so that cost is never measured as kernel time.
"""
from __future__ import annotations

import shutil
import threading

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ..ops import OPS
from ._util import dtype_reason, import_reason

PRIORITY = 40
_compiled: dict = {}
_lock = threading.Lock()


def compiled(op_name: str):
    """The compiled form of ``op_name`` (built on first use, shared by all callers):
    the functional form for in-place ops that have one, else the reference."""
    fn = _compiled.get(op_name)
    if fn is None:
        with _lock:
            fn = _compiled.get(op_name)
            if fn is None:
                # one compiled function serves every dtype and several model shapes;
                # the default limit (8) is too low for a calibration sweep
                torch._dynamo.config.recompile_limit = max(
                    64, getattr(torch._dynamo.config, "recompile_limit", 8))
                spec = OPS[op_name]
                fn = torch.compile(spec.functional or spec.reference, dynamic=True,
                                   fullgraph=True)
                _compiled[op_name] = fn
    return fn


def _make_fn(op_name):
    spec = OPS[op_name]
    if spec.functional is not None:
        def fn(*args):
            results = compiled(op_name)(*args)
            for i, r in zip(spec.mutates, results):
                args[i].copy_(r)
            return tuple(args[i] for i in spec.mutates)
    else:
        def fn(*args):
            return compiled(op_name)(*args)
    fn.__qualname__ = f"inductor_{op_name}"
    return fn


def _qualify(ctx):
    if ctx.device_type == "cpu":
        if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
            return "Inductor on CPU needs a C++ compiler (install g++)"
    elif ctx.device_type == "cuda":
        r = import_reason("triton")
        if r:
            return f"Inductor on CUDA needs triton: {r}"
    else:
        return f"Inductor backend not set up for device {ctx.device_type}"
    return dtype_reason(ctx)


def implementations():
    return [OpImpl(op_name=name, impl_id="reference.inductor", kind=BackendImplKind.REFERENCE,
                   fn=_make_fn(name), priority=PRIORITY, backend="inductor",
                   qualify=_qualify, precision_rank=1)
            for name in OPS]
