"""The SGLang general plugin: ``sglang.srt.plugins: fltune = ...sglang.plugin:register``.

SGLang (>= 0.5.11) calls every general plugin from ``sglang.srt.plugins.load_plugins()`` in
each of its processes (the engine/launcher process and every scheduler process, which owns a
``ModelRunner``), then applies the hooks the plugins registered in its ``HookRegistry``
(``SGLANG_PLUGINS=a,b`` restricts which plugins load). The plugin is configured by the same
environment as the vLLM plugin (``fltune.integrations.vllm.plugin``), which every SGLang
process inherits:

- ``FLTUNE_MANIFEST`` (a frozen manifest) or ``FLTUNE_DB`` (a calibration DB, frozen for
  this device at start); neither set: the plugin does nothing at all;
- ``FLTUNE_STRICT=1``: refuse to start when the manifest cannot be applied;
- ``FLTUNE_ROUTE``: ``auto`` (default), ``all`` or ``ops:a,b``, with the vLLM plugin's rule
  (``Plan.route_verdict``): in ``auto`` a model with model-step decisions routes the ops
  decided 'route'; an unmeasured model is routed as calibrated in eager mode and left on
  SGLang's path when SGLang compiles (``--enable-torch-compile``: Inductor fuses the
  native code, which a kernel race cannot see);
- ``FLTUNE_COUNTERS_FILE`` / ``FLTUNE_COUNTERS_INTERVAL``: per-(op, impl) call counts of
  the model process, in the vLLM plugin's file format (``{pid}`` for several ranks).

What is shared with the vLLM plugin, not duplicated: the manifest checks and the plan
(``vllm.plugin.build_plan``: format, fingerprint, device, every named implementation
qualifying here; then narrowed to the ops SGLang has a seam for, ``layers.SEAMED_OPS``),
the frozen band table (``dispatch.frozen``), the band-dispatch custom ops and their call
counters (``vllm.ops``: ``torch.ops.fltune.*``), the counters file (``vllm.hooks``). None of
these modules imports vLLM.

When things happen, and why there:

1. ``register`` (every process, at plugin load): load and check the manifest, build the
   plan, register the AROUND hooks (``layers.py``: each seam class's forward resolver and
   ``enter_torch_compile``; ``ModelRunner.load_model``). Nothing is frozen yet.
2. ``ModelRunner.load_model`` (the scheduler process, before the model is built, so before
   any layer fixes its forward and before the first trace or CUDA-graph capture): the exact
   device/driver check, ``freeze_dispatch``, the served model's key (its model-step
   decisions apply), whether SGLang compiles, the record and the counters file. After it:
   the routed layers are counted, routed ops no layer calls are warned about, and routed
   ropes get their cache in the model dtype (outside any trace).

The fingerprint: SGLang has no config hash for whole-model compile artifacts (vLLM's
``additional_config``); its ``torch.compile`` graphs are traced in process and Inductor's
FX cache keys on the graph, in which a routed op is its own node while the band lookup
runs in the op's eager body. So a graph is never reused for another routing, and another
manifest with the same routing changes only what the eager body reads. The fingerprint is
logged and written to the counters record.

Failure: without ``FLTUNE_STRICT`` one loud warning names the problem and SGLang runs
exactly as without fltune. With it, the plugin raises — but ``load_plugins`` catches and
logs what a plugin raises and carries on, so the plugin also hooks ``load_model`` to raise
the same error in the model process: the engine does not start.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Optional

from ...dispatch import frozen
from ..vllm import hooks as counters_io
from ..vllm import plugin as vplugin
from ..vllm.config import (ENV_STRICT, FltunePluginError, check_route,  # noqa: F401
                           exact_device_problem)
from . import layers

log = logging.getLogger("sglang.fltune")

MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
#: this process's plan: applied, failed (and why), or not tried
STATUS: dict = {"state": None, "error": None, "source": None}
#: what the load_model hook recorded (also written to the counters file)
RECORD = counters_io.RECORD

_lock = threading.RLock()
_registered = False
_hooks_registered = False
_refusal: Optional[BaseException] = None


# ---- the plan (no side effects) -----------------------------------------------------------

def this_device() -> tuple:
    """(device type, capability or None), without creating a CUDA context where NVML
    answers (the launcher process must not take memory on GPU 0)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        return "cuda", (int(major), int(minor))
    except Exception:
        return "cuda", tuple(torch.cuda.get_device_capability())


def build_plan(manifest: dict, source: str, *, device_type: str, capability=None,
               strict: bool = False, exact_device: bool = False, settings=None):
    """The vLLM plugin's plan (every check included), narrowed to SGLang's seams: an op no
    SGLang layer of this integration calls is reported as unseamed, never routed."""
    plan = vplugin.build_plan(manifest, source, device_type=device_type,
                              capability=capability, strict=strict,
                              exact_device=exact_device, settings=settings)
    routed = {op: v for op, v in plan.routed.items() if op in layers.SEAMED_OPS}
    unseamed = tuple(sorted(set(plan.unseamed) | (set(plan.routed) - set(routed))))
    return replace(plan, routed=routed, unseamed=unseamed,
                   fusion={op: v for op, v in plan.fusion.items() if op in routed})


def plan_table(plan, compiled: Optional[bool] = None) -> str:
    """The vLLM plugin's per-op table (bands, picks, verdicts) for this plan."""
    return vplugin.plan_table(plan, compiled).replace("no vLLM seam", "no SGLang seam")


# ---- failure ------------------------------------------------------------------------------

def fail(exc: BaseException, settings, where: str) -> None:
    """Strict: refuse (here and in the model process). Otherwise: one loud warning, and
    SGLang is left exactly as it was (the hooks, if registered, are inert without a plan)."""
    global _refusal
    strict = settings.strict if settings is not None else False
    source = settings.source if settings is not None else "fltune"
    layers.set_plan(None)
    frozen.thaw_dispatch()
    STATUS.update(state="failed", error=f"{type(exc).__name__}: {exc}", source=source)
    if strict:
        _refusal = FltunePluginError(f"fltune ({where}, {ENV_STRICT}=1): refusing to start: "
                                     f"{exc}")
        try:
            _register_hooks()          # so that load_model raises it in the model process
        except Exception:
            pass
        log.error("%s", _refusal)
        raise _refusal from exc
    log.warning(
        "\n%s\nfltune: MANIFEST NOT APPLIED (%s; pid %d)\n  %s: %s\n  SGLang runs with its "
        "own kernels, unchanged. Set %s=1 to refuse to start instead.\n%s",
        "!" * 78, source, os.getpid(), type(exc).__name__, exc, ENV_STRICT, "!" * 78)


# ---- hooks --------------------------------------------------------------------------------

def _register_hooks() -> None:
    """Register the AROUND hooks once per process in SGLang's HookRegistry. SGLang applies
    them right after the plugins ran (``load_plugins``); :func:`apply_hooks` does it for a
    caller outside that (tests, scripts that build layers directly)."""
    global _hooks_registered
    with _lock:
        if _hooks_registered:
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        for target, hook in layers.hook_targets():
            HookRegistry.register(target, hook, HookType.AROUND)
        HookRegistry.register(f"{MODEL_RUNNER}.load_model", around_load_model,
                              HookType.AROUND)
        _hooks_registered = True


def apply_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    _register_hooks()
    HookRegistry.apply_hooks()


def around_load_model(original, runner, *args, **kwargs):
    return counters_io.around_load(runner, lambda: original(runner, *args, **kwargs),
                                   before_load_model, after_load_model)


def _sglang_compiles(runner) -> bool:
    """SGLang's ``--enable-torch-compile`` for this runner (0.5.17: server_args; 0.5.21
    also keeps it in ``get_flags().capture``)."""
    sa = getattr(runner, "server_args", None)
    if sa is not None and hasattr(sa, "enable_torch_compile"):
        return bool(sa.enable_torch_compile)
    try:
        from sglang.srt.runtime_context import get_flags

        return bool(get_flags().capture.enable_torch_compile)
    except Exception:
        return False


def _model_key(runner) -> Optional[str]:
    from ...dispatch.manifest import model_key

    hf = getattr(getattr(runner, "model_config", None), "hf_config", None)
    try:
        return model_key(hf, tp=int(getattr(runner, "tp_size", 1) or 1)) if hf is not None else None
    except Exception:
        return None


def before_load_model(runner) -> None:
    if _refusal is not None:
        raise _refusal
    plan = layers.current_plan()
    if plan is None:
        return
    try:
        if not plan.device_checked:
            why = exact_device_problem(plan.manifest)
            if why is not None:
                raise FltunePluginError(f"{plan.source} was frozen for another device: {why}")
        fd = frozen.current()
        if fd is None or fd.fingerprint != plan.fingerprint:
            fd = frozen.freeze_dispatch(plan.manifest)
        key = _model_key(runner)
        if key is not None and key != plan.model:
            plan = plan.with_model(key)
        compiled = _sglang_compiles(runner)
        layers.set_plan(plan, compiled=compiled)
        routes = sorted(op for op in plan.routed if plan.routes(op, compiled))
        RECORD.update(pid=os.getpid(), engine="sglang", fingerprint=fd.fingerprint,
                      source=plan.source, compiled_with_inductor=compiled,
                      route_mode=plan.route, effective_routes=routes,
                      routed={k: list(v) for k, v in plan.routed.items() if k in routes},
                      native_for_fusion={k: plan.route_verdict(k, compiled)[1]
                                         for k in plan.routed if k not in routes},
                      model_key=plan.model,
                      route_decisions={op: d.decision for op, d in
                                       sorted(plan.decisions().items())},
                      native=list(plan.native), unseamed=list(plan.unseamed),
                      frozen_at=time.time())
    except Exception as e:
        fail(e, plan.settings, "freezing before load_model")
        return
    settings = plan.settings
    if settings is not None and settings.counters_file:
        counters_io.start_counters_file(settings.counters_file, settings.counters_interval)
    log.info("fltune: dispatch frozen (%s) before load_model; SGLang compiles: %s",
             fd.fingerprint[:12], compiled)
    for op in sorted(plan.routed):
        ok, why = plan.route_verdict(op, compiled)
        log.info("fltune: %s %s (%s)", op, "routed" if ok else "left on SGLang's path", why)


def after_load_model(runner) -> None:
    plan = layers.current_plan()
    if plan is None or not plan.routed:
        return
    model = getattr(runner, "model", None)
    if model is None or not hasattr(model, "modules"):
        return
    dtype = getattr(getattr(runner, "model_config", None), "dtype", None)
    for m in model.modules():
        if (dtype is not None and "rotary_embedding" in layers._routes_of(m)
                and hasattr(m, "cos_sin_cache")):
            layers.match_cos_sin_cache(m, dtype)      # not inside a later trace
    found = layers.routed_layers(model)
    RECORD["layers"] = found
    missing = sorted({op for op in plan.routed if plan.routes(op, layers.compiled())}
                     - layers.built_routes(model))
    RECORD["routed_without_layer"] = missing
    log.info("fltune: routed layers %s", ", ".join(f"{k} x{v}" for k, v in
                                                    sorted(found.items())) or "none")
    if missing:
        log.warning("fltune: the manifest routes %s, but this model built no SGLang layer "
                    "that calls %s through fltune (it uses other layer classes or fused "
                    "kernels): those choices are not in effect", ", ".join(missing),
                    "it" if len(missing) == 1 else "them")
    counters_io._writer_flush()


# ---- the entry point ----------------------------------------------------------------------

def apply(settings) -> Optional[object]:
    """Load, check and install the plan for this process; see the module docstring."""
    try:
        check_route(settings.route)
        manifest, source = vplugin.resolve_manifest(settings)
        device_type, cap = this_device()
        plan = build_plan(manifest, source, device_type=device_type, capability=cap,
                          strict=settings.strict, exact_device=device_type == "cpu",
                          settings=settings)
        _register_hooks()
        layers.set_plan(plan)
    except Exception as e:
        fail(e, settings, "loading the manifest")
        return None
    STATUS.update(state="applied", error=None, source=plan.source)
    log.info("%s", plan_table(plan))
    return plan


def register() -> None:
    """SGLang's entry point. Idempotent; inert unless FLTUNE_MANIFEST or FLTUNE_DB is set."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        settings = vplugin.Settings.from_env()
        if settings is None:
            return
        apply(settings)


def _reset_for_tests() -> None:
    """Forget :func:`register` in this process (the registered hooks stay, inert)."""
    global _registered, _refusal
    with _lock:
        _registered = False
        _refusal = None
        layers.set_plan(None, compiled=False)
        frozen.thaw_dispatch()
        STATUS.update(state=None, error=None, source=None)
