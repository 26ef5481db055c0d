"""``reference``: the op's own PyTorch eager reference (FL's REFERENCE kind, priority 50).

It is both a candidate and, run on fp64 copies, the yardstick parity is measured
against — so it always qualifies, on every device and dtype: the selection can always
fall back to it."""
from __future__ import annotations

from ..dispatch.types import BackendImplKind, OpImpl
from ..ops import OPS
from ._util import dtype_reason


def implementations():
    return [OpImpl(op_name=name, impl_id="reference.torch", kind=BackendImplKind.REFERENCE,
                   fn=spec.reference, backend="reference", qualify=dtype_reason,
                   precision_rank=0)
            for name, spec in OPS.items()]
