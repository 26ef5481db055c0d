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
- ``FLTUNE_ROUTE``: ``auto`` (default), ``all``, or ``ops:a,b``; see "Which ops are routed"
  below;
- ``FLTUNE_SEAM``: ``layer`` (default: every op through the OOT layer classes) or ``ir``:
  the ops that are vLLM IR ops on the installed vLLM (``rms_norm``, ``fused_add_rms_norm``)
  go through vLLM's own priority list with fltune as an IR provider (``ir_provider.py``),
  the rest through the layer classes; no op is claimed by both.

Which ops are routed. Only ops whose manifest picks something other than vLLM's own path
(an impl id not starting with ``reference.``, ``native.`` or ``inductor.``:
``dispatch.manifest.is_native``) and that a vLLM layer seam calls are candidates. Of those:

- ``FLTUNE_ROUTE=ops:a,b`` routes exactly the listed ops (the model-step adjudication's
  arms: one op at a time), whatever the compile mode and the decisions;
- ``FLTUNE_ROUTE=all`` routes every candidate;
- ``auto`` (default): when the manifest carries **model-step decisions** for the model being
  served (``route_decisions``, measured end to end by ``evaluate/model_step.py`` and frozen
  in), an op is routed only if its decision is 'route'; an op decided 'native' (or left
  undecided for a model that has decisions) keeps vLLM's own layer class. The served model
  is recognised in the model's process, in the load_model hook, by
  ``dispatch.manifest.model_key`` of vLLM's HF config (architecture and dimensions, not a
  name or a path: see there why). A model without decisions is **not routed when vLLM
  compiles** (Inductor): vLLM's path stays, and the plan says that its routing is unmeasured
  and how to measure it. In eager mode (nothing fuses) it is routed as calibrated.

Why not the launch-floor rule below for an unmeasured compiled model (rule /2 did that): on
the H200 (2026-11-30, ``benchmarks/results/h200-2026-11-30-s5``) it routed Qwen3-0.6B's
rotary_embedding, and the model's GPU kernel time per step rose 2.4-5.1 % at every point
(paired CIs well clear of 1) and prefill 8192 ran at 0.937x vanilla [0.915, 0.963]. A kernel
race cannot see what routing costs inside a compiled model; only the model step can. The
launch-floor estimate is still computed and shown beside the verdict.

Fusion (the launch-floor estimate). A routed op is an opaque custom op: Inductor cannot fuse it with its neighbours
(the residual add before a norm, the q/k split and norms around rope), so in a compiled
vLLM it costs at least one kernel of its own where the native path may cost none. The
calibration times each op alone, where that cost does not show; at decode sizes the
candidates are within a microsecond of each other and the lost fusion dominates (measured
on the H200: every op routed, Qwen3-0.6B batch 16 ran at 0.80x vanilla vLLM). The estimate
(``fusion_verdict``): an op's win over the native compiled path (``native.vllm`` where
measured, else the standalone ``inductor.standalone`` candidate), averaged over a decode mix
(1, 8, 32 and 128 tokens), against the device's launch floor (the fastest kernel the
calibration ever timed there): the least a kernel of its own costs. It is shown in the plan
as a hint of what a model-step run may find; it no longer routes anything (rule /3, above).
In eager mode (nothing fuses) and with ``FLTUNE_ROUTE=all`` every non-native op is routed.

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
from ...dispatch.manifest import NATIVE_PREFIXES, Manifest, OpEntry, is_native, tp_of_key
from . import linear_seam, ops
from .config import (ADDITIONAL_CONFIG_KEY, ENV_COUNTERS, ENV_COUNTERS_INTERVAL,  # noqa: F401
                     ENV_DB, ENV_MANIFEST, ENV_ROUTE, ENV_STRICT, OPS_PREFIX, ROUTE_CONFIG_KEY,
                     ROUTE_MODES, ROUTE_RULE, STATUS, FltunePluginError, check_route,
                     compiled_with_inductor, exact_device_problem, normalize_route, route_key,
                     route_ops, served_model_key, set_failure_handler)
from .ops import CALL_COUNTS, counters, reset_counters  # noqa: F401  (public re-exports)

log = logging.getLogger("vllm.fltune")

#: kept for callers of the old name: the prefixes of vLLM's own path (``is_native``)
NATIVE_PREFIX = NATIVE_PREFIXES
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
        route = normalize_route(env.get(ENV_ROUTE))   # checked in apply()
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
    #: ops whose winners are all vLLM's own path or PyTorch (``is_native``): left native
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
    #: the served model's key (``dispatch.manifest.model_key``), once known (load_model hook)
    model: Optional[str] = None

    def with_model(self, key: Optional[str]) -> "Plan":
        """This plan for the model ``key`` (its route decisions apply)."""
        from dataclasses import replace
        return replace(self, model=key)

    def decisions(self) -> dict:
        """op -> RouteDecision of the served model (empty: unknown model, or unmeasured)."""
        return self.typed.decisions_for(self.model) if self.typed is not None else {}

    def route_verdict(self, op_name: str, compiled: bool) -> tuple:
        """(routed?, why) for ``op_name`` in this vLLM configuration (module docstring)."""
        if op_name not in self.routed:
            return False, ("native in every band" if op_name in self.native
                           else "not routable here")
        listed = route_ops(self.route)
        if listed is not None:
            return (op_name in listed,
                    f"{ENV_ROUTE}={self.route}: " + ("listed" if op_name in listed
                                                     else "not listed"))
        if self.route == "all":
            return True, f"{ENV_ROUTE}=all"
        decided = self.decisions()
        if decided:
            d = decided.get(op_name)
            if d is None:
                return False, ("model-step: no decision for this op (the model's others were "
                               "measured): vLLM's path")
            if d.mixed:
                return self._per_range_verdict(op_name, d)
            return d.routes, f"model-step {d.decision} ({d.rule}): {d.reason}"
        if op_name in linear_seam.DECISION_ONLY_OPS:
            return False, ("unmeasured: routed only on a model-step decision 'route' "
                           f"(`{adjudicate_hint(self, self.model)}`); vLLM's path")
        if not compiled:
            return True, "unmeasured; eager: routed as calibrated"
        verdict = self.fusion.get(op_name)
        estimate = f"; the launch-floor estimate alone: {verdict.why}" if verdict else ""
        return False, (f"unmeasured; compiled: vLLM's path until a model-step decision says "
                       f"route (`{adjudicate_hint(self, self.model)}`){estimate}")

    def _per_range_verdict(self, op_name: str, d) -> tuple:
        """An op decided per token range, route in some ranges and native in others
        (``range_lowering``): routed, with vLLM's path in the native ranges, where this vLLM
        configuration can serve that; else routed only if every range routes (it does not)."""
        from . import range_lowering

        routed = ", ".join(r.range_text() for r in d.ranges if r.routes)
        native = ", ".join(r.range_text() for r in d.ranges if not r.routes)
        why = range_lowering.per_range_problem(op_name)
        if why is None:
            return True, (f"model-step per range ({d.rule}): routed at {routed} tokens, "
                          f"vLLM's path at {native} ({d.reason})")
        return False, (f"model-step per range ({d.rule}): route at {routed} tokens, native "
                       f"at {native}, but {why}: routed only where every range routes, so "
                       f"vLLM's path ({d.reason})")

    def native_ranges(self, op_name: str) -> list:
        """[(min, max or None)]: the token ranges where ``op_name``, routed, goes to vLLM's
        path by a per-range decision ('auto' only: ``ops:``/``all`` route every size)."""
        if self.route != "auto":
            return []
        d = self.decisions().get(op_name)
        return d.native_ranges() if d is not None and d.mixed else []

    def routes(self, op_name: str, compiled: bool) -> bool:
        """Whether ``op_name`` goes through fltune's custom op in this vLLM configuration."""
        return self.route_verdict(op_name, compiled)[0]

    def effective_routes(self, compiled: bool) -> list:
        """The ops the layer classes route (the vLLM IR route's ops, ``ops.ir_owned``, are
        routed by vLLM's priority list instead: ``ir_provider``)."""
        owned = ops.ir_owned()
        return sorted(op for op in self.routed if self.routes(op, compiled)
                      and op not in owned)

    def possible_routes(self) -> list:
        """The ops that may route in some compile mode for some model: what ``register``
        registers layer classes for, before the model and the compile mode are known (the
        load_model hook narrows them)."""
        listed = route_ops(self.route)
        return sorted(op for op in self.routed if listed is None or op in listed)


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
        if all(is_native(w) for w in winners):
            native.append(op_name)
        elif op_name not in ops.SEAMED_OPS | linear_seam.SEAMED_OPS:
            unseamed.append(op_name)
        else:
            routed[op_name] = tuple(dict.fromkeys(winners))
            fusion[op_name] = fusion_verdict(entry, typed.launch_floor_us)
    return Plan(manifest=manifest, typed=typed, source=source, fingerprint=typed.fingerprint,
                routed=routed, native=tuple(native), unseamed=tuple(unseamed),
                strict=strict, settings=settings, device_checked=exact_device,
                fusion=fusion, route=settings.route if settings is not None else "auto")


def adjudicate_hint(plan: Plan, model: Optional[str] = None) -> str:
    """The command that measures a model's routing on this device (model-step adjudication),
    as complete as the plan knows it."""
    db = (plan.settings.db if plan.settings is not None and plan.settings.db else None) or (
        (plan.typed.source_db or {}).get("path") if plan.typed is not None else None)
    tp = tp_of_key(plan.model)
    eng = (f" --engine '{{\"tensor_parallel_size\": {tp}}}'" if tp > 1 else "")
    return (f"fltune adjudicate --db {db or 'X.db'} --model {model or 'MODEL'}{eng} "
            f"(then freeze again)")


def plan_table(plan: Plan, compiled: Optional[bool] = None) -> str:
    """One compact line per op: its bands, the implementation each picks, and whether it is
    routed (and why) — for the served model when the plan knows it (``plan.model``), else
    per decided model, with the way to measure a model that has no decisions."""
    lines = [f"fltune manifest {plan.fingerprint[:12]} ({plan.source})"]
    typed = plan.typed or Manifest.from_json(plan.manifest, plan.source, verify=False)
    decided = typed.decided_models()
    auto = plan.route == "auto"
    if plan.route != "auto":
        lines.append(f"  route mode {plan.route}")
    elif plan.model is not None and plan.decisions():
        lines.append(f"  routing decided by model-step measurement for {decided[plan.model]} "
                     f"({plan.model})")
    elif plan.model is not None:
        lines.append(f"  {plan.model}: routing unmeasured (no model-step decision in the "
                     f"manifest): compiled, vLLM's path; eager, as calibrated; measure with "
                     f"`{adjudicate_hint(plan)}`")
    elif decided:
        lines.append("  model-step decisions for " + ", ".join(
            f"{n} ({k})" for k, n in sorted(decided.items())) + "; another model: "
            f"unmeasured (compiled: vLLM's path), measure with `{adjudicate_hint(plan)}`")
    elif plan.routed:
        lines.append(f"  routing unmeasured (no model-step decision in the manifest): "
                     f"compiled, vLLM's path; eager, as calibrated; measure with "
                     f"`{adjudicate_hint(plan)}`")
    for op_name, entry in sorted(typed.ops.items()):
        state = ("routed" if op_name in plan.routed else
                 "native (vLLM's path)" if op_name in plan.native else
                 "no vLLM seam")
        whys = []
        if op_name in plan.routed:
            if auto and plan.model is None and decided:
                # the served model is not known here: each decided model's verdict
                for key, name in sorted(decided.items()):
                    d = typed.decisions_for(key).get(op_name)
                    if d is not None and d.mixed:
                        whys.append(f"{name}: per range: " + ", ".join(
                            f"{r.range_text()} {r.decision}" for r in d.ranges))
                        continue
                    whys.append(f"{name}: " + (f"{d.decision} ({d.reason})" if d else
                                               "no decision: vLLM's path"))
                verdict = plan.fusion.get(op_name)
                if verdict is not None:
                    whys.append(f"another model (unmeasured; compiled): {verdict.why}")
            else:
                ok, why = plan.route_verdict(op_name, True if compiled is None else compiled)
                state = ("routed" if ok and not why.startswith("model-step per range") else
                         "routed per range" if ok else
                         "native (decided)" if why.startswith("model-step") else "not routed")
                if compiled is None and why.startswith("unmeasured; compiled"):
                    state += " (compiled)"     # eager: routed
                whys.append(why)
        tables = []
        for t in entry.tables:
            bands = " ".join(f"[{b.lo},{b.hi}]={b.impl_id}" for b in t.bands)
            tables.append(f"{t.dtype} {'x'.join(map(str, t.trailing))}: {bands}")
        body = "; ".join(tables) if tables else "(no bands)"
        lines.append(f"  {op_name:<26} {state:<21} {body}  else {entry.fallback}")
        for why in whys:
            lines.append(f"  {'':<26} {why}")
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
        linear_seam.uninstall()
    except Exception:
        pass
    try:
        from . import ir_provider
        ir_provider.uninstall()
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
        if plan.possible_routes():
            conflicts = ops.oot_conflicts()
            if conflicts:
                raise FltunePluginError("another vLLM plugin already replaced "
                                        + ", ".join(conflicts))
        from . import hooks

        ops.set_plan(plan)
        # FLTUNE_SEAM=ir: vLLM's IR ops go through vLLM's priority list (ir_provider), and
        # the layer classes leave them alone; before the layers are registered
        from . import ir_provider
        ir_provider.install(plan)
        if plan.possible_routes():
            # narrowed to what the served model's decisions and the compile mode keep, in
            # before_load_model
            ops.register_layers(plan.possible_routes())
        if linear_seam.OP in plan.possible_routes():
            linear_seam.install()           # vLLM's GEMM methods; routed layers marked at load
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
        linear_seam.uninstall()
        from . import ir_provider
        ir_provider.uninstall()
        frozen.thaw_dispatch()
        from . import range_lowering
        range_lowering.bind(None)
        STATUS.update(state=None, error=None, source=None)


set_failure_handler(fail)
