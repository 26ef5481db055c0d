"""Core dispatch types, API-compatible with vllm-plugin-FL's ``dispatch/types.py``.

An :class:`OpImpl` is one candidate implementation of one op. FL's three kinds and their
priorities stay exactly as FL has them, so that fltune can reproduce FL's fixed order as a
baseline and show, side by side, what measuring buys over it.

fltune's extra PyTorch candidates (``torch`` fused ops and ``inductor``) are of kind
REFERENCE — they are PyTorch, no vendor code — with priorities *below* FL's reference (50).
FL has no such candidates, so ranking them last keeps the FL order's pick identical to what
vllm-plugin-FL itself would pick; measurement is what promotes them when they are faster.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Optional


class BackendImplKind(str, Enum):
    DEFAULT = "default"      # FlagGems (FL: "flagos")
    VENDOR = "vendor"        # vendor kernels: vLLM's own _C ops (CUDA or CPU build)
    REFERENCE = "reference"  # PyTorch

    @property
    def priority(self) -> int:
        return {"default": 150, "vendor": 100, "reference": 50}[self.value]


#: FL's spelling for the DEFAULT kind in policies (``VLLM_FL_PREFER=flagos``)
PREFER_TOKENS = {"flagos": BackendImplKind.DEFAULT, "default": BackendImplKind.DEFAULT,
                 "vendor": BackendImplKind.VENDOR, "reference": BackendImplKind.REFERENCE}


class UnsupportedCallError(RuntimeError):
    """A call its chosen candidate declares it cannot take (a strided view, an odd width, a
    dtype mix) and no other candidate was allowed to take instead (strict dispatch, or none
    takes it). Not strict, such a call goes to the next candidate that takes it: refused
    or rerouted, never computed wrongly."""


@dataclass(frozen=True)
class QualifyContext:
    """Device-neutral facts a candidate qualifies on (never a measured time)."""

    device_type: str                      # "cuda" | "cpu"
    dtype: Any                            # torch.dtype
    capability: Optional[tuple] = None    # CUDA compute capability


@dataclass
class OpImpl:
    """One candidate: FL's fields plus the backend it comes from and a qualification rule.

    ``fn`` follows the op's contract (``fltune.ops``) exactly; ``qualify(ctx)`` returns
    ``None`` when the candidate can run in that context, else the reason it cannot —
    the reason is shown by ``fltune candidates`` and stored in the calibration DB.
    """

    op_name: str
    impl_id: str
    kind: BackendImplKind
    fn: Callable[..., Any]
    vendor: Optional[str] = None
    priority: Optional[int] = None
    backend: str = ""
    qualify: Callable[[QualifyContext], Optional[str]] = field(
        default=lambda ctx: None, repr=False)
    #: declared precision rank (lower = more precise), breaks exact ties only
    precision_rank: int = 0
    #: what calls this candidate can take, like vLLM IR's ``supports_args``:
    #: ``supports(*args)`` returns ``None`` when it computes the op correctly on exactly
    #: these arguments (their strides, sizes and dtypes), else the reason it cannot.
    #: ``None`` (the default) means every call the op's contract allows. Checked at
    #: qualification, in the race's parity on serving layouts, and at every dispatch: a
    #: call outside it goes to another candidate, never silently to this one.
    supports: Optional[Callable[..., Optional[str]]] = field(default=None, repr=False)
    #: seconds its first call on a new shape may take to build or tune the kernel (a JIT
    #: compile, an autotune), or 0. Such a candidate gets one untimed call per band before
    #: its parity check, watched with that allowance instead of the hang timeout: on the
    #: H200 FlashInfer's GDN prefill JIT took over 5 minutes and was refused as "hung"
    #: after 120 s, and vLLM's FLA kernels autotune for ~70 s on first use. Never timed.
    first_call_s: float = 0.0
    #: the call the race times where it differs from ``fn`` (``None``: ``fn`` itself).
    #: ``native.vllm`` stands for vLLM's own path as the model runs it, and for the ropes
    #: that path is out of place (the rotated q/k flow on into attention), while the op's
    #: contract, which ``fn`` keeps for parity and dispatch, is in place: Inductor cannot
    #: rotate in place, so ``fn``'s graph is two kernels (the rope, then a copy back) where
    #: the model runs one — on the H200 1.3-3.1x the model's time (session 18). ``timed``
    #: returns the outputs instead of writing them; the race checks its values too
    #: (:func:`fltune.tune.race.race`) before timing it.
    timed: Optional[Callable[..., Any]] = field(default=None, repr=False)
    #: whether its first call builds something for the served model (``native.vllm``: the
    #: trace size in rows, the rope's cat lowering), read from the workload dims
    #: (``fltune.ops.workload_dims``). The race calls inside them; serving calls it inside
    #: the dims of the manifest table it was picked from (``dispatch/frozen.py``), or it
    #: would build as for no model at all (a Qwen3 rope 1.4x slower at prefill)
    reads_workload_dims: bool = False

    def __post_init__(self):
        self.kind = BackendImplKind(self.kind)
        if self.priority is None:
            self.priority = self.kind.priority
        if self.kind is BackendImplKind.VENDOR and not self.vendor:
            raise ValueError(f"{self.impl_id}: a VENDOR implementation must name its vendor")

    def unsupported(self, args) -> Optional[str]:
        """Why this candidate cannot take the call ``fn(*args)``, or ``None`` if it can."""
        return None if self.supports is None else self.supports(*args)

    def supports_args(self, *args) -> bool:
        """vLLM IR's spelling: whether ``fn(*args)`` is inside what this candidate supports."""
        return self.supports is None or self.supports(*args) is None

    def is_available(self, ctx: Optional[QualifyContext] = None) -> bool:
        return self.qualify(ctx or default_context()) is None

    @property
    def callable_path(self) -> str:
        """Where ``fn`` lives, for manifests and reports."""
        fn = self.fn
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def default_context(dtype=None) -> QualifyContext:
    import torch

    if torch.cuda.is_available():
        return QualifyContext("cuda", dtype or torch.bfloat16,
                              torch.cuda.get_device_capability())
    return QualifyContext("cpu", dtype or torch.bfloat16)
