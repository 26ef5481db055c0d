"""The ops fltune selects implementations for, each an :class:`OpSpec` (see ``base``)."""
from __future__ import annotations

from . import activation, gdn, linear, norm, rotary
from .base import (DTYPE_NAMES, DTYPES, OpSpec, clone_args, current_workload_dims,
                   dtype_from_name, in_workload, workload_dims)

OPS: dict[str, OpSpec] = {s.name: s for s in (*norm.SPECS, *activation.SPECS, *rotary.SPECS,
                                              *linear.SPECS, *gdn.SPECS)}

#: ops whose reference loops over data (GDN: sequences from ``cu_seqlens``, tokens one by
#: one): Dynamo cannot trace them whole, so the compiled-alone candidate skips them
NOT_COMPILED = frozenset(s.name for s in gdn.SPECS)


def get_op(name: str) -> OpSpec:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown op {name!r}; known ops: {', '.join(OPS)}") from None


__all__ = ["OPS", "OpSpec", "get_op", "clone_args", "dtype_from_name", "DTYPES", "DTYPE_NAMES",
           "workload_dims", "current_workload_dims", "in_workload"]
