"""``linear``: an unquantized GEMM ``y = x @ weight.T (+ bias)``, vLLM's
``UnquantizedLinearMethod.apply`` (not the LM head: ``tune/workload.py`` says why).

- ``linear(x, weight, bias) -> y``: ``x`` is ``[M, K]`` (M = tokens; may be a strided view:
  padded rows, a column slice of a wider buffer), ``weight`` is ``[N, K]`` (a layer's
  weight, packed, the dtype of ``x``), ``bias`` is ``[N]`` or ``None``; ``y`` is a new
  ``[M, N]`` tensor in the dtype of ``x``. Pure: no argument changes.
- Keyed by ``dims = {n, k, bias}`` (the layer's per-rank output and input sizes and whether
  it has a bias), with token bands over M.

**Reference.** The product computed in fp32 (fp64 when given fp64 copies, which is how
parity runs it on CPU) and cast to the activation dtype once at the end: what a GEMM with
fp32 accumulation, the accumulation every vLLM GEMM path uses for bf16/fp16, would return
if its sums were exact.

**Tolerance (why not the elementwise ops' table alone).** An output element is a K-long
reduction. A correct bf16/fp16 kernel differs from the exact result by (a) rounding the
output to the activation dtype, at most half an ulp, ``|y|·2^-9`` (bf16) / ``|y|·2^-11``
(fp16): inside the table's ``rtol`` (1.6e-2 / 1e-3); and (b) the fp32 accumulation: K
rounding errors of relative size ``u = 2^-24`` on partial sums whose magnitude grows like
``sqrt(K)`` times a term's, so the accumulated error is of order ``sqrt(K)·u`` times the
typical output magnitude (random-walk bound; blocked / split-K summation only lowers it).
(b) is invisible for bf16/fp16 at K of a few thousand, but it is not for an fp32 output,
whose table ``atol`` (1e-5 of the mean |y|) a K=16k reduction can approach, and it grows
with K where the table does not. So the absolute term is widened by ``8·sqrt(K)·2^-24``
of the mean |y| (8 = a generous multiple of the random-walk constant); ``rtol`` stays
the table's. A kernel that accumulates in bf16/fp16 errs by ``sqrt(K)·2^-8`` or
``sqrt(K)·2^-11``, orders of magnitude more, and still fails; so does TF32 for fp32
inputs (``2^-11``), which is not an fp32 GEMM.

**Inputs.** ``x`` ~ N(0, 1) activations, ``weight`` ~ N(0, 1/K) (a trained layer's scale:
outputs of order 1 at any K), ``bias`` ~ N(0, 0.1) when the layer has one. Serving
layouts (``ops/layouts.py``): ``x`` as a padded-rows view and as a column slice of a wider
buffer (a GEMM input sliced out of another projection's output).
"""
from __future__ import annotations

import math

import torch

from .base import ATOL_SCALE, RTOL, OpSpec, normal
from .layouts import column_slice, padded_rows

#: the fp32 unit roundoff the accumulation term of the tolerance is built on
U_FP32 = 2.0 ** -24
#: multiple of the random-walk accumulation bound allowed (see the module docstring)
ACC_FACTOR = 8.0


def linear_ref(x, weight, bias):
    a = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(a) @ weight.to(a).t()
    if bias is not None:
        y = y + bias.to(a)
    return y.to(x.dtype)


def tolerance(args, dtype):
    """(rtol, atol scale) for a K-long reduction: the dtype's table, the absolute term
    widened by the fp32 accumulation bound ``ACC_FACTOR·sqrt(K)·2^-24`` (docstring)."""
    k = int(args[0].shape[-1])
    return RTOL[dtype], ATOL_SCALE[dtype] + ACC_FACTOR * math.sqrt(k) * U_FP32


def _check_dims(dims):
    for key in ("n", "k"):
        v = dims.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"linear: dims[{key!r}] must be a positive integer, got {v!r} "
                             f"(dims {dims})")


def _inputs(n, dims, dtype, device, gen):
    _check_dims(dims)
    N, K = int(dims["n"]), int(dims["k"])
    x = normal((n, K), dtype, device, gen, scale=1.0)
    w = normal((N, K), dtype, device, gen, scale=1.0 / math.sqrt(K))
    b = normal((N,), dtype, device, gen, scale=0.1) if dims.get("bias") else None
    return [x, w, b]


def _bytes(n, dims, dtype):
    e = torch.empty((), dtype=dtype).element_size()
    N, K = int(dims["n"]), int(dims["k"])
    return (n * K + N * K + n * N + (N if dims.get("bias") else 0)) * e


def flops(n, dims) -> int:
    """Multiply-adds counted twice: what a report divides by time for FLOP/s."""
    return 2 * n * int(dims["n"]) * int(dims["k"])


LINEAR = OpSpec(
    name="linear", reference=linear_ref, make_inputs=_inputs,
    outputs=lambda args, ret: [ret], bytes_moved=_bytes,
    # Qwen3.5-0.8B's down_proj: the layer the H200 first look found cuBLAS slowest on at M=1
    default_dims={"n": 1024, "k": 3584, "bias": False},
    layouts=(padded_rows(0), column_slice(0)),
    tolerance=tolerance,
    # frozen tables keyed by (dtype, K, N, bias): x's [M, K] alone would let every layer of
    # one K (qkv, gate_up, ...) share a table
    key_extra=lambda args: (int(args[1].shape[0]), int(args[2] is not None)),
    # the weight and bias: read once per model step, the other layers' weights stream
    # through L2 before this layer runs again (tune/cold_weights.py)
    step_cold_args=(1, 2),
    doc="unquantized GEMM: x @ W.T (+ b), fp32 accumulation")

SPECS = [LINEAR]
