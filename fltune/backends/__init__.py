"""Candidate backends, one module each. Every module exposes ``implementations()``: the
:class:`~fltune.dispatch.types.OpImpl` list it offers, each adapting that backend's own
signature to the op contract in :mod:`fltune.ops` and carrying a ``qualify`` rule."""
from __future__ import annotations

BUILTIN_BACKENDS = ("fltune.backends.reference", "fltune.backends.torch_fused",
                    "fltune.backends.inductor", "fltune.backends.native_vllm",
                    "fltune.backends.flaggems",
                    "fltune.backends.vllm_c",
                    "fltune.backends.gemm",
                    "fltune.backends.fla_vllm", "fltune.backends.flashinfer")
