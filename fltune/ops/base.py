"""The op contract: what every candidate of one op must compute, and how we check it.

An :class:`OpSpec` is the single description of an op that every later stage reads:
the backends adapt to its calling convention, parity compares against its reference,
the workload builds its inputs, and the report divides its bytes by measured time.
Keeping all of that in one object is what lets a new op be added in one module.

Calling convention (vLLM's, exactly): a candidate is called as ``fn(*args)`` with the
tensors and scalars :meth:`OpSpec.make_inputs` produced. Ops that vLLM runs in place
(``fused_add_rms_norm``, ``rotary_embedding``) must mutate the named arguments; the
others must leave their inputs untouched. Either way the op's ``outputs`` function picks
the tensors that parity compares, from the call's arguments and return value.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .layouts import clone_keeping_layout

#: Per-dtype relative tolerance, FlagGems' table (tests/accuracy_utils.py), used as both
#: rtol and atol scale: an element passes when |out - ref| <= atol + rtol * |ref|.
RTOL = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float32: 1.3e-6}
#: absolute floor: values near zero are judged against the output's scale, not zero.
ATOL_SCALE = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3, torch.float32: 1e-5}

#: The workload dims of the calls being made now (``workload_dims``), for a candidate whose
#: first call builds something sized like the served model: ``native.vllm`` traces its graph
#: at vLLM's ``max_num_batched_tokens``, in *rows* for the norms that run several rows per
#: token (q/k norms, the gated norm), which the tensors alone cannot tell.
_WORKLOAD_DIMS: list = [{}]


@contextlib.contextmanager
def workload_dims(dims: dict):
    """Calls made inside this block are for a workload item with these ``dims``."""
    _WORKLOAD_DIMS.append(dict(dims or {}))
    try:
        yield
    finally:
        _WORKLOAD_DIMS.pop()


def current_workload_dims() -> dict:
    """The dims of the innermost :func:`workload_dims` block ({} outside any)."""
    return _WORKLOAD_DIMS[-1]


def in_workload(fn, dims: dict):
    """``fn`` called inside ``workload_dims(dims)``, for a dispatch path that calls it on
    every model step: a list push and pop, not a context manager's generator."""
    dims = dict(dims or {})
    push, pop = _WORKLOAD_DIMS.append, _WORKLOAD_DIMS.pop

    def called(*args):
        push(dims)
        try:
            return fn(*args)
        finally:
            pop()
    called.__qualname__ = getattr(fn, "__qualname__", "fn")
    return called


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """'bf16' / 'bfloat16' / torch.bfloat16 -> torch.bfloat16, with a clear error."""
    if isinstance(name, torch.dtype):
        return name
    aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
               "float": "fp32"}
    key = aliases.get(str(name).lower(), str(name).lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[key]


@dataclass(frozen=True)
class OpSpec:
    """One op's contract.

    ``dims`` are the model facts the op needs besides the token count (hidden size,
    head counts, ...): a plain dict of ints/floats/bools/tuples, so it can be hashed into a
    shape signature and stored in the DB as JSON.
    """

    name: str
    #: the computation in fp32 math with vLLM's semantics; run on fp64 copies it is the
    #: high-precision reference for parity, run as is it is the REFERENCE candidate.
    reference: Callable[..., Any]
    #: (n_tokens, dims, dtype, device, generator) -> list of call arguments
    make_inputs: Callable[[int, dict, torch.dtype, str, torch.Generator], list]
    #: (args after the call, return value) -> tensors to compare, in a fixed order
    outputs: Callable[[list, Any], Sequence[torch.Tensor]]
    #: (n_tokens, dims, dtype) -> bytes the op must read and write at least
    bytes_moved: Callable[[int, dict, torch.dtype], int]
    #: indices of the arguments the op mutates (vLLM in-place semantics); () = pure
    mutates: tuple[int, ...] = ()
    #: default dims (Qwen3.5-0.8B's) so the op can be exercised without a model profile
    default_dims: dict = field(default_factory=dict)
    doc: str = ""
    #: the argument whose dtype and trailing shape key frozen dispatch, and whose leading
    #: dimension is the row count bands are looked up by (query for rope, x otherwise)
    key_arg: int = 0
    #: for an in-place op, the same math returning its results instead of writing them
    #: (in the order of ``mutates``): Inductor on CPU miscompiles some input mutations
    #: (KeyError 'bufN' in torch 2.13), so the inductor backend compiles this form and
    #: copies the results back outside the compiled graph
    functional: Optional[Callable[..., Any]] = None
    #: the argument layouts vLLM passes this op in serving (``ops/layouts.py``): per-head
    #: views, column slices, padded rows, mixed dtypes. Every candidate's parity is also
    #: checked on each, so a kernel that is right only on packed inputs cannot win.
    layouts: tuple = ()
    #: (call arguments, dtype) -> (rtol, atol scale) where the dtype's table does not fit
    #: the op's arithmetic (a K-long reduction: ``ops/linear.py``); None = the table
    tolerance: Optional[Callable[[list, Any], tuple]] = None
    #: call arguments -> ints appended to the key argument's trailing shape in the frozen
    #: table key, where that shape alone does not tell the op's tables apart (a GEMM's
    #: x is [M, K]: every layer with the same K would share one table; ``linear`` adds N
    #: and whether there is a bias). None = the trailing shape alone (every other op)
    key_extra: Optional[Callable[[Sequence], tuple]] = None
    #: indices of the arguments a model step reads cold, evicted from L2 by the rest of the
    #: step between two calls of one layer (a layer's weight): ``fltune calibrate
    #: --cold-weights`` times decode bands with these rotated through copies
    #: (``tune/cold_weights.py``). () = every argument as the race makes it
    step_cold_args: tuple[int, ...] = ()
    #: dims that say what the op's neighbours in the model are, not what its arguments are
    #: (``after_qk_norm`` of a rope): the inputs and every candidate's values are the same
    #: with or without them, so they stay out of :meth:`signature` (the DB's and the
    #: manifest's key: a model gaining one keeps its rows). Read by a candidate that
    #: reproduces the model's compile, whose code depends on the neighbours (``native.vllm``)
    context_dims: tuple[str, ...] = ()

    def context(self, dims: dict) -> dict:
        """The :attr:`context_dims` of ``dims`` (None where absent): what a resume compares
        besides the signature (``CalibrationDB.has_band``)."""
        return {k: dims.get(k) for k in self.context_dims}

    def signature(self, dims: dict) -> str:
        """A stable text key of the op's model-dependent shape, e.g. 'hidden=1024'
        (:attr:`context_dims` left out)."""
        return ",".join(f"{k}={_fmt(v)}" for k, v in sorted(dims.items())
                        if k not in self.context_dims)


def _fmt(v) -> str:
    if isinstance(v, (list, tuple)):
        return "x".join(str(i) for i in v)
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def clone_args(args: list) -> list:
    """Deep-enough copy of a call's arguments: every tensor cloned (keeping its strides,
    offset and surrounding memory, see ``layouts.clone_keeping_layout``), scalars shared.

    Parity and timing run every candidate on its own clones, so an in-place candidate
    cannot corrupt the inputs the next candidate sees, and a strided view stays one."""
    return [clone_keeping_layout(a) if isinstance(a, torch.Tensor) else a for a in args]


def upcast_args(args: list, dtype: torch.dtype) -> list:
    """Copies of the arguments with every floating tensor cast to ``dtype``."""
    return [a.to(dtype).clone() if isinstance(a, torch.Tensor) and a.is_floating_point()
            else (a.clone() if isinstance(a, torch.Tensor) else a) for a in args]


def normal(shape, dtype, device, gen, scale=1.0, mean=0.0):
    """Realistic non-zero activations: a normal draw made on the CPU (so the same seed
    gives the same data on every device), then moved."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale + mean
    return t.to(device=device, dtype=dtype)
