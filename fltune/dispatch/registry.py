"""A thread-safe registry of candidates, per op (FL's ``OpRegistry``)."""
from __future__ import annotations

import threading

from .types import OpImpl


class OpRegistry:
    def __init__(self):
        self._lock = threading.RLock()
        self._impls: dict[str, dict[str, OpImpl]] = {}

    def register(self, impl: OpImpl, *, replace: bool = False) -> None:
        with self._lock:
            per_op = self._impls.setdefault(impl.op_name, {})
            if impl.impl_id in per_op and not replace:
                raise ValueError(f"{impl.op_name}: implementation {impl.impl_id!r} is already "
                                 f"registered (pass replace=True to override it)")
            per_op[impl.impl_id] = impl

    def register_many(self, impls, *, replace: bool = False) -> None:
        for impl in impls:
            self.register(impl, replace=replace)

    def get_implementations(self, op_name: str) -> list[OpImpl]:
        with self._lock:
            return list(self._impls.get(op_name, {}).values())

    def get(self, op_name: str, impl_id: str) -> OpImpl:
        with self._lock:
            try:
                return self._impls[op_name][impl_id]
            except KeyError:
                known = ", ".join(self._impls.get(op_name, {})) or "none"
                raise KeyError(f"{op_name}: no implementation {impl_id!r} (registered: "
                               f"{known})") from None

    def ops(self) -> list[str]:
        with self._lock:
            return list(self._impls)

    def clear(self) -> None:
        with self._lock:
            self._impls.clear()
