"""The vLLM general plugin: ``vllm.general_plugins: fltune = ...plugin:register``.

vLLM calls :func:`register` once in every process it starts (API server, engine core, each
worker; workers are spawned on CPU, so nothing of the parent's state is inherited). The
plugin is configured by the environment, which every process sees alike:

- ``FLTUNE_MANIFEST``: a frozen manifest (``fltune freeze --db X --out m.json``);
- ``FLTUNE_DB``: a calibration DB, frozen for this device at start through
  ``fltune.freeze.manifest_for_this_device`` (``fltune serve`` freezes once in its own
  process and hands the workers ``FLTUNE_MANIFEST`` instead, so every rank reads the same
  file); ``FLTUNE_MANIFEST`` wins when both are set;
- ``FLTUNE_STRICT=1``: refuse to start when the manifest cannot be applied;
- ``FLTUNE_COUNTERS_FILE``: where each model process writes its per-(op, impl) call counts
  (JSON, rewritten every ``FLTUNE_COUNTERS_INTERVAL`` seconds and at exit; ``{pid}`` in
  the name is replaced by the process id, for several workers);
- ``FLTUNE_ROUTE``: ``auto`` (default) or ``all``; see "Fusion" below.

Fusion. A routed op is an opaque custom op: Inductor cannot fuse it with its neighbours
(the residual add before a norm, the q/k split and norms around rope), so in a compiled
vLLM it costs at least one kernel of its own where the native path may cost none. The
calibration times each op alone, where that cost does not show; at decode sizes the
candidates are within a microsecond of each other and the lost fusion dominates (measured
on the H200: every op routed, Qwen3-0.6B batch 16 ran at 0.80x vanilla vLLM). So with
``FLTUNE_ROUTE=auto``, when vLLM compiles with Inductor, an op is routed only if its win
over the native compiled path (the ``reference.inductor`` candidate), averaged over a
decode mix (1, 8, 32 and 128 tokens), exceeds the device's launch floor (the fastest
kernel the calibration ever timed there): the least a kernel of its own costs. In eager
mode (nothing fuses) and with ``FLTUNE_ROUTE=all`` every non-native op is routed.

Neither variable set: the plugin does nothing at all. Set: the manifest is loaded and
checked here, in every process, before anything is changed — format and fingerprint, that
it was frozen for this kind of device, that every implementation it names exists and
qualifies here — and then the OOT layer classes are registered (``ops.py``) and the model
runner's ``load_model`` is hooked (``hooks.py``) to freeze the dispatch and record the
fingerprint before the model is built and first traced.

Any failure on the way: with ``FLTUNE_STRICT=1`` the error is raised, which stops vLLM
from starting (a wrong kernel choice must not serve silently); without it, one loud
warning names the problem and vLLM runs exactly as it would without fltune.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

from ...dispatch import frozen
from ...dispatch.manifest import Manifest, OpEntry
from . import ops
from .config import (ADDITIONAL_CONFIG_KEY, ENV_COUNTERS, ENV_COUNTERS_INTERVAL,  # noqa: F401
                     ENV_DB, ENV_MANIFEST, ENV_ROUTE, ENV_STRICT, ROUTE_CONFIG_KEY, ROUTE_MODES,
                     ROUTE_RULE, STATUS, FltunePluginError, check_route, compiled_with_inductor,
                     exact_device_problem, route_key, set_failure_handler)
from .ops import CALL_COUNTS, counters, reset_counters  # noqa: F401  (public re-exports)

log = logging.getLogger("vllm.fltune")

NATIVE_PREFIX = "reference."
DECODE_MIX = (1, 8, 32, 128)


def _truthy(v: Optional[str]) -> bool:
    return str(v or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    manifest: Optional[str] = None
    db: Optional[str] = None
    strict: bool = False
    counters_file: Optional[str] = None
    counters_interval: float = 1.0
    route: str = "auto"

    @classmethod
    def from_env(cls, environ=None) -> Optional["Settings"]:
        env = os.environ if environ is None else environ
        manifest, db = env.get(ENV_MANIFEST) or None, env.get(ENV_DB) or None
        if manifest is None and db is None:
            return None
        try:
            interval = float(env.get(ENV_COUNTERS_INTERVAL, "1.0"))
        except ValueError:
            interval = 1.0
        route = (env.get(ENV_ROUTE) or "auto").strip().lower()   # checked in apply()
        return cls(manifest=manifest, db=db, strict=_truthy(env.get(ENV_STRICT)),
                   counters_file=env.get(ENV_COUNTERS) or None, counters_interval=interval,
                   route=route)

    @property
    def source(self) -> str:
        return f"{ENV_MANIFEST}={self.manifest}" if self.manifest else f"{ENV_DB}={self.db}"


@dataclass(frozen=True)
class Plan:
    """What this process serves with: the manifest and, per op, whether it is routed."""

    manifest: dict
    source: str
    fingerprint: str
    #: op -> the implementations its bands pick, for ops routed through fltune's seams
    routed: dict
    #: ops whose winners are all native PyTorch (``reference.*``): left on vLLM's path
    native: tuple
    #: ops in the manifest that no vLLM layer seam of this integration calls
    unseamed: tuple
    strict: bool = False
    settings: Optional[Settings] = field(default=None, compare=False)
    #: whether the exact device/driver check already ran in this process
    device_checked: bool = False
    #: op -> FusionVerdict, for the routed ops: whether to route it when Inductor compiles
    fusion: dict = field(default_factory=dict)
    route: str = "auto"
    #: the same manifest, typed (``dispatch.manifest.Manifest``): what the plan reads
    typed: Optional[Manifest] = field(default=None, compare=False, repr=False)

    def routes(self, op_name: str, compiled: bool) -> bool:
        """Whether ``op_name`` goes through fltune's custom op in this vLLM configuration."""
        if op_name not in self.routed:
            return False
        if not compiled or self.route == "all":
            return True
        verdict = self.fusion.get(op_name)
        return verdict is None or verdict.route_compiled

    def effective_routes(self, compiled: bool) -> list:
        return sorted(op for op in self.routed if self.routes(op, compiled))


@dataclass(frozen=True)
class FusionVerdict:
    """Whether a routed op is still worth routing where Inductor would fuse its native path."""

    decode_gain_us: Optional[float]   # mean (native compiled - winner) over DECODE_MIX
    launch_floor_us: Optional[float]
    route_compiled: bool
    why: str




def fusion_verdict(entry: OpEntry, launch_floor_us: Optional[float]) -> FusionVerdict:
    """Weigh the op's decode-mix win over the native compiled path against one kernel launch
    (see the module docstring). Tables are weighted by their calls per token. Without the
    data (a manifest frozen before points were kept, or no Inductor time measured) the op
    stays routed, as the manifest says."""
    num = den = 0.0
    for table in entry.tables:
        w = float(table.weight or 1)
        for tokens in DECODE_MIX:
            p = table.point_at(tokens)
            if p is None or p.median_us is None or p.native_us is None:
                continue
            num += w * (p.native_us - p.median_us)
            den += w
    if not den or launch_floor_us is None:
        return FusionVerdict(None, launch_floor_us, True,
                             "no native-compiled timings in the manifest: routed as measured")
    gain = num / den
    if gain > launch_floor_us:
        return FusionVerdict(gain, launch_floor_us, True,
                             f"decode win {gain:.2f} us/call > launch floor "
                             f"{launch_floor_us:.2f} us")
    return FusionVerdict(gain, launch_floor_us, False,
                         f"decode win {gain:.2f} us/call <= launch floor "
                         f"{launch_floor_us:.2f} us: left to Inductor to fuse")


# ---- building the plan (no side effects) ------------------------------------------------

def this_device() -> tuple:
    """(device type, capability or None) of this process, as vLLM sees it. No CUDA context
    is created (vLLM's platform answers from NVML), so this is safe before workers fork."""
    from vllm.platforms import current_platform

    cap = None
    try:
        c = current_platform.get_device_capability()
        if c is not None:
            cap = (int(c[0]), int(c[1]))
    except Exception:
        cap = None
    return current_platform.device_type, cap


def resolve_manifest(settings: Settings) -> tuple:
    """(manifest dict, source text). Raises ManifestError/PluginError with the fix."""
    if settings.manifest:
        if settings.db:
            log.info("fltune: both %s and %s are set; using the manifest", ENV_MANIFEST,
                     ENV_DB)
        return frozen.load_manifest(settings.manifest), settings.manifest
    manifest = freeze_db(settings.db, strict=settings.strict)
    return manifest, f"{settings.db} (frozen for this device)"


def freeze_db(db_path: str, strict: bool = False) -> dict:
    """``fltune.freeze.manifest_for_this_device(db_path)``, checked; its warnings logged."""
    try:
        from ...freeze import manifest_for_this_device
    except ImportError as e:
        raise FltunePluginError(
            f"{ENV_DB} is set, but this fltune cannot freeze a DB at start "
            f"(fltune.freeze.manifest_for_this_device: {e}); freeze it with `fltune freeze "
            f"--db {db_path} --out m.json` and set {ENV_MANIFEST}=m.json instead") from e
    got = manifest_for_this_device(db_path, strict=strict)
    manifest, warnings = got if isinstance(got, tuple) else (got, [])
    for w in warnings:
        log.warning("fltune: %s", w)
    frozen.verify_manifest(manifest, f"manifest frozen from {db_path}")
    return manifest


def _manifest_device_type(manifest: dict) -> Optional[str]:
    dev = manifest.get("device")
    if isinstance(dev, dict):
        for k in ("type", "device_type", "kind"):
            if isinstance(dev.get(k), str):
                return dev[k].lower()
    if isinstance(dev, str) and dev.lower() in ("cpu", "cuda", "xpu", "rocm", "hip"):
        return dev.lower()
    return None


def _describe_device(manifest: dict) -> str:
    dev = manifest.get("device")
    if isinstance(dev, dict):
        return ", ".join(f"{k}={v}" for k, v in dev.items() if not isinstance(v, (dict, list)))
    return str(dev)


def build_plan(manifest: dict, source: str, *, device_type: str,
               capability: Optional[tuple] = None, strict: bool = False,
               exact_device: bool = False, registry=None,
               settings: Optional[Settings] = None) -> Plan:
    """Check ``manifest`` for this device and decide what is routed. Changes nothing.

    Checks, in order: format and fingerprint; the device type it was frozen for; with
    ``exact_device``, the very device and driver (:func:`exact_device_problem`); that
    every implementation it names is registered and qualifies here for the table's dtype.
    """
    from ...dispatch.types import QualifyContext
    from ...ops import dtype_from_name

    frozen.verify_manifest(manifest, source)
    typed = Manifest.from_json(manifest, source, verify=False)
    want = _manifest_device_type(manifest)
    if want is not None and want != device_type:
        raise FltunePluginError(
            f"{source} was frozen for another device ({_describe_device(manifest)}); this "
            f"process runs on {device_type}. Calibrate this device and freeze its own "
            f"manifest")
    if exact_device:
        why = exact_device_problem(manifest)
        if why is not None:
            raise FltunePluginError(f"{source} was frozen for another device: {why}. "
                                    f"Calibrate this device and freeze its own manifest")
    if registry is None:
        from ...dispatch.manager import get_default_manager
        registry = get_default_manager().registry
    try:
        frozen.FrozenDispatch(manifest, registry)      # every op and impl id resolves
    except KeyError as e:
        raise FltunePluginError(f"{source}: {e.args[0] if e.args else e}") from None

    problems = []
    for op_name, entry in typed.ops.items():
        dtypes = {t.dtype for t in entry.tables} or {"bf16"}
        checks = {(b.impl_id, t.dtype) for t in entry.tables for b in t.bands}
        checks |= {(entry.fallback, d) for d in dtypes}
        for impl_id, dt in sorted(checks):
            why = registry.get(op_name, impl_id).qualify(
                QualifyContext(device_type, dtype_from_name(dt), capability))
            if why is not None:
                problems.append(f"{op_name}/{dt} -> {impl_id}: {why}")
    if problems:
        raise FltunePluginError(
            f"{source} names implementations that cannot run here ({device_type}): "
            + "; ".join(problems[:6]) + (" ..." if len(problems) > 6 else "")
            + ". Was it frozen for another device?")

    routed, native, unseamed, fusion = {}, [], [], {}
    for op_name, entry in sorted(typed.ops.items()):
        winners = entry.impl_ids()
        if all(w.startswith(NATIVE_PREFIX) for w in winners):
            native.append(op_name)
        elif op_name not in ops.SEAMED_OPS:
            unseamed.append(op_name)
        else:
            routed[op_name] = tuple(dict.fromkeys(winners))
            fusion[op_name] = fusion_verdict(entry, typed.launch_floor_us)
    return Plan(manifest=manifest, typed=typed, source=source, fingerprint=typed.fingerprint,
                routed=routed, native=tuple(native), unseamed=tuple(unseamed),
                strict=strict, settings=settings, device_checked=exact_device,
                fusion=fusion, route=settings.route if settings is not None else "auto")


def plan_table(plan: Plan) -> str:
    """One compact line per op: its bands and the implementation each picks."""
    lines = [f"fltune manifest {plan.fingerprint[:12]} ({plan.source})"]
    typed = plan.typed or Manifest.from_json(plan.manifest, plan.source, verify=False)
    for op_name, entry in sorted(typed.ops.items()):
        state = ("routed" if op_name in plan.routed else
                 "native (vLLM's path)" if op_name in plan.native else
                 "no vLLM seam")
        verdict = plan.fusion.get(op_name)
        if verdict is not None and plan.route == "auto":
            state += (" (compiled: routed)" if verdict.route_compiled
                      else " (compiled: native)")
        tables = []
        for t in entry.tables:
            bands = " ".join(f"[{b.lo},{b.hi}]={b.impl_id}" for b in t.bands)
            tables.append(f"{t.dtype} {'x'.join(map(str, t.trailing))}: {bands}")
        body = "; ".join(tables) if tables else "(no bands)"
        lines.append(f"  {op_name:<26} {state:<21} {body}  else {entry.fallback}")
        if verdict is not None and plan.route == "auto":
            lines.append(f"  {'':<26} {verdict.why}")
    return "\n".join(lines)


# ---- applying it ------------------------------------------------------------------------

_lock = threading.RLock()
_registered = False
#: what happened in this process: None (not configured), "applied", or the error text



def fail(exc: BaseException, settings: Optional[Settings], where: str) -> None:
    """Strict: raise. Otherwise: one loud warning, and vLLM is left exactly as it was."""
    strict = settings.strict if settings is not None else False
    source = settings.source if settings is not None else "fltune"
    ops.clear_plan()
    try:
        ops.unregister_layers()
    except Exception:
        pass
    frozen.thaw_dispatch()
    STATUS.update(state="failed", error=f"{type(exc).__name__}: {exc}", source=source)
    try:
        # `fltune serve` put the fingerprint and route on the command line; the hook strips
        # them from a process that serves vanilla, so its graphs are not cached under them
        from . import hooks
        hooks.install_load_model_hooks()
    except Exception:
        pass
    if strict:
        raise FltunePluginError(f"fltune ({where}, {ENV_STRICT}=1): refusing to start: "
                                f"{exc}") from exc
    log.warning(
        "\n%s\nfltune: MANIFEST NOT APPLIED (%s; pid %d)\n  %s: %s\n  vLLM runs with its "
        "own kernels, unchanged. Set %s=1 to refuse to start instead.\n%s",
        "!" * 78, source, os.getpid(), type(exc).__name__, exc, ENV_STRICT, "!" * 78)


def apply(settings: Settings) -> Optional[Plan]:
    """Load, check and install the plan for this process; see the module docstring."""
    try:
        check_route(settings.route)
        manifest, source = resolve_manifest(settings)
        device_type, cap = this_device()
        # the exact device check touches the device: here only where that is harmless
        # (CPU); on an accelerator the load_model hook runs it in the model's process
        plan = build_plan(manifest, source, device_type=device_type, capability=cap,
                          strict=settings.strict, exact_device=device_type == "cpu",
                          settings=settings)
        if plan.routed:
            conflicts = ops.oot_conflicts()
            if conflicts:
                raise FltunePluginError("another vLLM plugin already replaced "
                                        + ", ".join(conflicts))
        from . import hooks

        ops.set_plan(plan)
        if plan.routed:
            # narrowed to the routes the compile mode keeps in before_load_model
            ops.register_layers(plan.routed)
        hooks.install_load_model_hooks()
    except Exception as e:
        fail(e, settings, "loading the manifest")
        return None
    STATUS.update(state="applied", error=None, source=plan.source)
    log.info("%s", plan_table(plan))
    return plan


def register() -> None:
    """vLLM's entry point. Idempotent; inert unless FLTUNE_MANIFEST or FLTUNE_DB is set."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        settings = Settings.from_env()
        if settings is None:
            return
        apply(settings)


def _reset_for_tests() -> None:
    """Undo :func:`register` in this process (tests only)."""
    global _registered
    with _lock:
        _registered = False
        ops.clear_plan()
        ops.unregister_layers()
        frozen.thaw_dispatch()
        STATUS.update(state=None, error=None, source=None)


set_failure_handler(fail)
