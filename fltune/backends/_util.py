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
