"""Frozen dispatch: the serving hot path, resolved once from a manifest.

Why freeze: a call that consults a manager, a policy, a lock or a logger cannot be traced
by Dynamo without graph breaks, and every choice made at call time is a choice that can
differ between processes. So, as in vllm-plugin-FL's freeze PR, all selection happens once,
before the first trace: the manifest (built from the calibration DB by ``fltune freeze``)
becomes a table per op — (dtype, trailing shape) -> band edges and implementations — and a
frozen call is one dict lookup, a bisect over a handful of band edges (only where the op's
bands pick different implementations), and ``impl.fn(*args)``. No fallback on this path:
the manifest was parity-checked when it was measured.

Bands are looked up by the leading dimension of the op's key argument (rows), which is the
token count times ``rows_per_token`` (q/k norms run per head).

While frozen, policy changes raise; ``thaw_dispatch()`` (or ``reset_default_manager()``)
thaws; a forked child starts unfrozen, because the parent's choice may not hold for the
child's device and a stale table must never be inherited silently.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import logging
import os
import threading
from typing import Optional

from .types import UnsupportedCallError

log = logging.getLogger("fltune.dispatch")
from .manifest import (MANIFEST_FORMAT, Manifest, ManifestError,  # noqa: F401  (re-exported)
                       canonical_json, fingerprint_of, load_manifest, verify_manifest)


class DispatchFrozenError(RuntimeError):
    pass


class FrozenDispatch:
    def __init__(self, manifest: dict, registry):
        from ..ops import OPS, dtype_from_name

        typed = Manifest.from_json(manifest)
        self.manifest = copy.deepcopy(manifest)
        self.fingerprint = manifest["fingerprint"]
        self._tables: dict = {}
        self._fallback: dict = {}
        self._key_arg: dict = {}
        self.calls: dict = {}      # (op, impl_id) -> count; only when counting is on
        for op_name, entry in typed.ops.items():
            if op_name not in OPS:
                raise ManifestError(f"manifest names op {op_name!r}, which this fltune does "
                                    f"not know; freeze again with this version")
            self._key_arg[op_name] = OPS[op_name].key_arg
            table = {}
            for t in entry.tables:
                impls = [for_table(registry.get(op_name, b.impl_id), t.dims)
                         for b in t.bands]
                his = tuple(b.hi * t.rows_per_token for b in t.bands)
                table[(dtype_from_name(t.dtype), tuple(t.trailing))] = (his[:-1], tuple(impls))
            self._tables[op_name] = table
            self._fallback[op_name] = registry.get(op_name, entry.fallback)
        strict = bool((manifest.get("policy") or {}).get("strict"))
        self.strict = strict
        self.rerouted: dict = {}   # (op, declined impl, taken impl) -> calls, for diagnosis
        self._selectors = {
            op: _selector(self._tables[op], self._fallback[op], self._key_arg[op],
                          _reroute(op, _layout_chain(registry, op, self._fallback[op]),
                                   strict, self.rerouted), OPS[op].key_extra)
            for op in self._tables}

    def select(self, op_name: str, *args):
        """The implementation the frozen table picks for these arguments."""
        return self._selectors[op_name](args)

    def call(self, op_name: str, *args):
        return self._selectors[op_name](args).fn(*args)

    def ops(self):
        return list(self._tables)


def for_table(impl, dims: dict):
    """``impl`` as a table's bands call it: one that builds for the served model
    (``OpImpl.reads_workload_dims``: ``native.vllm``) gets the table's dims, as the race
    gave them when it measured the pick; any other, itself."""
    if not impl.reads_workload_dims or not dims:
        return impl
    from ..ops import in_workload

    return dataclasses.replace(impl, fn=in_workload(impl.fn, dims))


def _selector(table: dict, fallback, key_arg: int, reroute, key_extra=None):
    """One op's band lookup as a closure over its table, built once at freeze time: the
    hot path then costs a tuple index, two tensor attribute reads, one dict get, (only
    where bands pick different implementations) one bisect, and, for a candidate that
    declares limits (``OpImpl.supports``: strides, widths, dtype mix), its check. A call
    outside the picked candidate's support goes to ``reroute``: the band table was measured
    on packed inputs, and a kernel that ignores strides would be fast and wrong on a view.
    ``torch.Size`` hashes and compares like the tuple keys, so the trailing shape needs no
    conversion."""
    entries = {k: (edges, impls, None if edges else impls[0])
               for k, (edges, impls) in table.items()}
    get, bisect_left = entries.get, bisect.bisect_left
    if key_extra is not None:
        # ops whose trailing shape does not identify the table (``OpSpec.key_extra``:
        # linear's N and bias), in a closure of their own: the other ops' path is unchanged
        def select_keyed(args):
            x = args[key_arg]
            shape = x.shape
            hit = get((x.dtype, tuple(shape[1:]) + key_extra(args)))
            if hit is None:
                impl = fallback
            elif hit[2] is not None:
                impl = hit[2]
            else:
                impl = hit[1][bisect_left(hit[0], shape[0])]
            supports = impl.supports
            if supports is None or supports(*args) is None:
                return impl
            return reroute(impl, args)

        return select_keyed

    def select(args):
        x = args[key_arg]
        shape = x.shape                   # one read: each .shape builds a new object
        hit = get((x.dtype, shape[1:]))
        if hit is None:
            impl = fallback
        elif hit[2] is not None:
            impl = hit[2]
        else:
            impl = hit[1][bisect_left(hit[0], shape[0])]
        supports = impl.supports
        if supports is None or supports(*args) is None:
            return impl
        return reroute(impl, args)

    return select


#: the candidate that takes every call the op's contract allows: the eager reference
REFERENCE_IMPL = "reference.torch"


def _layout_chain(registry, op_name: str, fallback) -> tuple:
    """Where a call goes when the band's pick declines it: the manifest's fallback, then
    the eager reference (which takes any layout). Resolved once, at freeze time."""
    chain = [fallback]
    try:
        ref = registry.get(op_name, REFERENCE_IMPL)
    except KeyError:    # a registry without the reference (tests' toy registries)
        ref = None
    if ref is not None and ref is not fallback:
        chain.append(ref)
    return tuple(chain)


def _reroute(op_name: str, chain: tuple, strict: bool, counts: dict):
    """The slow path for a call outside the picked candidate's support: the first of
    ``chain`` that takes it (counted per (op, declined, taken)); strict, a refusal naming
    the call's problem; never the declined candidate."""
    def reroute(impl, args):
        why = impl.unsupported(args)
        if not strict:
            for alt in chain:
                if alt is not impl and alt.unsupported(args) is None:
                    key = (op_name, impl.impl_id, alt.impl_id)
                    n = counts.get(key, 0)
                    counts[key] = n + 1
                    if n == 0:     # once per route: a served model makes such calls often
                        log.warning("fltune: %s: the frozen pick %s declines some calls (%s); "
                                    "those go to %s", op_name, impl.impl_id, why, alt.impl_id)
                    return alt
        raise UnsupportedCallError(
            f"{op_name}: the frozen pick {impl.impl_id} does not take this call ({why}); "
            + ("strict dispatch refuses it (unset FLTUNE_STRICT to let another candidate "
               "take such calls)" if strict else
               f"and neither does any of {[a.impl_id for a in chain]}"))

    return reroute


def _default_registry():
    """The default manager's registry, through the provider ``fltune.dispatch`` installs at
    import: frozen dispatch must not import the manager (the manager imports this module
    to refuse policy changes while frozen; importing back made a circle)."""
    if _registry_provider is None:
        raise RuntimeError("no default registry: import fltune.dispatch, or pass registry=")
    return _registry_provider()


_registry_provider = None
_state_lock = threading.Lock()
_frozen: Optional[FrozenDispatch] = None


def current() -> Optional[FrozenDispatch]:
    return _frozen


def freeze_dispatch(manifest: dict, registry=None) -> FrozenDispatch:
    """Resolve every op of ``manifest`` once and install the table process-wide."""
    global _frozen
    if registry is None:
        registry = _default_registry()
    fd = FrozenDispatch(manifest, registry)
    with _state_lock:
        _frozen = fd
    return fd


def thaw_dispatch() -> None:
    global _frozen
    with _state_lock:
        _frozen = None


def is_dispatch_frozen() -> bool:
    return _frozen is not None


def get_frozen_dispatch_manifest() -> Optional[dict]:
    fd = _frozen
    return copy.deepcopy(fd.manifest) if fd is not None else None


def ensure_mutable(what: str) -> None:
    if _frozen is not None:
        raise DispatchFrozenError(f"cannot {what} while dispatch is frozen (fingerprint "
                                  f"{_frozen.fingerprint[:12]}); call thaw_dispatch() or "
                                  f"reset_default_manager() first")


def _reset_after_fork():
    global _frozen, _state_lock
    _state_lock = threading.Lock()
    _frozen = None


os.register_at_fork(after_in_child=_reset_after_fork)
