"""``native.vllm``: vLLM's own native path for an op, compiled the way vLLM compiles a model.

Why this candidate exists. An op fltune leaves alone runs, inside vLLM, as the layer's
``forward_native`` traced into the model graph and lowered by Inductor. The question the
race must answer for a routed kernel is "faster than *that*?", so the candidate standing
for vLLM has to be that code compiled under the same rules — not the op's reference
compiled on its own with every dimension symbolic (``inductor.standalone``), which the
H200 measured several times slower than the in-model code for ``silu_and_mul``.

What is compiled (``SOURCES`` says it per op; ``fltune candidates`` shows ``source``):

- the installed vLLM's own ``forward_native`` (or the ``forward_static`` it calls) of the
  layer class vLLM builds for the op: ``RMSNorm``, ``GemmaRMSNorm``, ``RMSNormGated``,
  ``SiluAndMul``, ``GeluAndMul``, ``RotaryEmbedding``, ``MRotaryEmbedding``. Methods that
  read ``self`` get a small stand-in object carrying exactly the attributes they read
  (weight, eps, head size, ...): building real layers needs a vLLM config context and
  would make the call's weight a module parameter.
- The norms' ``forward_native`` calls ``vllm.ir`` ops (``ir.ops.rms_norm``, ...). Inside
  vLLM's compiled model those nodes are replaced by the implementation the IR priority
  picks, which is ``native`` when vLLM compiles with Inductor (the CUDA platform's default,
  and the CPU platform's). We trace with the IR's torch wrapping off and the priority set
  to ``native``, so the native implementation is inlined into the graph — the same code
  vLLM's lowering pass inserts.
- If the installed vLLM lacks the class or method, the op's fltune reference is compiled
  instead (it mirrors ``forward_native``) and ``source`` says so.

How it is compiled (vLLM 0.24's ``compilation/wrapper.py`` and ``decorators.py``):
``torch.compile(fullgraph=True, dynamic=False)`` with vLLM's ``inductor_compile_config``
(read from the installed ``CompilationConfig()``: ``enable_auto_functionalized_v2=False``;
on CUDA also ``combo_kernels``/``benchmark_combo_kernel``; none on CPU, as vLLM has none
there), ``assume_32bit_indexing`` from its ``dynamic_shapes_config``, only the token
dimension marked dynamic (hidden sizes, weights and the cos/sin cache stay static), and
every guard skipped (``torch.compiler.skip_all_guards_unsafe``), so one graph serves every
token count. vLLM traces and first runs its graph at ``max_num_batched_tokens`` (the
profile run), and that first run is where Inductor picks each generated kernel's launch
configuration (it benchmarks a few, ``triton.autotune_pointwise``, at the sizes it is
called with): the same graph run at one token keeps a configuration chosen for 8192.
So the first trace here is at :func:`trace_tokens` (8192 on CUDA: ``vllm serve``'s default on
the H200 and the instrument's engine), times the rows per token of the norms that run
several rows per token (read from :func:`fltune.ops.workload_dims`, set by the race), on a
copy built with the call's layout; the call itself then runs that graph. Until session 16
the first trace was at the call's own token count (16 for a 1-token call), and the H200 then
measured the candidate's gated-norm kernel 2.8–3.0x and its silu_and_mul kernel 1.08–1.19x
the model's at 2048–8192 tokens (2026-11-30); traced at 8192, session 16's run of
``benchmarks/native_in_model.py`` read 0.81–0.95x and 0.88–1.02x (README, "native.vllm
against the model").

One neighbour's effect is reproduced because it changes the op's own code: where the
workload says a rope follows a per-head q/k norm (Qwen3: the context dim ``after_qk_norm``),
its ``torch.cat`` lowers as in the model, a ``ConcatKernel`` (:data:`CONCAT_AFTER`; on
torch < 2.12, where Inductor makes that choice in the model); without it the candidate's
rope read 1.4x the model's at prefill on the H200.

What is *not* reproduced: the neighbours vLLM fuses the op with in a model (the gate_up
GEMM's output slice, residual adds and casts around the norms, the q/k split around
rope; in Qwen3.5 the gated norm's gate arrives as a view with a row stride of 8192 and its
output is copied into out_proj's layout by a kernel of its own), the context a kernel runs
in inside a model step (at 1–64 tokens every attributable in-model kernel is a fixed
0.2–1.0 µs slower than this candidate's; a cold weight explains 0.05–0.12 µs of it, session
17's ``params_cold``; ``native_in_model.py``'s ``in_context`` times the candidate right after
the GEMM that writes its input), and the CUDA-graph capture sizes' static graphs (vLLM compiles none by default:
``compile_sizes`` is empty, the CUDA graphs capture the one dynamic graph; fltune's CUDA
timer captures this candidate in a CUDA graph the same way). The in-place ops
(``fused_add_rms_norm``, the ropes) return new tensors in vLLM's native path; the op
contract writes them back into the inputs, which the compiled graph does as its last step.
For the norms that write-back fuses into the one kernel (as the model's ``copy_`` into the
next subgraph's input does); for the ropes it cannot (each output element reads two
inputs), so their graph is the rope plus a copy kernel the model never runs — on the H200
1.3-3.1x the model's rope time (session 18). The race therefore times the ropes out of
place (``OpImpl.timed``, :data:`OUT_OF_PLACE_TIMED`: the graph without the write-back, as
the model passes the rotated q/k to attention), after checking that path's values too;
``fn`` keeps the contract for parity and dispatch.

Guards are skipped, so a compiled graph is only ever called with what it was traced
for: graphs are cached per (op, every non-tensor argument, every tensor's dtype, device,
non-token sizes and layout, the workload's rows per token, which sets the trace size),
and each gets its own code object (Dynamo keys its cache by
code object; two closures over one function would otherwise share the first graph).

Kind REFERENCE, priority 42: PyTorch code, ranked below FL's reference (50) and the fused
torch ops (45), above the standalone compile (40), so FL's fixed order is unchanged
(``dispatch/types.py``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import types
from typing import Callable, Optional

import torch

from ..dispatch.types import BackendImplKind, OpImpl
from ..ops import OPS, current_workload_dims
from ..util import ENGINE_MAX_BATCHED_TOKENS, int_at_least
from .inductor import _qualify

PRIORITY = 42
IMPL_ID = "native.vllm"
#: the token count a graph is first traced and run at, per device type: vLLM's
#: ``max_num_batched_tokens`` where fltune measures (``util.ENGINE_MAX_BATCHED_TOKENS``).
#: ``FLTUNE_NATIVE_TRACE_TOKENS`` overrides it, for a user who serves with another value.
TRACE_TOKENS = ENGINE_MAX_BATCHED_TOKENS


def trace_tokens(device_type: str) -> int:
    """The token count a graph is traced and first run at on this device."""
    env = os.environ.get("FLTUNE_NATIVE_TRACE_TOKENS", "").strip()
    if env:
        n = int_at_least(env, 2)
        if n is None:
            raise ValueError(f"FLTUNE_NATIVE_TRACE_TOKENS={env!r}: give vLLM's "
                             f"max_num_batched_tokens, an integer >= 2")
        return n
    return TRACE_TOKENS.get(device_type, TRACE_TOKENS["cuda"])

#: op -> the vLLM layer class whose native path it is (every op with a vLLM seam:
#: ``integrations/vllm/ops.py``'s ``LAYER_OPS``, checked by the tests)
LAYER_OF = {
    "rms_norm": "RMSNorm", "fused_add_rms_norm": "RMSNorm",
    "gemma_rms_norm": "GemmaRMSNorm", "gemma_fused_add_rms_norm": "GemmaRMSNorm",
    "rms_norm_gated": "RMSNormGated",
    "silu_and_mul": "SiluAndMul", "gelu_and_mul": "GeluAndMul",
    "gelu_tanh_and_mul": "GeluAndMul",
    "rotary_embedding": "RotaryEmbedding", "mrope": "MRotaryEmbedding",
}

#: which argument dimension counts tokens, per tensor argument index; the rest are static
_TOKEN_DIMS = {
    "rms_norm": {0: 0}, "gemma_rms_norm": {0: 0},
    "fused_add_rms_norm": {0: 0, 1: 0}, "gemma_fused_add_rms_norm": {0: 0, 1: 0},
    "rms_norm_gated": {0: 0, 1: 0},
    "silu_and_mul": {0: 0}, "gelu_and_mul": {0: 0}, "gelu_tanh_and_mul": {0: 0},
    "rotary_embedding": {0: 0, 1: 0, 2: 0}, "mrope": {0: 1, 1: 0, 2: 0},
}


# ---- vLLM's native functions, bound to the op contract -------------------------------

log = logging.getLogger("fltune.native_vllm")


def _vllm():
    """The vLLM classes used, or raise ImportError (then the reference is compiled)."""
    from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm, RMSNormGated
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.rotary_embedding.common import ApplyRotaryEmb
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
    return types.SimpleNamespace(**{c.__name__: c for c in (
        RMSNorm, GemmaRMSNorm, RMSNormGated, SiluAndMul, GeluAndMul, RotaryEmbedding,
        ApplyRotaryEmb, MRotaryEmbedding)})


def _stand_in(cls, take=("forward_native",)):
    """A plain class whose instances carry the attributes ``cls.forward_native`` reads,
    with ``cls``'s own methods (``take``) bound to them: vLLM's code on the call's tensors."""
    def init(self, **attrs):
        # setattr, not ``__dict__.update``: Dynamo traces this constructor inside the
        # compiled graph, and torch 2.11's Dynamo cannot trace ``__dict__.update``
        # (seen on the H200: "Unsupported method call ... update")
        for k, val in attrs.items():
            setattr(self, k, val)
    return type(f"_{cls.__name__}StandIn", (),
                {**{k: cls.__dict__[k] for k in take}, "__init__": init})


def _native_fns(v) -> dict:
    """op -> (fn(tensors..., scalars...) with the op's argument order and vLLM's return,
    the source description). Scalars arrive as Python constants (closed over per graph)."""
    RMS, GEMMA, GELU, MROPE = (_stand_in(c) for c in (v.RMSNorm, v.GemmaRMSNorm,
                                                     v.GeluAndMul, v.MRotaryEmbedding))
    AROT = _stand_in(v.ApplyRotaryEmb, take=("forward_native", "_pre_process",
                                             "_post_process", "forward_static"))

    def rms(**kw):
        return RMS(pass_weight=True, pass_weight_add=True, variance_size_override=None,
                   **kw)

    def rms_norm(x, weight, eps):
        return rms(weight=weight, variance_epsilon=eps).forward_native(x)

    def fused_add_rms_norm(x, residual, weight, eps):
        return rms(weight=weight, variance_epsilon=eps).forward_native(x, residual)

    def gemma_rms_norm(x, weight, eps):
        return GEMMA(weight=weight, variance_epsilon=eps).forward_native(x)

    def gemma_fused_add_rms_norm(x, residual, weight, eps):
        return GEMMA(weight=weight, variance_epsilon=eps).forward_native(x, residual)

    def rms_norm_gated(x, z, weight, eps, group_size, norm_before_gate):
        # RMSNormGated.forward_native is this one call with the layer's attributes
        return v.RMSNormGated.forward_static(x, z, weight, eps, x.dtype,
                                             group_size=group_size or None,
                                             norm_before_gate=norm_before_gate,
                                             activation="silu")

    def silu_and_mul(x):
        return v.SiluAndMul.forward_native(x)

    def gelu_and_mul(x):
        return GELU(approximate="none").forward_native(x)

    def gelu_tanh_and_mul(x):
        return GELU(approximate="tanh").forward_native(x)

    def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox):
        # RotaryEmbedding.forward_native is forward_static with the layer's attributes
        return v.RotaryEmbedding.forward_static(positions, query, key, head_size,
                                                cos_sin_cache.shape[-1], cos_sin_cache,
                                                is_neox)

    def mrope(positions, query, key, head_size, cos_sin_cache, mrope_section, interleaved):
        layer = MROPE(cos_sin_cache=cos_sin_cache, head_size=head_size,
                      rotary_dim=cos_sin_cache.shape[-1], is_neox_style=True,
                      mrope_section=list(mrope_section), mrope_interleaved=interleaved,
                      _match_cos_sin_cache_dtype=lambda q: cos_sin_cache,
                      apply_rotary_emb=AROT(is_neox_style=True, enable_fp32_compute=False))
        return layer.forward_native(positions, query, key)

    fns = dict(rms_norm=rms_norm, fused_add_rms_norm=fused_add_rms_norm,
               gemma_rms_norm=gemma_rms_norm,
               gemma_fused_add_rms_norm=gemma_fused_add_rms_norm,
               rms_norm_gated=rms_norm_gated, silu_and_mul=silu_and_mul,
               gelu_and_mul=gelu_and_mul, gelu_tanh_and_mul=gelu_tanh_and_mul,
               rotary_embedding=rotary_embedding, mrope=mrope)
    where = {"rms_norm": "RMSNorm.forward_native (vllm.ir rms_norm, native impl)",
             "fused_add_rms_norm": "RMSNorm.forward_native (vllm.ir fused_add_rms_norm, "
                                   "native impl)",
             "gemma_rms_norm": "GemmaRMSNorm.forward_native (vllm.ir rms_norm, native)",
             "gemma_fused_add_rms_norm": "GemmaRMSNorm.forward_native (vllm.ir "
                                         "fused_add_rms_norm, native impl)",
             "rms_norm_gated": "RMSNormGated.forward_static",
             "silu_and_mul": "SiluAndMul.forward_native",
             "gelu_and_mul": "GeluAndMul.forward_native",
             "gelu_tanh_and_mul": "GeluAndMul.forward_native",
             "rotary_embedding": "RotaryEmbedding.forward_static",
             "mrope": "MRotaryEmbedding.forward_native"}
    return {op: (fn, f"vllm {where[op]}") for op, fn in fns.items()}


@functools.lru_cache(maxsize=None)
def sources() -> dict:
    """op -> (the function compiled, where it comes from): vLLM's when importable."""
    try:
        return _native_fns(_vllm())
    except Exception as e:   # no vLLM, or one without these classes: the reference
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}" if str(e) else type(e).__name__
        return {op: (OPS[op].functional or OPS[op].reference,
                     f"fltune reference (mirrors forward_native; vLLM unusable: {why})")
                for op in LAYER_OF}


def source(op_name: str) -> str:
    if op_name in FELL_BACK:
        return (f"fltune reference (mirrors forward_native; vLLM's function did not trace: "
                f"{FELL_BACK[op_name]})")
    return sources()[op_name][1]


# ---- vLLM's compile settings ------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def compile_settings(device_type: str) -> tuple[dict, dict]:
    """(torch.compile options, Inductor config patches) as vLLM sets them on this device.

    Options: the installed vLLM's ``CompilationConfig().inductor_compile_config`` (which
    its ``__post_init__`` fills per platform) when importable, else vLLM 0.24's defaults;
    combo kernels dropped on CPU either way (vLLM: "combo kernel does not support cpu").
    Patches: ``assume_32bit_indexing`` from ``dynamic_shapes_config`` (torch >= 2.10)."""
    assume_32 = False
    try:
        from vllm.config import CompilationConfig

        cc = CompilationConfig()
        opts = {k: v for k, v in dict(cc.inductor_compile_config).items()
                if isinstance(v, (bool, int, float, str))}
        assume_32 = bool(getattr(cc.dynamic_shapes_config, "assume_32_bit_indexing", False))
    except Exception:
        opts = {"enable_auto_functionalized_v2": False}
        if device_type != "cpu":
            opts.update(combo_kernels=True, benchmark_combo_kernel=True)
        if torch.__version__ < "2.12":
            opts.update(size_asserts=False, alignment_asserts=False, scalar_asserts=False)
    if device_type == "cpu":
        opts.pop("combo_kernels", None)
        opts.pop("benchmark_combo_kernel", None)
    patches = ({"assume_32bit_indexing": assume_32}
               if hasattr(torch._inductor.config, "assume_32bit_indexing") else {})
    return opts, patches


def _skip_guards():
    return getattr(torch.compiler, "skip_all_guards_unsafe", None) or \
        (lambda entries: [False for _ in entries])


# ---- the rope's cat, lowered as the model's neighbours make Inductor lower it ----------------

#: op -> the context dim (``OpSpec.context_dims``) under which vLLM's compiled model lowers
#: the op's ``torch.cat`` as a ``ConcatKernel``: the rope right after a per-head q/k norm.
#: Inductor's ``lowering.cat`` (torch 2.11) builds a pointwise cat (every output element
#: evaluates each input under masks) unless an input reaches back to a reduction it would
#: have to recompute (from torch 2.12 not when the inputs only recombine the reduction's
#: output: :func:`model_lowers_cat_after_reduction_as_concat`). In Qwen3's attention the
#: q/k norm's reduction is upstream of the rope, so the model's rope kernel computes one
#: rotated pair per thread and stores both halves
#: (``x0 = xindex % 64`` at head size 128, a ``ConcatKernel``); the rope compiled alone has
#: no reduction upstream and gets the pointwise cat, twice the threads (``% 128``). On the
#: H200 that alone made the candidate 1.43x / 1.44x the model's rope kernel at 2048 / 8192
#: tokens; compiled with this lowering, 1.03x / 0.92x (session 23, ``benchmarks/
#: native_in_model.py``'s "ConcatKernel lowering" column). Every ``cat`` of the
#: ``rotary_embedding`` graph is on the q/k path (the rotation's halves, and the
#: pass-through part of a partial ``rotary_dim``), so lowering every cat of that graph this
#: way is the model's choice. Not ``mrope``: its graph also cats cos/sin sections, which
#: reach no reduction in the model (and Qwen3.5 fuses its q/k norm and mrope into one
#: kernel the profiler cannot attribute, so there is no in-model time to check it against).
CONCAT_AFTER = {"rotary_embedding": "after_qk_norm"}


def model_lowers_cat_after_reduction_as_concat() -> bool:
    """Whether this torch's Inductor lowers a cat whose inputs reach back to a reduction as
    a ``ConcatKernel`` in every case, as torch 2.11 does (the H200's stack, where session 23
    read it in vLLM's generated code). torch 2.12 added ``lowering.
    _cat_inputs_recombine_reduction`` (pytorch PR 179091, "qknorm → RoPE → cat"): a
    reduction whose output the cat's inputs only recombine no longer forces the
    ``ConcatKernel``, so there the model's rope gets the pointwise cat the rope compiled
    alone gets, and :data:`CONCAT_AFTER` must not swap it. Read from the installed torch,
    not its version number, so a backport reads right too."""
    from torch._inductor import lowering

    return not hasattr(lowering, "_cat_inputs_recombine_reduction")


@contextlib.contextmanager
def concat_kernel_lowering():
    """Inside: Inductor lowers every ``cat`` it would make a pointwise cat as a
    ``ConcatKernel`` (each input computed into its slice of the output), with the FX graph
    and AOTAutograd caches off, so that no earlier compile of the same graph (the swap is
    not part of their keys) is reused.

    Why a swap and not a setting: the settings that choose the lowering
    (``max_pointwise_cat_inputs`` with ``max_complex_pointwise_cat_inputs``) reach a
    two-input cat only from torch 2.12 on; before, the threshold is a constant 8 inside
    ``lowering.cat`` (session 22's H200 run on torch 2.11 set the first setting and got the
    pointwise cat again). ``lowering.cat`` calls the module's ``pointwise_cat`` by name on
    every torch since 2.1, so swapping that function is the one switch every version
    honours. On CPU Inductor never builds a pointwise cat (unless ``force_pointwise_cat``,
    as the tests set), so the swap changes nothing there.

    The swap is module-wide while inside: any Inductor compile another thread runs then is
    lowered the same way (``compiled_graph``'s lock serialises only ``native.vllm``'s
    builds, and the race compiles its candidates one at a time), and a compile Inductor
    runs in a subprocess (``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess``) does not see it."""
    from torch._inductor import ir, lowering

    original = lowering.pointwise_cat

    def as_concat_kernel(inputs, dim=0):
        return ir.TensorBox(ir.ConcatKernel.create(inputs, dim))
    caches = ({"enable_autograd_cache": False}
              if hasattr(torch._functorch.config, "enable_autograd_cache") else {})
    # every compile cache (local and remote FX graph, AOTAutograd) where torch has the one
    # switch for them all
    every = ({"force_disable_caches": True}
             if hasattr(torch.compiler.config, "force_disable_caches") else {})
    lowering.pointwise_cat = as_concat_kernel
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(**caches), torch.compiler.config.patch(**every):
            yield
    finally:
        lowering.pointwise_cat = original


# ---- one compiled graph per static signature ----------------------------------------------

_graphs: dict = {}
_lock = threading.Lock()
#: how many graphs were compiled (tests: a T=1 call after a T=16 compile adds none)
COMPILES = [0]


def _layout(t: torch.Tensor, token_dim: Optional[int]):
    """What a graph compiled for ``t`` assumed, token count left out: dtype, device,
    the other sizes, and the strides (packed, or the strides of the dims whose stride
    does not scale with the token count)."""
    sizes = tuple(None if d == token_dim else s for d, s in enumerate(t.shape))
    if t.is_contiguous():
        strides = "packed"
    else:
        strides = tuple(s for d, s in enumerate(t.stride())
                        if token_dim is None or d >= token_dim)
        strides = (strides, tuple(t.stride()[:token_dim]) if token_dim else ())
        # strides left of the token dim scale with it in a packed buffer; a view's are fixed
    return (t.dtype, t.device.type, t.device.index, sizes, strides)


def _key(op_name, args):
    dims = _TOKEN_DIMS[op_name]
    return (op_name,) + tuple(
        _layout(a, dims.get(i)) if isinstance(a, torch.Tensor) else ("const", repr(a))
        for i, a in enumerate(args))


def _with_tokens(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """A tensor like ``t`` with ``n`` along ``dim``, in the same layout (packed stays
    packed; a view keeps its strides), filled with valid data for the op."""
    shape = list(t.shape)
    shape[dim] = n
    if t.is_contiguous():
        out = torch.empty(shape, dtype=t.dtype, device=t.device)
    else:
        span = 1 + sum((s - 1) * st for s, st in zip(shape, t.stride()))
        base = torch.empty(span, dtype=t.dtype, device=t.device)
        out = base.as_strided(shape, t.stride())
    if t.is_floating_point():
        out.copy_(torch.randn(shape, dtype=torch.float32, device=t.device))
    else:   # positions: zeros index the cache's first row
        out.zero_()
    return out


def _unique(fn: Callable, name: str) -> Callable:
    """A copy of ``fn`` with its own code object, hence its own Dynamo cache."""
    code = fn.__code__.replace(co_name=name)
    g = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    g.__kwdefaults__ = fn.__kwdefaults__
    return g


def _ir_native():
    """Trace-time context: vLLM IR ops inline their native implementation (what vLLM's
    lowering pass inserts when the priority is ``native``), not an opaque custom op."""
    import contextlib

    stack = contextlib.ExitStack()
    try:
        from vllm import ir
        from vllm.ir.op import IrOp

        stack.enter_context(ir.enable_torch_wrap(False))
        for op in IrOp.registry.values():
            stack.enter_context(op.set_priority(["native"]))
    except Exception:
        pass
    return stack


#: op -> why vLLM's own function could not be traced on this torch, and the reference
#: (which mirrors it) was compiled instead; shown by :func:`source`
FELL_BACK: dict = {}


def _build(op_name: str, args: tuple, rows_per_token: int, use_reference: bool = False,
           write_back: bool = True, concat_kernel: bool = False):
    spec = OPS[op_name]
    base, _ = sources()[op_name]
    fallback = spec.functional or spec.reference
    if use_reference or op_name in FELL_BACK:
        base = fallback
    tensor_idx = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    consts = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}
    n_args = len(args)
    # without the write-back (the timed graph of an out-of-place op: OUT_OF_PLACE_TIMED) the
    # graph returns vLLM's results, as the model's graph passes them on
    mutates = spec.mutates if write_back else ()
    device_type = args[tensor_idx[0]].device.type
    in_graph = write_back_in_graph(device_type)

    def graph_fn(*tensors):
        full = [None] * n_args
        for i, t in zip(tensor_idx, tensors):
            full[i] = t
        for i, c in consts.items():
            full[i] = c
        ret = base(*full)
        if mutates and in_graph:   # the contract is in place: write vLLM's results back
            for i, r in zip(mutates, ret):
                full[i].copy_(r)
            return None
        return ret

    n = COMPILES[0]
    fn = _unique(graph_fn, f"native_vllm_{op_name}_{n}")
    opts, patches = compile_settings(device_type)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend="inductor",
                             options={**opts, "guard_filter_fn": _skip_guards()})

    # first call: traced and run at vLLM's max_num_batched_tokens (in rows for the norms
    # that run several per token), only the token dims dynamic
    n_trace = trace_tokens(device_type) * rows_per_token
    dims = _TOKEN_DIMS[op_name]
    t_dim = dims[spec.key_arg] if spec.key_arg in dims else 0
    n_tok = args[spec.key_arg].shape[t_dim]
    if n_tok == n_trace:
        warm = None
    else:
        warm = [(_with_tokens(a, dims[i], n_trace) if i in dims else a.clone())
                if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    trace_args = warm if warm is not None else list(args)
    tensors = [trace_args[i] for i in tensor_idx]
    for i, t in zip(tensor_idx, tensors):
        if i in dims:
            torch._dynamo.mark_dynamic(t, dims[i])
    dyn_patch = ({"enable_cpp_symbolic_shape_guards": False}
                 if hasattr(torch._dynamo.config, "enable_cpp_symbolic_shape_guards") else {})
    try:
        lowering = concat_kernel_lowering() if concat_kernel else contextlib.nullcontext()
        with _ir_native(), torch._dynamo.config.patch(**dyn_patch), \
                torch._inductor.config.patch(**patches), lowering:
            first = compiled(*tensors)
    except torch._dynamo.exc.Unsupported as e:
        if base is fallback:
            raise
        # this torch's Dynamo cannot trace vLLM's code for the op (a stand-in's
        # constructor, say): compile the reference, which mirrors forward_native, and say so
        FELL_BACK[op_name] = str(e).splitlines()[0][:160]
        log.warning("fltune native.vllm: %s: vLLM's function does not trace here (%s); "
                    "compiling fltune's reference instead", op_name, FELL_BACK[op_name])
        return _build(op_name, args, rows_per_token, use_reference=True,
                      write_back=write_back, concat_kernel=concat_kernel)
    COMPILES[0] += 1
    graph = _Graph(compiled, tensor_idx, mutates if mutates and not in_graph else (), n_trace)
    if warm is not None:
        return graph, _NOT_RUN
    if graph.write_back:
        graph.write(args, first)
    return graph, first


_NOT_RUN = object()


def write_back_in_graph(device_type: str) -> bool:
    """Whether the in-place ops write their results into the inputs inside the compiled
    graph (one kernel, as cheap as vLLM's out-of-place native path) or after it. After it
    on CPU only: Inductor on CPU miscompiles some input mutations (``KeyError: 'bufN'``
    in torch 2.13 for the fused-add norm), and there the extra copy is cheap next to the
    op; on CUDA it would be a kernel launch the in-model path never pays."""
    return device_type != "cpu"


class _Graph:
    """One compiled graph and how to call it with the op's arguments."""

    __slots__ = ("compiled", "tensor_idx", "write_back", "traced_at")

    def __init__(self, compiled, tensor_idx, write_back, traced_at):
        self.compiled, self.tensor_idx, self.write_back = compiled, tensor_idx, write_back
        #: the token (or row) count the graph was traced and first run at
        self.traced_at = traced_at

    def write(self, args, results):
        for i, r in zip(self.write_back, results):
            args[i].copy_(r)

    def __call__(self, args):
        ret = self.compiled(*[args[i] for i in self.tensor_idx])
        if self.write_back:
            self.write(args, ret)
        return ret


def compiled_graph(op_name: str, args, write_back: bool = True) -> tuple:
    """(the graph for this call's static signature, the call's result if building the
    graph already ran it, else ``_NOT_RUN``). The workload's rows per token is in the key: a
    graph's kernel configurations were chosen at the size it sets (vLLM's
    max_num_batched_tokens times it, read once when the graph is built: every call passes
    here, and the eager-timed bands time this host path). So is the rope's cat lowering
    (:data:`CONCAT_AFTER`), which the workload's context dims set."""
    dims = current_workload_dims()
    rows_per_token = int(dims.get("rows_per_token", 1) or 1)
    concat_kernel = (op_name in CONCAT_AFTER and bool(dims.get(CONCAT_AFTER[op_name]))
                     and model_lowers_cat_after_reduction_as_concat())
    key = _key(op_name, args) + (("rows_per_token", rows_per_token),
                                 ("write_back", write_back), ("concat_kernel", concat_kernel))
    graph = _graphs.get(key)
    if graph is not None:
        return graph, _NOT_RUN
    with _lock:
        graph = _graphs.get(key)
        if graph is not None:
            return graph, _NOT_RUN
        graph, first = _build(op_name, tuple(args), rows_per_token, write_back=write_back,
                              concat_kernel=concat_kernel)
        _graphs[key] = graph
        return graph, first


def _make_fn(op_name):
    spec = OPS[op_name]

    def fn(*args):
        graph, ret = compiled_graph(op_name, args)
        if ret is _NOT_RUN:
            ret = graph(args)
        if spec.mutates:
            return tuple(args[i] for i in spec.mutates)
        return ret
    fn.__qualname__ = f"native_vllm_{op_name}"
    return fn


#: in-place ops whose native path in vLLM's model is out of place, timed that way
#: (``OpImpl.timed``): the ropes. vLLM's ``forward_native`` returns new q/k, which the model
#: passes to attention; the op's contract writes them back, and Inductor cannot rotate in
#: place (each output element reads two inputs), so the contract's graph adds a copy kernel
#: the model never runs. (The fused-add norms' write-back fuses into their one kernel, as in
#: the model, so they are timed as they are called.)
OUT_OF_PLACE_TIMED = ("rotary_embedding", "mrope")


def _make_timed(op_name):
    """The rope as vLLM's model runs it: its compiled graph without the write-back,
    returning the rotated (query, key)."""
    def timed(*args):
        graph, ret = compiled_graph(op_name, args, write_back=False)
        return graph(args) if ret is _NOT_RUN else ret
    timed.__qualname__ = f"native_vllm_{op_name}_out_of_place"
    return timed


def implementations():
    out = []
    for name in OPS:
        if name not in LAYER_OF:
            continue
        impl = OpImpl(op_name=name, impl_id=IMPL_ID, kind=BackendImplKind.REFERENCE,
                      fn=_make_fn(name), priority=PRIORITY, backend="native_vllm",
                      qualify=_qualify, precision_rank=1, reads_workload_dims=True,
                      timed=_make_timed(name) if name in OUT_OF_PLACE_TIMED else None)
        out.append(impl)
    return out
