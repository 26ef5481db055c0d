"""``inductor.standalone``: the op's reference compiled alone, every dimension dynamic.

Not what vLLM runs; kept as a comparison. vLLM's native path is ``native.vllm``
(``native_vllm.py``): vLLM's own ``forward_native`` compiled as vLLM compiles a model
(static hidden sizes, only the token dimension dynamic, vLLM's Inductor options, guards
skipped). This candidate compiles fltune's reference with ``dynamic=True``, so every
size is symbolic; the H200 measured it several times slower than the code vLLM runs
in-model for ``silu_and_mul`` at 2k-8k tokens. It stays in the race because it is a
different compiled form of the same math, and the gap between the two says how much
vLLM's compile settings are worth. (It was called ``reference.inductor`` before; the
store migrates old rows.)

Kind REFERENCE with priority 40 (PyTorch code; ranked below FL's reference so the fixed
FL order is unchanged — see ``dispatch/types.py``). The first call of each (op, dtype)
pays the compile; the calibrator warms up before timing, so that cost is never measured
as kernel time.
"""
from __future__ import annotations

import shutil
import threading

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ..ops import NOT_COMPILED, OPS
from ._util import dtype_reason, import_reason

PRIORITY = 40
IMPL_ID = "inductor.standalone"
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
    return [OpImpl(op_name=name, impl_id=IMPL_ID, kind=BackendImplKind.REFERENCE,
                   fn=_make_fn(name), priority=PRIORITY, backend="inductor",
                   qualify=_qualify, precision_rank=1)
            for name in OPS if name not in NOT_COMPILED]
