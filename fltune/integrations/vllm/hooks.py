"""The model runner's ``load_model`` hook: freeze before the model is built and traced.

Why there: the layer classes decide their forward when the model is constructed (inside
``load_model``), and Dynamo traces at the first forward (the warm-up after ``load_model``).
So just before the original ``load_model`` runs, in the process that owns the model, this

1. freezes the dispatch from the plan's manifest (``dispatch.frozen``), so the routed
   layers and the band-dispatch ops see one immutable table;
2. writes the manifest fingerprint into ``vllm_config.additional_config`` under
   ``fltune_dispatch_fingerprint``: ``VllmConfig.compute_hash`` hashes additional_config,
   and that hash keys vLLM's compile caches (the AOT artifact directory on CPU, the
   Inductor cache on GPU), so another manifest never reuses a graph compiled for this one;
3. starts the counters file (``FLTUNE_COUNTERS_FILE``), if asked for;

and after it, counts the layers that really route, and warns when the plan routes ops the
model never built a seam for.

The runner classes are patched where they are defined, when their module is imported
(vLLM imports the worker, and so the runner, only after loading plugins): a small import
hook waits for each module, so processes that never build a model (API server, engine
core) never import a runner because of fltune.
"""
from __future__ import annotations

import atexit
import importlib.abc
import json
import logging
import os
import sys
import threading
import time

from ...dispatch import frozen
from . import linear_seam, ops

log = logging.getLogger("vllm.fltune")

#: (module, class) of every model runner whose own ``load_model`` we wrap
RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
    ("vllm.v1.worker.xpu_model_runner", "XPUModelRunner"),
)

_patched: set = set()
_install_lock = threading.Lock()
_finder = None
#: what the hook recorded in this process (also written to the counters file)
RECORD: dict = {}


# ---- patching ---------------------------------------------------------------------------

def around_load(runner, call, before, after):
    """``call()`` (a runner's original ``load_model``) between ``before(runner)`` and
    ``after(runner)``, once per outermost call: a runner whose ``load_model`` calls a
    wrapped ``load_model`` again (a subclass, a reload) must not freeze or count twice.
    vLLM's runner patch and SGLang's AROUND hook both go through here."""
    first = not getattr(runner, "_fltune_loading", False)
    if first:
        runner._fltune_loading = True
        before(runner)
    try:
        return call()
    finally:
        if first:
            runner._fltune_loading = False
            after(runner)


def _wrap(cls) -> bool:
    orig = cls.__dict__.get("load_model")
    if orig is None or getattr(orig, "_fltune_wrapped", False):
        return False

    def load_model(self, *args, **kwargs):
        return around_load(self, lambda: orig(self, *args, **kwargs), before_load_model,
                           after_load_model)

    load_model._fltune_wrapped = True
    load_model.__wrapped__ = orig
    load_model.__name__ = orig.__name__
    load_model.__qualname__ = orig.__qualname__
    load_model.__doc__ = orig.__doc__
    cls.load_model = load_model
    return True


def _patch_module(module) -> None:
    for modname, clsname in RUNNERS:
        if modname == module.__name__ and (modname, clsname) not in _patched:
            cls = getattr(module, clsname, None)
            if cls is not None and _wrap(cls):
                _patched.add((modname, clsname))


class _LoaderProxy(importlib.abc.Loader):
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _patch_module(module)

    def __getattr__(self, name):            # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)


class _RunnerImportHook(importlib.abc.MetaPathFinder):
    """Patches a runner module right after it is imported, wherever that happens."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _LoaderProxy(spec.loader)
                return spec
        return None


def install_load_model_hooks() -> None:
    """Wrap ``load_model`` of every runner class: now if imported, else when imported."""
    global _finder
    with _install_lock:
        pending = []
        for modname, _ in RUNNERS:
            mod = sys.modules.get(modname)
            if mod is not None:
                _patch_module(mod)
            else:
                pending.append(modname)
        if pending and _finder is None:
            _finder = _RunnerImportHook(pending)
            sys.meta_path.insert(0, _finder)


# ---- the hook ---------------------------------------------------------------------------

def _strip_fltune_keys(runner) -> None:
    """A process that serves vanilla vLLM (the plan failed) must not cache its graphs under
    the fingerprint `fltune serve` put on the command line."""
    from .config import ADDITIONAL_CONFIG_KEY, ROUTE_CONFIG_KEY, STATUS

    if STATUS.get("state") != "failed":
        return
    extra = getattr(getattr(runner, "vllm_config", None), "additional_config", None)
    if isinstance(extra, dict) and (ADDITIONAL_CONFIG_KEY in extra or ROUTE_CONFIG_KEY in extra):
        extra.pop(ADDITIONAL_CONFIG_KEY, None)
        extra.pop(ROUTE_CONFIG_KEY, None)
        extra["fltune_applied"] = False


def before_load_model(runner) -> None:
    plan = ops.current_plan()
    if plan is None:
        try:
            _strip_fltune_keys(runner)
        except Exception:
            pass
        return
    from .config import (ADDITIONAL_CONFIG_KEY, ROUTE_CONFIG_KEY, compiled_with_inductor, fail,
                         route_key, served_model_key)

    from .config import FltunePluginError, exact_device_problem

    try:
        if not plan.device_checked:
            why = exact_device_problem(plan.manifest)
            if why is not None:
                raise FltunePluginError(f"{plan.source} was frozen for another device: "
                                        f"{why}")
        fd = frozen.current()
        if fd is None or fd.fingerprint != plan.fingerprint:
            fd = frozen.freeze_dispatch(plan.manifest)
        cfg = runner.vllm_config
        # per-range decisions read the served engine's compile mode (range_lowering)
        from . import range_lowering
        range_lowering.bind(cfg)
        # the served model: its model-step route decisions apply (plugin.Plan.route_verdict)
        key = served_model_key(cfg)
        if key is not None and key != plan.model:
            plan = plan.with_model(key)
            ops.set_plan(plan)
        hash_before = _config_hash(cfg)
        extra = cfg.additional_config
        if extra is None:
            cfg.additional_config = extra = {}
        if not isinstance(extra, dict):
            raise TypeError(f"vllm_config.additional_config is a {type(extra).__name__}, "
                            f"not a dict, so the dispatch fingerprint cannot be recorded "
                            f"in the compile-cache key")
        # which ops route depends on the route mode and the compile mode (fusion,
        # plugin.py); vLLM hashes its compilation config itself, the mode is keyed here
        compiled = compiled_with_inductor()
        routes = plan.effective_routes(compiled)
        decisions = plan.decisions()
        if routes:
            extra[ADDITIONAL_CONFIG_KEY] = fd.fingerprint
            extra[ROUTE_CONFIG_KEY] = route_key(plan.route)
        else:
            # Nothing routed: the model is vanilla vLLM's, so its compile-cache key must be
            # too. A key of its own made vLLM compile the same graph afresh, and Inductor's
            # benchmarked choices (combo kernels) then differ between compiles: on the H200
            # such an arm read +0.4-1.0 % GPU kernel time per step against vanilla while
            # routing nothing (benchmarks/results/h200-2026-11-30-i11).
            extra.pop(ADDITIONAL_CONFIG_KEY, None)
            extra.pop(ROUTE_CONFIG_KEY, None)
        # only the layers that route something are replaced (see ops.needed_layers)
        ops.unregister_layers(keep=ops.needed_layers(routes))
        # before the model's VllmBackend copies the Inductor config: linear lowered per
        # compile range (linear_lowering) and per-range decisions (range_lowering: compile
        # ranges at their edges, vLLM's native path in the ranges decided native)
        from . import range_lowering
        range_lowering.install(plan, cfg, routes)
        RECORD.update(pid=os.getpid(), fingerprint=fd.fingerprint, source=plan.source,
                      compiled_with_inductor=compiled, route_mode=plan.route,
                      effective_routes=routes,
                      routed={k: list(v) for k, v in plan.routed.items() if k in routes},
                      # the routable ops left native, and why (name kept for its readers)
                      native_for_fusion={k: plan.route_verdict(k, compiled)[1]
                                         for k in plan.routed if k not in routes},
                      model_key=plan.model,
                      route_decisions={op: d.decision for op, d in sorted(decisions.items())},
                      # per-range decisions served: op -> the ranges left to vLLM's path
                      native_ranges={op: plan.native_ranges(op) for op in routes
                                     if plan.native_ranges(op)},
                      native=list(plan.native), unseamed=list(plan.unseamed),
                      additional_config=_jsonable(extra),
                      config_hash={"before": hash_before, "after": _config_hash(cfg)},
                      frozen_at=time.time())
    except Exception as e:
        fail(e, plan.settings, "freezing before load_model")
        return
    settings = plan.settings
    if settings is not None and settings.counters_file:
        start_counters_file(settings.counters_file, settings.counters_interval)
    log.info("fltune: dispatch frozen (%s) before load_model; %s=%s", fd.fingerprint[:12],
             ADDITIONAL_CONFIG_KEY, fd.fingerprint[:12])
    for op in sorted(plan.routed):
        ok, why = plan.route_verdict(op, compiled)
        log.info("fltune: %s %s (%s)", op, "routed" if ok else "left on vLLM's path", why)


def after_load_model(runner) -> None:
    plan = ops.current_plan()
    if plan is None or not plan.routed:
        return
    model = None
    try:
        model = runner.get_model()
    except Exception:
        model = getattr(runner, "model", None)
    if model is None or not hasattr(model, "modules"):
        return
    layers = ops.routed_layers(model)
    if linear_seam.routed_layers(model):
        layers["linear (GEMM)"] = linear_seam.routed_layers(model)
    RECORD["layers"] = layers
    built = {op for m in model.modules() if isinstance(m, ops.SeamMixin)
             for op in m.fltune_routes} | linear_seam.built_routes(model)
    from .config import compiled_with_inductor

    missing = sorted(set(plan.effective_routes(compiled_with_inductor())) - built)
    RECORD["routed_without_layer"] = missing
    log.info("fltune: routed layers %s", ", ".join(f"{k} x{v}" for k, v in
                                                    sorted(layers.items())) or "none")
    if missing:
        log.warning("fltune: the manifest routes %s, but this model built no layer that "
                    "calls %s through fltune (it uses other layer classes, or the op is "
                    "disabled): those choices are not in effect", ", ".join(missing),
                    "it" if len(missing) == 1 else "them")
    _writer_flush()


def _config_hash(cfg):
    try:
        return cfg.compute_hash()
    except Exception as e:  # never let a diagnostic break loading
        return f"unavailable: {type(e).__name__}"


def _jsonable(obj):
    try:
        return json.loads(json.dumps(obj, default=str))
    except Exception:
        return str(obj)


# ---- counters file ----------------------------------------------------------------------

_writer = None


class _CountersWriter:
    def __init__(self, path: str, interval: float):
        self.path = path.replace("{pid}", str(os.getpid()))
        self.interval = max(0.05, interval)
        self._last = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fltune-counters",
                                        daemon=True)

    def start(self):
        self.flush(force=True)
        self._thread.start()
        atexit.register(self.close)

    def _run(self):
        while not self._stop.wait(self.interval):
            self.flush()

    def flush(self, force: bool = False):
        with self._lock:
            snap = ops.counters()
            if not force and snap == self._last:
                return
            body = dict(RECORD, counters=snap, rerouted=ops.rerouted(),
                        written_at=time.time())
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                d = os.path.dirname(os.path.abspath(self.path))
                os.makedirs(d, exist_ok=True)
                with open(tmp, "w") as f:
                    json.dump(body, f, indent=1, sort_keys=True, default=str)
                os.replace(tmp, self.path)
                self._last = snap
            except OSError as e:
                log.warning("fltune: cannot write counters to %s: %s", self.path, e)

    def close(self):
        self._stop.set()
        self.flush(force=True)


def start_counters_file(path: str, interval: float = 1.0) -> None:
    global _writer
    if _writer is not None:
        return
    _writer = _CountersWriter(path, interval)
    _writer.start()


def _writer_flush():
    if _writer is not None:
        _writer.flush(force=True)
