"""Weights cold in L2 at decode bands, as a model step has them.

Why this exists. The race times a decode band (up to vLLM's largest CUDA-graph capture
size) as K back-to-back calls replayed from one CUDA graph (``timing``), all on the same
arguments. For a GEMM that means the layer's weight is read from L2 on every call but the
first: a Qwen3-0.6B down projection (k=3072, n=1024, bf16) is 6 MiB, the H200's L2 50 MiB.
In a model step each layer's weight is read once, and the other layers' weights (hundreds of
MiB) stream through L2 before that layer runs again, so the weight comes from HBM. The two
regimes rank kernels differently: on the H200 (session 19) the race picked FlagGems' mm for
that projection at 33–128 tokens, 6 % faster than cuBLAS with the weight hot, and in the
model the same kernel took 250 µs per step where vanilla's cuBLAS split-K GEMM and its
reduction took 151 + 53 — the served split lost 2 % of the step's kernel time at batch-64
decode and was undone. ``--cold-l2`` did not help: it covers prefill bands only, where an
eager call after an L2 flush costs what it costs in the model; at decode sizes an eager
call would time its host launch, which vLLM's graphs do not pay.

What it does (the rotating-buffer method of nvbench and FlashInfer's ``bench_gpu_time``
with ``cold_l2_cache``). An op says which arguments a model step reads cold
(``OpSpec.step_cold_args``: ``linear``'s weight and bias). For such an op, each candidate
gets ``n`` copies of those arguments, enough that the bytes of the other ``n - 1`` exceed
L2 by :data:`L2_FACTOR`, and its timed call cycles through them; the graph holds a whole
number of cycles (a multiple of ``n`` calls, replays follow each other), so between two
uses of one copy the ``n - 1`` others have evicted it. The timer records the copies and the
span they reached (``cold_weight_l2_span``: under the factor where the copy cap or free
memory cut them). The activation stays one tensor, hot, as the producer GEMM leaves it in a
model. Opt-in
(``fltune calibrate --cold-weights``) until the H200 has shown that it changes the picks the
model-step measurement disagreed with.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..ops.base import clone_args

#: the other copies' bytes must exceed L2 by this factor (L2 is not a perfect LRU)
L2_FACTOR = 2.0
#: at most this many copies per candidate (a small weight would otherwise need hundreds)
MAX_COPIES = 64
#: L2 size assumed where the device does not report one (the H100 / H200's 50 MiB)
DEFAULT_L2_BYTES = 50 * 2**20


def l2_bytes(device: str) -> int:
    """The device's L2 size in bytes (CUDA reports it; otherwise :data:`DEFAULT_L2_BYTES`)."""
    if device == "cuda" and torch.cuda.is_available():
        size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                       "L2_cache_size", 0)
        if size:
            return int(size)
    return DEFAULT_L2_BYTES


def cold_bytes(args: Sequence, cold_idx: Sequence[int]) -> int:
    """Bytes of the arguments a model step reads cold (``None`` arguments count nothing)."""
    return sum(args[i].numel() * args[i].element_size() for i in cold_idx
               if i < len(args) and isinstance(args[i], torch.Tensor))


def copies_needed(nbytes: int, l2: int, factor: float = L2_FACTOR,
                  cap: int = MAX_COPIES) -> int:
    """How many copies make the other ``n - 1`` span ``factor`` times L2: 1 when one copy
    already does (an LM-head-sized weight is cold on its own), at most ``cap``."""
    if nbytes <= 0:
        return 1
    if nbytes >= factor * l2:
        return 1
    return min(cap, 1 + math.ceil(factor * l2 / nbytes))


def l2_span(n: int, nbytes: int, l2: int) -> float:
    """How many L2s the other ``n - 1`` copies span (recorded with the timing: below
    :data:`L2_FACTOR` where the copy cap or free memory cut the count, the weight was only
    partly cold)."""
    return (n - 1) * nbytes / l2 if l2 else 0.0


def rotating_call(fn: Callable, args: list, cold_idx: Sequence[int], n: int) -> Callable:
    """A no-argument call of ``fn`` whose cold arguments cycle through ``n`` copies.

    ``args`` (the candidate's own clone) is copy 0; copies 1..n-1 clone only the cold
    arguments (a ``None`` bias stays ``None``), the rest of the call (the activation) is
    shared. Each call takes the next copy, so a CUDA graph captured over a multiple of ``n``
    calls replays every copy in turn, the same number of times."""
    sets = [list(args)]
    for _ in range(n - 1):
        extra = clone_args([args[i] if i in cold_idx else None for i in range(len(args))])
        sets.append([extra[i] if i in cold_idx else args[i] for i in range(len(args))])
    state = {"i": 0}

    def call():
        a = sets[state["i"] % n]
        state["i"] += 1
        return fn(*a)
    call.copies = n
    call.sets = sets
    return call
