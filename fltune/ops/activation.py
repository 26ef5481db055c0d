"""Gated activations on a ``[..., 2d]`` input, vLLM's ``SiluAndMul`` / ``GeluAndMul``.

``act(x[..., :d]) * x[..., d:]`` -> ``[..., d]``. vLLM's kernels take ``(out, x)``; the
FlagGems kernels take the two halves ``(a, b)``; the backends bridge both to this single
``fn(x) -> out`` contract. ``gelu_and_mul`` is the exact (erf) GELU, ``gelu_tanh_and_mul``
the tanh approximation: vLLM calls different kernels for them, so they are different ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import OpSpec, normal
from .layouts import column_slice, padded_rows


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# Three separate functions, not one closure factory: Dynamo caches compiled code per code
# object, and a shared closure would make the three ops recompile against each other.
def silu_and_mul_ref(x):
    d = x.shape[-1] // 2
    xf = x.to(_acc(x))
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def gelu_and_mul_ref(x):
    d = x.shape[-1] // 2
    xf = x.to(_acc(x))
    return (F.gelu(xf[..., :d], approximate="none") * xf[..., d:]).to(x.dtype)


def gelu_tanh_and_mul_ref(x):
    d = x.shape[-1] // 2
    xf = x.to(_acc(x))
    return (F.gelu(xf[..., :d], approximate="tanh") * xf[..., d:]).to(x.dtype)


def _inputs(n, dims, dtype, device, gen):
    return [normal((n, 2 * int(dims["intermediate"])), dtype, device, gen, scale=2.0)]


def _bytes(n, dims, dtype):
    e = torch.empty((), dtype=dtype).element_size()
    return 3 * n * int(dims["intermediate"]) * e


def _spec(name, ref, doc):
    return OpSpec(name=name, reference=ref, make_inputs=_inputs,
                  outputs=lambda args, ret: [ret], bytes_moved=_bytes,
                  default_dims={"intermediate": 3584}, doc=doc,
                  layouts=(padded_rows(0), column_slice(0)))


SILU_AND_MUL = _spec("silu_and_mul", silu_and_mul_ref, "silu(x[:d]) * x[d:]")
GELU_AND_MUL = _spec("gelu_and_mul", gelu_and_mul_ref, "gelu(x[:d]) * x[d:], exact")
GELU_TANH_AND_MUL = _spec("gelu_tanh_and_mul", gelu_tanh_and_mul_ref,
                          "gelu_tanh(x[:d]) * x[d:]")

SPECS = [SILU_AND_MUL, GELU_AND_MUL, GELU_TANH_AND_MUL]
