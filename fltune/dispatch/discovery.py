"""Backend discovery (FL's ``discovery.py``): built-in modules, the entry-point group
``fltune.backends``, and modules named in ``FLTUNE_PLUGIN_MODULES`` (comma separated;
``VLLM_FL_PLUGIN_MODULES`` accepted too).

A backend is a module (or any object) with ``implementations() -> list[OpImpl]``, or a
callable returning that list. A backend that fails to load is reported, not fatal: one
broken third-party package must not take the built-in candidates down with it.
"""
from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from ..backends import BUILTIN_BACKENDS
from .registry import OpRegistry
from .types import OpImpl

log = logging.getLogger("fltune.discovery")
ENTRY_POINT_GROUP = "fltune.backends"


@dataclass
class DiscoveryReport:
    loaded: list = field(default_factory=list)    # (source, name, number of impls)
    failed: list = field(default_factory=list)    # (source, name, error)


def _impls_of(obj) -> list[OpImpl]:
    if hasattr(obj, "implementations"):
        obj = obj.implementations
    impls = obj() if callable(obj) else obj
    impls = list(impls)
    bad = [i for i in impls if not isinstance(i, OpImpl)]
    if bad:
        raise TypeError(f"expected OpImpl objects, got {type(bad[0]).__name__}")
    return impls


def plugin_module_names(environ=None) -> list[str]:
    env = os.environ if environ is None else environ
    raw = env.get("FLTUNE_PLUGIN_MODULES", env.get("VLLM_FL_PLUGIN_MODULES", ""))
    return [m.strip() for m in raw.split(",") if m.strip()]


def discover(registry: OpRegistry, *, builtin=True, entry_point_group=ENTRY_POINT_GROUP,
             environ=None) -> DiscoveryReport:
    report = DiscoveryReport()
    sources = []
    if builtin:
        sources += [("builtin", m, lambda m=m: importlib.import_module(m))
                    for m in BUILTIN_BACKENDS]
    if entry_point_group:
        sources += [("entry_point", ep.name, ep.load)
                    for ep in entry_points(group=entry_point_group)]
    sources += [("env", m, lambda m=m: importlib.import_module(m))
                for m in plugin_module_names(environ)]
    for source, name, load in sources:
        try:
            impls = _impls_of(load())
            registry.register_many(impls, replace=True)
            report.loaded.append((source, name, len(impls)))
        except Exception as e:
            log.warning("fltune: backend %s (%s) failed to load: %s", name, source, e)
            report.failed.append((source, name, f"{type(e).__name__}: {e}"))
    return report
