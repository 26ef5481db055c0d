"""fltune's seams in SGLang's layer classes: where a layer's forward is fixed, route it.

SGLang picks one forward per layer instance and keeps it in ``self._forward_method``:

- SGLang <= 0.5.17 (``MultiPlatformOp``, ``sglang/srt/layers/utils/multi_platform.py``):
  ``__init__`` calls ``self.dispatch_forward()`` (``forward_cuda`` on CUDA, ``forward_cpu``
  on AMX CPUs, else ``forward_native``);
- SGLang >= 0.5.20 (``BaseFusedOp``, ``sglang/kernels/fused_op.py``): resolved lazily, on
  the first call, by ``self._resolve_forward_method()`` (``dispatch_forward`` only wraps it);
- both: ``enter_torch_compile`` (called on every instance by SGLang's torch.compile
  patching, ``_to_torch``) swaps ``_forward_method`` for ``forward_native`` so the compiled
  graph traces plain PyTorch, and ``leave_torch_compile`` restores the snapshot.

fltune wraps, per routed class, that resolver and ``enter_torch_compile`` (AROUND hooks in
SGLang's own ``HookRegistry``, registered by the plugin: ``plugin.register``). The resolver's
wrapper keeps SGLang's choice as the *native* path and, when the plan routes one of the
class's ops, returns a forward that calls fltune's band-dispatch custom ops
(``torch.ops.fltune.*``, defined once in ``fltune.integrations.vllm.ops``: the same ops, the
same frozen table and the same counters as the vLLM plugin; that module imports no vLLM)
for the calls the op's contract covers, and the native path for the rest. The
``enter_torch_compile`` wrapper does the same with ``forward_native`` as the native path:
so a routed op **stays routed inside SGLang's compiled graphs** (an opaque custom op with a
fake kernel: Dynamo traces one node and the band lookup runs in its eager body on every
call), and an op the plan leaves out stays out in both paths. Which ops route is decided
once per process (``routes_for``: ``Plan.routes(op, compiled)`` with ``compiled`` =
SGLang's ``--enable-torch-compile``), so eager prefill and compiled decode agree.

A class is routed only for instances whose class does not change the semantics: the
in-tree class itself, or a subclass that defines no ``forward*`` method of its own (YaRN,
Llama-3 and linear-scaling ropes only recompute the cache: routed; ``MRotaryEmbedding``
overrides the forwards: left alone). An instance SGLang pinned itself (``force_native``,
aiter, deterministic RL) sets ``_forward_method`` in its ``__init__`` and never asks the
resolver: respected.

Calls outside an op's contract (a quant-fused norm, a variance-size override, an fp32
residual, a cast before the weight, rope offsets or the fused KV-cache write, an empty
batch) go to the native path, always.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Optional

import torch

log = logging.getLogger("sglang.fltune")

#: SGLang class -> (module, the fltune ops its forward can route)
LAYERS = {
    "RMSNorm": ("sglang.srt.layers.layernorm", ("rms_norm", "fused_add_rms_norm")),
    "GemmaRMSNorm": ("sglang.srt.layers.layernorm",
                     ("gemma_rms_norm", "gemma_fused_add_rms_norm")),
    "SiluAndMul": ("sglang.srt.layers.activation", ("silu_and_mul",)),
    "GeluAndMul": ("sglang.srt.layers.activation", ("gelu_and_mul", "gelu_tanh_and_mul")),
    "RotaryEmbedding": ("sglang.srt.layers.rotary_embedding", ("rotary_embedding",)),
}

#: the ops some SGLang seam of this integration calls (the rest of a manifest: unseamed)
SEAMED_OPS = frozenset(op for _, ops in LAYERS.values() for op in ops)


def _ops():
    """fltune's custom ops and call counters (importing this registers ``torch.ops.fltune``)."""
    from ..vllm import ops
    return ops


# ---- the routing state of this process --------------------------------------------------

_state_lock = threading.Lock()
_plan = None            # fltune.integrations.vllm.plugin.Plan (engine-neutral), or None
_compiled = False       # SGLang compiles the model (--enable-torch-compile)


def set_plan(plan, compiled: Optional[bool] = None) -> None:
    """Install ``plan`` (None: every layer built afterwards is SGLang's own). The same plan
    is handed to the custom ops' module, which refreezes it in a forked child."""
    global _plan, _compiled
    with _state_lock:
        _plan = plan
        if compiled is not None:
            _compiled = bool(compiled)
    ops = _ops()
    if plan is None:
        ops.clear_plan()
    else:
        ops.set_plan(plan)


def current_plan():
    return _plan


def compiled() -> bool:
    return _compiled


def routes_for(layer) -> frozenset:
    """The ops this layer instance routes under the current plan (empty: SGLang's path)."""
    plan = _plan
    if plan is None:
        return frozenset()
    name = _seam_class(type(layer))
    if name is None:
        return frozenset()
    ops = LAYERS[name][1]
    if name == "GeluAndMul" and hasattr(layer, "approximate"):
        ops = (_gelu_op(layer),)     # (SGLang <= 0.5.17 resolves before __init__ sets it;
                                     # the bridge checks again per call)
    return frozenset(op for op in ops if op in plan.routed and plan.routes(op, _compiled))


_seam_cache: dict = {}


def _seam_class(cls) -> Optional[str]:
    """The in-tree class name ``cls`` is (or inherits unchanged), or None."""
    hit = _seam_cache.get(cls, "?")
    if hit != "?":
        return hit
    found = None
    for klass in cls.__mro__:
        if klass.__name__ in LAYERS and klass.__module__.startswith(LAYERS[klass.__name__][0]):
            found = klass.__name__
            break
        if any(k.startswith("forward") for k in vars(klass)):
            break        # a subclass with forwards of its own: other semantics
    _seam_cache[cls] = found
    return found


# ---- the bridges: SGLang's call convention -> fltune's op contract -----------------------

def _rms_norm(layer, native, routes, x, residual=None, post_residual_addition=None,
              quant_linear=None, **kwargs):
    plain = (not kwargs and quant_linear is None and x.numel() > 0
             and getattr(layer, "has_weight", True)
             and getattr(layer, "variance_size_override", None) is None
             and not getattr(layer, "cast_x_before_out_mul", False)
             and not getattr(layer, "fp32_residual", False)
             and getattr(layer, "override_orig_dtype", None) is None
             and layer.weight.dtype == x.dtype)
    if residual is None:
        if plain and "rms_norm" in routes and post_residual_addition is None:
            out = torch.ops.fltune.rms_norm(x.reshape(-1, x.shape[-1]), layer.weight.data,
                                            layer.variance_epsilon)
            return out.view(x.shape)
    elif plain and "fused_add_rms_norm" in routes and x.dim() == 2 and residual.dim() == 2:
        if post_residual_addition is not None:
            residual = residual + post_residual_addition     # as SGLang's CUDA path does
        torch.ops.fltune.fused_add_rms_norm(x, residual, layer.weight.data,
                                            layer.variance_epsilon)
        return x, residual
    return native(x, residual, post_residual_addition, quant_linear, **kwargs)


def _gemma_rms_norm(layer, native, routes, x, residual=None, post_residual_addition=None,
                    **kwargs):
    plain = not kwargs and x.numel() > 0
    if residual is None:
        if plain and "gemma_rms_norm" in routes and post_residual_addition is None:
            out = torch.ops.fltune.gemma_rms_norm(x.reshape(-1, x.shape[-1]),
                                                  layer.weight.data, layer.variance_epsilon)
            return out.view(x.shape)
    elif plain and "gemma_fused_add_rms_norm" in routes and residual.shape == x.shape:
        if post_residual_addition is not None:
            residual = residual + post_residual_addition
        shape = x.shape
        out, res = torch.ops.fltune.gemma_fused_add_rms_norm(
            x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), layer.weight.data,
            layer.variance_epsilon)
        return out.view(shape), res.view(residual.shape)
    return native(x, residual, post_residual_addition, **kwargs)


def _gated(op_name):
    def bridge(layer, native, routes, x, *args, **kwargs):
        if args or kwargs or x.numel() == 0 or op_name(layer) not in routes:
            return native(x, *args, **kwargs)
        shape = x.shape
        out = getattr(torch.ops.fltune, op_name(layer))(x.reshape(-1, shape[-1]))
        return out.view(shape[:-1] + (shape[-1] // 2,))
    return bridge


def _gelu_op(layer):
    a = getattr(layer, "approximate", "tanh")
    return "gelu_and_mul" if a == "none" else "gelu_tanh_and_mul" if a == "tanh" else None


def _rotary(layer, native, routes, positions, query, key, offsets=None,
            fused_set_kv_buffer_arg=None, **kwargs):
    if (kwargs or offsets is not None or fused_set_kv_buffer_arg is not None
            or "rotary_embedding" not in routes or key is None or positions.dim() != 1
            or query.dim() != 2 or key.dim() != 2 or query.numel() == 0
            or hasattr(layer, "sin_cos_cache")):
        return native(positions, query, key, offsets, fused_set_kv_buffer_arg, **kwargs)
    cache = layer.cos_sin_cache
    if cache.dtype != query.dtype or cache.device != query.device:
        # what SGLang's own fallback kernel path does (the op's contract, as calibrated:
        # the cache in the model's dtype); after load_model the plugin has done it already
        match_cos_sin_cache(layer, query.dtype, query.device)
        cache = layer.cos_sin_cache
    torch.ops.fltune.rotary_embedding(positions, query, key, layer.head_size, cache,
                                      layer.is_neox_style)
    return query, key


def match_cos_sin_cache(layer, dtype, device=None) -> None:
    """The rope cache in ``dtype`` (SGLang keeps it in fp32 on CUDA; its own vLLM-kernel
    fallback converts it the same way)."""
    cache = layer.cos_sin_cache
    if cache.dtype != dtype or (device is not None and cache.device != device):
        layer.cos_sin_cache = cache.to(device or cache.device, dtype=dtype)


BRIDGES: dict = {
    "RMSNorm": _rms_norm,
    "GemmaRMSNorm": _gemma_rms_norm,
    "SiluAndMul": _gated(lambda layer: "silu_and_mul"),
    "GeluAndMul": _gated(_gelu_op),
    "RotaryEmbedding": _rotary,
}
assert set(BRIDGES) == set(LAYERS)


def make_forward(layer, native: Callable, routes: frozenset) -> Callable:
    """The forward SGLang keeps in ``layer._forward_method`` for a routed layer."""
    bridge = BRIDGES[_seam_class(type(layer))]

    def forward_fltune(*args, **kwargs):
        return bridge(layer, native, routes, *args, **kwargs)

    forward_fltune.fltune_routes = routes
    forward_fltune.fltune_native = native
    return forward_fltune


# ---- the AROUND hooks (registered in SGLang's HookRegistry by the plugin) ----------------

def around_resolve(original, layer, *args, **kwargs):
    """Around SGLang's forward resolver (``_resolve_forward_method`` / ``dispatch_forward``)."""
    native = original(layer, *args, **kwargs)
    routes = routes_for(layer)
    if not routes:
        return native
    return make_forward(layer, native, routes)


def around_enter_torch_compile(original, layer, *args, **kwargs):
    """Around ``enter_torch_compile``: a routed layer keeps its custom op in the graph, with
    ``forward_native`` (what SGLang compiles) for the calls outside the op's contract."""
    entered = getattr(layer, "is_torch_compile", False)
    out = original(layer, *args, **kwargs)
    if entered:
        return out
    routes = routes_for(layer)
    if routes and layer._forward_method == layer.forward_native:
        layer._forward_method = make_forward(layer, layer.forward_native, routes)
    return out


def resolver_name(cls) -> str:
    """Which method fixes the forward in the installed SGLang (see the module docstring)."""
    for klass in cls.__mro__:
        if "_resolve_forward_method" in vars(klass):
            return "_resolve_forward_method"
    return "dispatch_forward"


def hook_targets() -> list:
    """``[(dotted target, hook)]`` for every seam class of the installed SGLang."""
    import importlib

    out = []
    for name, (modname, _) in LAYERS.items():
        cls = getattr(importlib.import_module(modname), name)
        base = f"{cls.__module__}.{cls.__qualname__}"
        out.append((f"{base}.{resolver_name(cls)}", around_resolve))
        out.append((f"{base}.enter_torch_compile", around_enter_torch_compile))
    return out


def layer_classes() -> dict:
    import importlib

    return {name: getattr(importlib.import_module(mod), name)
            for name, (mod, _) in LAYERS.items()}


def routed_layers(model) -> dict:
    """``{class name: count}`` of the layers in ``model`` that route at least one op."""
    out: dict = collections.Counter()
    for m in model.modules():
        if _routes_of(m):
            out[_seam_class(type(m))] += 1
    return dict(out)


def _routes_of(m) -> frozenset:
    """What ``m`` routes: its fixed forward's routes, or (not resolved yet, SGLang >= 0.5.20
    resolves on the first call) what the resolver will give it. An instance SGLang pinned
    in its ``__init__`` routes nothing."""
    if _seam_class(type(m)) is None:
        return frozenset()
    fm = getattr(m, "_forward_method", None)
    if fm is None:
        return routes_for(m)
    return getattr(fm, "fltune_routes", frozenset())


def built_routes(model) -> set:
    """The ops some layer of ``model`` routes."""
    return {op for m in model.modules() for op in _routes_of(m)}
