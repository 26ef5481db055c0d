"""What the vLLM integration's modules share: the config keys, environment names, the
status of this process's plan, the plugin's error type, and the failure handler.

Why a module of its own: ``plugin`` (the entry point), ``hooks`` (the load_model hook) and
``ops`` (the custom ops and layers) each needed a few of these, and took them from
``plugin`` while ``plugin`` imported them — three import circles. Now ``config`` is
imported by the three and imports none of them; ``plugin`` installs its failure handler
here (:func:`set_failure_handler`) so that ``hooks`` can report a failure without importing
``plugin``.
"""
from __future__ import annotations

import functools
import hashlib
import os
from typing import Optional

ADDITIONAL_CONFIG_KEY = "fltune_dispatch_fingerprint"
#: the route mode (auto/all/ops:a,b) beside the fingerprint in additional_config: with the manifest
#: and vLLM's compilation config (hashed by vLLM itself) it fixes which ops are routed
ROUTE_CONFIG_KEY = "fltune_route"
#: bumped whenever the rule that turns (manifest, mode, compile mode) into routes changes:
#: the rule lives in code Dynamo never traces, so vLLM's code hash cannot see it
#: /2: in auto mode the manifest's model-step decisions for the served model decide (an op is
#: routed only where its decision is 'route'); the launch-floor rule only where the model has
#: none; 'ops:a,b' routes exactly the listed ops
#: /3: a model without decisions is routed only in eager mode; compiled, vLLM's path stays
#: (the launch-floor rule routed Qwen3-0.6B's rope on the H200 and made every step slower)
ROUTE_RULE = "model-step/3"
#: FLTUNE_ROUTE=ops:a,b — route exactly these ops (where the manifest has a non-native pick)
OPS_PREFIX = "ops:"


def route_ops(mode: str) -> Optional[tuple]:
    """The ops an ``ops:a,b`` mode lists (sorted), or None for another mode."""
    if not mode.startswith(OPS_PREFIX):
        return None
    return tuple(sorted({o.strip() for o in mode[len(OPS_PREFIX):].split(",") if o.strip()}))


def normalize_route(mode: Optional[str]) -> str:
    """The canonical spelling of a FLTUNE_ROUTE value (lower case; ``ops:`` sorted,
    duplicates dropped), so that one routing has one compile-cache key. Not checked."""
    mode = (mode or "auto").strip().lower()
    listed = route_ops(mode)
    return mode if listed is None else OPS_PREFIX + ",".join(listed)


def check_route(mode: str) -> None:
    """Raise if ``mode`` is not a FLTUNE_ROUTE value (the plugin and `fltune serve` both ask):
    ``auto``, ``all``, or ``ops:a,b`` naming known ops."""
    listed = route_ops(mode)
    if listed is not None:
        from ...ops import OPS

        unknown = [o for o in listed if o not in OPS]
        if not listed or unknown:
            raise FltunePluginError(
                f"{ENV_ROUTE}={mode!r}: "
                + (f"unknown op(s) {', '.join(unknown)}" if unknown else "no op listed")
                + f"; list ops of {', '.join(sorted(OPS))} (e.g. {OPS_PREFIX}silu_and_mul)")
        return
    if mode not in ROUTE_MODES:
        raise FltunePluginError(f"{ENV_ROUTE}={mode!r} is not one of {', '.join(ROUTE_MODES)} "
                                f"or {OPS_PREFIX}a,b; unset it for the default (auto)")


def route_key(mode: str) -> str:
    """The value keyed under ROUTE_CONFIG_KEY: the mode, the rule's version and
    :func:`code_digest`."""
    return f"{mode}:{ROUTE_RULE}:{code_digest()}"


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """12 hex digits of this package's own source (``fltune/integrations/vllm/*.py``).

    Why: its seams and Inductor lowerings (linear_lowering, range_lowering) shape the graphs
    vLLM compiles, yet Dynamo never traces them, so vLLM's code hash cannot see a change
    there, and a compile cache that outlives a new fltune (a warm GPU machine between two
    calls; the e2e instrument's model folder has been one path per config since session 29)
    would load graphs lowered by the old code. Any edit here costs one compile instead."""
    return source_digest(os.path.dirname(os.path.abspath(__file__)))


def source_digest(folder: str) -> str:
    """12 hex digits of the names and bytes of the ``*.py`` files in ``folder``."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:12]

ENV_MANIFEST = "FLTUNE_MANIFEST"
ENV_DB = "FLTUNE_DB"
ENV_STRICT = "FLTUNE_STRICT"
ENV_COUNTERS = "FLTUNE_COUNTERS_FILE"
ENV_COUNTERS_INTERVAL = "FLTUNE_COUNTERS_INTERVAL"
ENV_ROUTE = "FLTUNE_ROUTE"
ROUTE_MODES = ("auto", "all")
#: the token counts a decode step runs at, for weighing a routed op against fusion


class FltunePluginError(RuntimeError):
    """The manifest cannot be applied in this process (raised only when strict)."""


def served_model_key(vllm_config) -> Optional[str]:
    """The served model's key (``dispatch.manifest.model_key``: architecture, dimensions and
    tensor-parallel size) from vLLM's config, or None when vLLM does not say (no model config)."""
    from ...dispatch.manifest import model_key

    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    if hf is None:
        return None
    tp = getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1)
    try:
        return model_key(hf, tp=int(tp or 1))
    except Exception:
        return None


def compiled_with_inductor() -> bool:
    """Whether the vLLM being configured compiles the model with Inductor (so a native op
    can be fused). Read from vLLM's current compilation config; False outside vLLM."""
    try:
        from vllm.config import CompilationMode, get_cached_compilation_config

        cc = get_cached_compilation_config()
        return cc.mode not in (None, CompilationMode.NONE) and cc.backend == "inductor"
    except Exception:
        return False


def exact_device_problem(manifest: dict) -> Optional[str]:
    """Why ``manifest`` was not measured on this very device and driver (device key:
    name, capability, SM/core count, memory; ``fltune.freeze.check_device``), or None.

    Only call it where touching the device is harmless: on CUDA it queries device 0, which
    in the API server or engine-core process would create a CUDA context (memory on GPU 0,
    and vLLM would have to spawn its workers). The plugin calls it in the model process
    (the load_model hook) and, on CPU, already in ``register``."""
    try:
        from ...freeze import check_device
    except ImportError:
        return None
    return check_device(manifest)


#: this process's plan: applied, failed (and why), or not tried
STATUS: dict = {"state": None, "error": None, "source": None}
_failure_handler = None


def set_failure_handler(fn) -> None:
    """``fn(exc, settings, where)``: how a failure after start is reported (the plugin's
    ``fail``: serve vanilla loudly, or refuse under FLTUNE_STRICT)."""
    global _failure_handler
    _failure_handler = fn


def fail(exc: BaseException, settings, where: str) -> None:
    if _failure_handler is None:
        raise exc
    _failure_handler(exc, settings, where)
