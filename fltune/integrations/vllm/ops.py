"""The seams fltune puts into a vLLM model: band-dispatch custom ops and OOT layer classes.

Two layers, for two reasons:

1. **``torch.library`` custom ops** (namespace ``fltune``), registered when this module is
   imported, each with a fake implementation. A routed layer calls ``torch.ops.fltune.<op>``;
   Dynamo and Inductor see one opaque node with the right output shape, and the band lookup
   (``FrozenDispatch.select``: dtype and trailing shape, then a bisect over the row count)
   runs in the node's eager body on every call. A Python shape branch in ``forward`` would
   be evaluated once at trace time and baked into the graph (vLLM traces with guards off),
   so an op whose bands pick different implementations must not be dispatched there.
   The eager body is also where the per-(op, impl) call counters are kept: a counter in
   traced code would run once, at trace time.

2. **Out-of-tree CustomOp classes** (``CustomOp.register_oot``, keyed by the in-tree class
   name: ``RMSNorm``, ``GemmaRMSNorm``, ``RMSNormGated``, ``SiluAndMul``, ``GeluAndMul``,
   ``RotaryEmbedding``, ``MRotaryEmbedding``).
   vLLM's ``CustomOp.__new__`` instantiates the replacement wherever the model builds the
   in-tree class. Each replacement decides once, when vLLM fixes the layer's forward
   (``dispatch_forward``, at construction), whether the plan routes its op:

   - routed -> its forward calls the custom op (whatever vLLM's ``custom_ops`` list says,
     so users never hand-write ``+rms_norm``; an explicit ``-rms_norm`` is respected, with
     a warning);
   - not routed (no plan, or the manifest's winners are all ``reference.*``, i.e. native
     PyTorch) -> exactly vLLM's own choice, so Inductor can still fuse the native path.

   A layer that covers two ops (``RMSNorm``: with and without a residual) routes each one
   separately; calls the ops' contract cannot express (no weight, a variance-size
   override, a missing key) go to vLLM's own path.

The replacements keep the in-tree ``name`` (``rms_norm``, ...), not the class name that
``register_oot`` assigns, so ``compilation_config.custom_ops`` entries keep meaning what
users expect.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Optional

import torch

from ...dispatch import frozen

log = logging.getLogger("vllm.fltune")

NAMESPACE = "fltune"

# ---- call counters ----------------------------------------------------------------------

#: (op_name, impl_id) -> number of calls served in this process
CALL_COUNTS: collections.Counter = collections.Counter()


def counters() -> dict:
    """``{op: {impl_id: calls}}`` for this process."""
    out: dict = {}
    for (op, impl), n in sorted(CALL_COUNTS.items()):
        out.setdefault(op, {})[impl] = n
    return out


def rerouted() -> dict:
    """``{op: {"declined -> taken": calls}}``: calls the band's pick declined (a strided
    view, an odd width, a dtype mix: ``OpImpl.supports``) and another candidate served."""
    fd = frozen.current()
    out: dict = {}
    for (op, declined, taken), n in sorted((fd.rerouted if fd else {}).items()):
        out.setdefault(op, {})[f"{declined} -> {taken}"] = n
    return out


def reset_counters() -> None:
    CALL_COUNTS.clear()


# ---- the plan this process serves with --------------------------------------------------

_plan = None          # fltune.integrations.vllm.plugin.Plan, or None (vLLM untouched)
_plan_lock = threading.Lock()


def set_plan(plan) -> None:
    global _plan
    with _plan_lock:
        _plan = plan


def clear_plan() -> None:
    set_plan(None)


def current_plan():
    return _plan


#: ops the vLLM IR route owns in this process (``ir_provider.install``, FLTUNE_SEAM=ir): the
#: layer classes leave them to vLLM's IR, so no op is claimed by both routes
_ir_owned: frozenset = frozenset()


def set_ir_owned(op_names) -> None:
    global _ir_owned
    _ir_owned = frozenset(op_names)


def ir_owned() -> frozenset:
    return _ir_owned


def is_routed(op_name: str) -> bool:
    """Whether layers built now route ``op_name``: in the plan, not owned by the IR route,
    and (when vLLM compiles with Inductor) worth more than the fusion it gives up
    (``Plan.routes``)."""
    plan = _plan
    if plan is None or op_name not in plan.routed or op_name in _ir_owned:
        return False
    from .config import compiled_with_inductor

    return plan.routes(op_name, compiled_with_inductor())


def native_ranges(op_name: str) -> tuple:
    """Token ranges [(min, max or None)] in which the plan routes ``op_name`` but the served
    model's per-range decision says native (``plugin.Plan.native_ranges``); empty when the
    op is routed at every size."""
    plan = _plan
    return tuple(plan.native_ranges(op_name)) if plan is not None else ()


_rows_per_token: dict = {}


def tokens_of(op_name: str, x) -> int:
    """Tokens of the step a call runs in: vLLM's forward context's batch descriptor where it
    has one (the step's token count, padded as vLLM pads it); else from the call's key tensor
    ``x`` (2-D): rows = tokens x the op's table's ``rows_per_token`` (q/k norms run per head;
    a k norm with fewer heads than the table's q reads low by the GQA ratio)."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
        if is_forward_context_available():
            bd = get_forward_context().batch_descriptor
            if bd is not None and bd.num_tokens:
                return int(bd.num_tokens)
    except Exception:
        pass
    rows = int(x.shape[0])
    key = (op_name, x.dtype, tuple(x.shape[1:]))
    rpt = _rows_per_token.get(key)
    if rpt is None:
        from ...ops import DTYPE_NAMES

        plan = _plan
        t = (plan.typed.table_for(op_name, DTYPE_NAMES.get(x.dtype, ""), tuple(x.shape[1:]))
             if plan is not None and plan.typed is not None else None)
        rpt = _rows_per_token[key] = max(1, int(t.rows_per_token if t is not None else 1))
    return rows // rpt


def _frozen_dispatch() -> frozen.FrozenDispatch:
    fd = frozen.current()
    if fd is not None:
        return fd
    plan = _plan
    if plan is None:
        raise RuntimeError(
            "fltune: a routed op ran in a process with no frozen dispatch and no plan; "
            "the layer was built under a plan that has since been withdrawn")
    # a forked child starts unfrozen (dispatch.frozen thaws at fork); the plan it inherited
    # was validated for this device, so freezing it again gives the same tables
    return frozen.freeze_dispatch(plan.manifest)


def dispatch(op_name: str, *args):
    """Band lookup and call, counted. Runs eagerly, inside a custom op's body."""
    impl = _frozen_dispatch().select(op_name, *args)
    CALL_COUNTS[(op_name, impl.impl_id)] += 1
    return impl.fn(*args)


# ---- torch.library custom ops (registered at import: never lazily inside a trace) --------

Tensor = torch.Tensor


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return dispatch("rms_norm", x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::fused_add_rms_norm", mutates_args=("x", "residual"))
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    dispatch("fused_add_rms_norm", x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return None


@torch.library.custom_op(f"{NAMESPACE}::gemma_rms_norm", mutates_args=())
def gemma_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return dispatch("gemma_rms_norm", x, weight, eps)


@gemma_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::gemma_fused_add_rms_norm", mutates_args=())
def gemma_fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                             eps: float) -> tuple[Tensor, Tensor]:
    out, res = dispatch("gemma_fused_add_rms_norm", x, residual, weight, eps)
    return out, res


@gemma_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(residual)


def _gated_fake(x):
    return x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))


@torch.library.custom_op(f"{NAMESPACE}::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    return dispatch("silu_and_mul", x)


@torch.library.custom_op(f"{NAMESPACE}::gelu_and_mul", mutates_args=())
def gelu_and_mul(x: Tensor) -> Tensor:
    return dispatch("gelu_and_mul", x)


@torch.library.custom_op(f"{NAMESPACE}::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    return dispatch("gelu_tanh_and_mul", x)


for _op in (silu_and_mul, gelu_and_mul, gelu_tanh_and_mul):
    _op.register_fake(_gated_fake)


@torch.library.custom_op(f"{NAMESPACE}::rotary_embedding", mutates_args=("query", "key"))
def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    dispatch("rotary_embedding", positions, query, key, head_size, cos_sin_cache, is_neox)


@rotary_embedding.register_fake
def _(positions, query, key, head_size, cos_sin_cache, is_neox):
    return None


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_gated", mutates_args=())
def rms_norm_gated(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                   norm_before_gate: bool) -> Tensor:
    return dispatch("rms_norm_gated", x, z, weight, eps, group_size, norm_before_gate)


@rms_norm_gated.register_fake
def _(x, z, weight, eps, group_size, norm_before_gate):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NAMESPACE}::mrope", mutates_args=("query", "key"))
def mrope(positions: Tensor, query: Tensor, key: Tensor, head_size: int,
          cos_sin_cache: Tensor, mrope_section: list[int], interleaved: bool) -> None:
    dispatch("mrope", positions, query, key, head_size, cos_sin_cache, tuple(mrope_section),
             interleaved)


@mrope.register_fake
def _(positions, query, key, head_size, cos_sin_cache, mrope_section, interleaved):
    return None


#: op name -> the torch op a routed layer calls
TORCH_OPS = {
    "rms_norm": torch.ops.fltune.rms_norm,
    "fused_add_rms_norm": torch.ops.fltune.fused_add_rms_norm,
    "gemma_rms_norm": torch.ops.fltune.gemma_rms_norm,
    "gemma_fused_add_rms_norm": torch.ops.fltune.gemma_fused_add_rms_norm,
    "silu_and_mul": torch.ops.fltune.silu_and_mul,
    "gelu_and_mul": torch.ops.fltune.gelu_and_mul,
    "gelu_tanh_and_mul": torch.ops.fltune.gelu_tanh_and_mul,
    "rotary_embedding": torch.ops.fltune.rotary_embedding,
    "rms_norm_gated": torch.ops.fltune.rms_norm_gated,
    "mrope": torch.ops.fltune.mrope,
}

#: in-tree vLLM class name -> the fltune ops its forward can route
LAYER_OPS = {
    "RMSNorm": ("rms_norm", "fused_add_rms_norm"),
    "GemmaRMSNorm": ("gemma_rms_norm", "gemma_fused_add_rms_norm"),
    "SiluAndMul": ("silu_and_mul",),
    "GeluAndMul": ("gelu_and_mul", "gelu_tanh_and_mul"),
    "RotaryEmbedding": ("rotary_embedding",),
    "RMSNormGated": ("rms_norm_gated",),
    "MRotaryEmbedding": ("mrope",),
}

#: ops some vLLM layer seam can call (the rest of a manifest is reported, not routed)
SEAMED_OPS = frozenset(op for ops in LAYER_OPS.values() for op in ops)


# ---- OOT layer classes ------------------------------------------------------------------

_layer_classes: Optional[dict] = None
_layer_lock = threading.Lock()
_warned_disabled: set = set()


def _user_disabled(name: str) -> bool:
    from vllm.config import get_cached_compilation_config

    return f"-{name}" in get_cached_compilation_config().custom_ops


class SeamMixin:
    """Shared by every replacement class: fixes the routes when vLLM fixes the forward."""

    _fltune_ops: tuple = ()
    _fltune_layer: str = ""     # the in-tree class name this replaces

    def dispatch_forward(self, compile_native: bool = False):
        native = super().dispatch_forward(compile_native)  # vLLM's own choice, as is
        self._fltune_native = native
        routes = frozenset(op for op in self._fltune_ops if is_routed(op))
        if routes and _user_disabled(type(self).name):
            if type(self).name not in _warned_disabled:
                _warned_disabled.add(type(self).name)
                log.warning("fltune: the manifest routes %s, but compilation_config."
                            "custom_ops has '-%s'; respecting it: these layers stay on "
                            "vLLM's path", ", ".join(sorted(routes)), type(self).name)
            routes = frozenset()
        self._fltune_routes = routes
        # per-range decisions (range_lowering): in eager mode a call in a range decided
        # native goes to vLLM's own forward; traced, the graph keeps fltune's node and the
        # compile range decides (the plan routes a split op only where that works)
        from .range_state import traced
        self._fltune_split = ({} if not routes or traced() else
                              {op: native_ranges(op) for op in routes if native_ranges(op)})
        return self._fltune_forward if routes else native

    @property
    def fltune_routes(self) -> frozenset:
        return getattr(self, "_fltune_routes", frozenset())

    def _fltune_takes(self, op: str, x2d) -> bool:
        """Whether this call of ``op`` (key tensor ``x2d``, 2-D) goes to fltune: routed, and
        its token count is not in a range decided native (eager per-range decisions)."""
        if op not in self._fltune_routes:
            return False
        split = getattr(self, "_fltune_split", None)
        if not split or op not in split:
            return True
        from .range_state import in_ranges
        return not in_ranges(tokens_of(op, x2d), split[op])


def _norm_classes() -> dict:
    """Replacements of vLLM's RMSNorm, GemmaRMSNorm and RMSNormGated."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated

    class FltuneRMSNorm(SeamMixin, RMSNorm):
        _fltune_ops = LAYER_OPS["RMSNorm"]
        _fltune_layer = "RMSNorm"

        def _fltune_forward(self, x, residual=None):
            plain = self.has_weight and self.variance_size_override is None
            if residual is None:
                x2 = x.reshape(-1, x.shape[-1])
                if plain and self._fltune_takes("rms_norm", x2):
                    out = torch.ops.fltune.rms_norm(x2, self.weight.data,
                                                    self.variance_epsilon)
                    return out.view(x.shape)
                return self._fltune_native(x)
            if (plain and x.dim() == 2 and residual.dim() == 2
                    and self._fltune_takes("fused_add_rms_norm", x)):
                torch.ops.fltune.fused_add_rms_norm(x, residual, self.weight.data,
                                                    self.variance_epsilon)
                return x, residual
            return self._fltune_native(x, residual)

    class FltuneGemmaRMSNorm(SeamMixin, GemmaRMSNorm):
        _fltune_ops = LAYER_OPS["GemmaRMSNorm"]
        _fltune_layer = "GemmaRMSNorm"

        def _fltune_forward(self, x, residual=None):
            if residual is None:
                x2 = x.reshape(-1, x.shape[-1])
                if self._fltune_takes("gemma_rms_norm", x2):
                    out = torch.ops.fltune.gemma_rms_norm(x2, self.weight.data,
                                                          self.variance_epsilon)
                    return out.view(x.shape)
                return self._fltune_native(x)
            if self._fltune_takes("gemma_fused_add_rms_norm", x.reshape(-1, x.shape[-1])):
                shape = x.shape
                out, res = torch.ops.fltune.gemma_fused_add_rms_norm(
                    x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]),
                    self.weight.data, self.variance_epsilon)
                return out.view(shape), res.view(residual.shape)
            return self._fltune_native(x, residual)

    class FltuneRMSNormGated(SeamMixin, RMSNormGated):
        """Qwen3.5's gated norm in the GDN layers: ``norm(x) * silu(z)`` (or the gate
        first). Calls outside the op's contract (no gate, a bias, a sigmoid gate) stay on
        vLLM's path."""
        _fltune_ops = LAYER_OPS["RMSNormGated"]
        _fltune_layer = "RMSNormGated"

        def _fltune_forward(self, x, z=None):
            if (z is None or getattr(self, "bias", None) is not None
                    or self.activation not in ("silu", "swish") or z.shape != x.shape
                    or not self._fltune_takes("rms_norm_gated", x.reshape(-1, x.shape[-1]))):
                return self._fltune_native(x, z)
            shape = x.shape
            out = torch.ops.fltune.rms_norm_gated(
                x.reshape(-1, shape[-1]), z.reshape(-1, shape[-1]), self.weight.data,
                self.eps, int(self.group_size or 0), bool(self.norm_before_gate))
            return out.view(shape)

    return {"RMSNorm": (FltuneRMSNorm, RMSNorm),
            "GemmaRMSNorm": (FltuneGemmaRMSNorm, GemmaRMSNorm),
            "RMSNormGated": (FltuneRMSNormGated, RMSNormGated)}


def _activation_classes() -> dict:
    """Replacements of vLLM's SiluAndMul and GeluAndMul."""
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul

    class FltuneSiluAndMul(SeamMixin, SiluAndMul):
        _fltune_ops = LAYER_OPS["SiluAndMul"]
        _fltune_layer = "SiluAndMul"

        def _fltune_forward(self, x):
            shape = x.shape
            if not self._fltune_takes("silu_and_mul", x.reshape(-1, shape[-1])):
                return self._fltune_native(x)
            out = torch.ops.fltune.silu_and_mul(x.reshape(-1, shape[-1]))
            return out.view(shape[:-1] + (shape[-1] // 2,))

    class FltuneGeluAndMul(SeamMixin, GeluAndMul):
        _fltune_ops = LAYER_OPS["GeluAndMul"]
        _fltune_layer = "GeluAndMul"

        def _fltune_forward(self, x):
            op = "gelu_and_mul" if self.approximate == "none" else "gelu_tanh_and_mul"
            if not self._fltune_takes(op, x.reshape(-1, x.shape[-1])):
                return self._fltune_native(x)
            shape = x.shape
            out = TORCH_OPS[op](x.reshape(-1, shape[-1]))
            return out.view(shape[:-1] + (shape[-1] // 2,))

    return {"SiluAndMul": (FltuneSiluAndMul, SiluAndMul),
            "GeluAndMul": (FltuneGeluAndMul, GeluAndMul)}


def _rope_classes() -> dict:
    """Replacements of vLLM's RotaryEmbedding and MRotaryEmbedding."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    class FltuneRotaryEmbedding(SeamMixin, RotaryEmbedding):
        _fltune_ops = LAYER_OPS["RotaryEmbedding"]
        _fltune_layer = "RotaryEmbedding"

        def _fltune_forward(self, positions, query, key=None):
            if (positions.dim() != 1 or query.dim() != 2 or key is None or key.dim() != 2
                    or not self._fltune_takes("rotary_embedding", query)):
                return self._fltune_native(positions, query, key)   # outside the contract
            cos_sin_cache = self._match_cos_sin_cache_dtype(query)
            torch.ops.fltune.rotary_embedding(positions, query, key, self.head_size,
                                              cos_sin_cache, self.is_neox_style)
            return query, key

    class FltuneMRotaryEmbedding(SeamMixin, MRotaryEmbedding):
        """Qwen3.5's multimodal rope. Routed only for what the op covers: (3, N) positions,
        NeoX style, a key, no offsets; text-only (N,) positions stay on vLLM's path."""
        _fltune_ops = LAYER_OPS["MRotaryEmbedding"]
        _fltune_layer = "MRotaryEmbedding"

        def _fltune_forward(self, positions, query, key=None, offsets=None):
            if (positions.dim() != 2 or key is None or offsets is not None
                    or not self.mrope_section or not self.is_neox_style
                    or query.dim() != 2 or key.dim() != 2
                    or not self._fltune_takes("mrope", query)):
                return self._fltune_native(positions, query, key, offsets)
            cos_sin_cache = self._match_cos_sin_cache_dtype(query)
            torch.ops.fltune.mrope(positions, query, key, self.head_size, cos_sin_cache,
                                   [int(s) for s in self.mrope_section],
                                   bool(getattr(self, "mrope_interleaved", False)))
            return query, key

    return {"RotaryEmbedding": (FltuneRotaryEmbedding, RotaryEmbedding),
            "MRotaryEmbedding": (FltuneMRotaryEmbedding, MRotaryEmbedding)}


def _build_layer_classes() -> dict:
    """In-tree class name -> (replacement, in-tree class), one builder per layer family
    (each imports only its part of vLLM)."""
    classes = {**_norm_classes(), **_activation_classes(), **_rope_classes()}
    assert set(classes) == set(LAYER_OPS)
    return classes

def layer_classes() -> dict:
    """In-tree class name -> (fltune replacement, in-tree class); built once (imports vLLM)."""
    global _layer_classes
    with _layer_lock:
        if _layer_classes is None:
            _layer_classes = _build_layer_classes()
        return _layer_classes


def oot_conflicts() -> list:
    """In-tree names some other plugin already replaced (we must not override those)."""
    from vllm.model_executor.custom_op import op_registry_oot

    ours = {cls for cls, _ in layer_classes().values()}
    return [f"{name} (-> {op_registry_oot[name].__module__}."
            f"{op_registry_oot[name].__qualname__})"
            for name in layer_classes() if name in op_registry_oot
            and op_registry_oot[name] not in ours]


def needed_layers(routed_ops) -> set:
    """The in-tree class names whose replacement would route at least one of ``routed_ops``.

    Only those are replaced: a replacement is a subclass, and vLLM sometimes tests a layer's
    exact type (Qwen3-Next/Qwen3.5 attention takes its fused q/k-norm + rope + gate kernel
    only when ``type(rotary_emb) is MRotaryEmbedding``), so a replacement that routes
    nothing could still cost a fused kernel."""
    routed_ops = set(routed_ops) - _ir_owned     # the IR route's ops need no layer
    return {name for name, op_names in LAYER_OPS.items() if routed_ops & set(op_names)}


def register_layers(routed_ops=None) -> list:
    """Register the replacements (all, or those :func:`needed_layers` names for
    ``routed_ops``) with ``CustomOp.register_oot`` (idempotent). Returns the in-tree names
    registered by this call. Raises if another plugin holds one of them."""
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    conflicts = oot_conflicts()
    if conflicts:
        raise RuntimeError("another vLLM plugin already replaced " + ", ".join(conflicts)
                           + "; fltune will not override it")
    wanted = set(LAYER_OPS) if routed_ops is None else needed_layers(routed_ops)
    done = []
    for name, (cls, intree) in layer_classes().items():
        if name not in wanted or op_registry_oot.get(name) is cls:
            continue
        CustomOp.register_oot(_decorated_op_cls=cls, name=name)
        # register_oot renamed the class to its registry key; keep the in-tree op name so
        # '+rms_norm' / '-rms_norm' in custom_ops still address these layers
        cls.name = intree.name
        done.append(name)
    return done


def unregister_layers(keep=()) -> None:
    """Withdraw our replacements but those named in ``keep`` (layers built afterwards are
    vLLM's own again)."""
    if _layer_classes is None:
        return
    from vllm.model_executor.custom_op import op_registry_oot

    for name, (cls, _) in _layer_classes.items():
        if name not in keep and op_registry_oot.get(name) is cls:
            del op_registry_oot[name]


def routed_layers(model) -> dict:
    """``{class name: count}`` of the layers in ``model`` that route at least one op."""
    out: dict = collections.Counter()
    for m in model.modules():
        if isinstance(m, SeamMixin) and m.fltune_routes:
            out[m._fltune_layer] += 1
    return dict(out)
