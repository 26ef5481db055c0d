"""Rotary position embedding, in place on query and key like vLLM's ``_C.rotary_embedding``.

- ``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`` —
  ``positions [N]``, ``query [N, heads*head_size]``, ``key [N, kv_heads*head_size]``,
  ``cos_sin_cache [max_pos, rotary_dim]`` (cos half then sin half). Only the first
  ``rotary_dim`` channels of each head rotate (partial rotary: Qwen3.5 rotates 64 of 256);
  NeoX style rotates halves, GPT-J style rotates even/odd pairs.
- ``mrope(positions, query, key, head_size, cos_sin_cache, mrope_section, interleaved)`` —
  Qwen3.5's multimodal rope: ``positions [3, N]`` (temporal, height, width); each rotary
  frequency takes its cos/sin from one of the three rows, chosen by ``mrope_section``
  (interleaved: T,H,W,T,H,W,...). NeoX style. Also in place, so the two ops share one
  calling convention and one parity check of the mutated query and key.
"""
from __future__ import annotations

import torch

from .base import OpSpec, normal
from .layouts import padded_rows, split_of_one_buffer


def _acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rotate(x, cos, sin, is_neox):
    """x [N, heads, rot], cos/sin [N, 1, rot/2]."""
    if is_neox:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1, x2 = x[..., ::2], x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def _apply_in_place(t, cos, sin, head_size, is_neox):
    if t is None:
        return
    rot = cos.shape[-1] * 2
    n = t.shape[0]
    v = t.view(n, -1, head_size)
    a = _acc(t)
    rotated = _rotate(v[..., :rot].to(a), cos.to(a).unsqueeze(-2), sin.to(a).unsqueeze(-2),
                      is_neox)
    v[..., :rot] = rotated.to(t.dtype)


def rotary_embedding_ref(positions, query, key, head_size, cos_sin_cache, is_neox):
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).chunk(2, dim=-1)
    _apply_in_place(query, cos, sin, head_size, is_neox)
    _apply_in_place(key, cos, sin, head_size, is_neox)
    return query, key


def _mrope_select(x, section, interleaved):
    """x [3, N, rot/2] -> [N, rot/2]: which position row each frequency uses."""
    if interleaved:
        out = x[0].clone()
        out[..., 1: section[1] * 3: 3] = x[1, ..., 1: section[1] * 3: 3]
        out[..., 2: section[2] * 3: 3] = x[2, ..., 2: section[2] * 3: 3]
        return out
    return torch.cat([m[i] for i, m in enumerate(x.split(list(section), dim=-1))], dim=-1)


def mrope_ref(positions, query, key, head_size, cos_sin_cache, mrope_section, interleaved):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)       # [3, N, rot/2] each
    cos = _mrope_select(cos, mrope_section, interleaved)
    sin = _mrope_select(sin, mrope_section, interleaved)
    _apply_in_place(query, cos, sin, head_size, True)
    _apply_in_place(key, cos, sin, head_size, True)
    return query, key


# ---- inputs ---------------------------------------------------------------------------

def cos_sin_cache(max_position, rotary_dim, base, dtype, device):
    """vLLM's RotaryEmbedding._compute_cos_sin_cache, in fp32 then cast to the model dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)


def _qk(n, dims, dtype, device, gen):
    hs = int(dims["head_size"])
    q = normal((n, int(dims["heads"]) * hs), dtype, device, gen)
    k = normal((n, int(dims["kv_heads"]) * hs), dtype, device, gen)
    return q, k


def _rope_inputs(n, dims, dtype, device, gen):
    maxp = int(dims.get("max_position", 8192))
    pos = torch.randint(0, maxp, (n,), generator=gen).to(device)
    q, k = _qk(n, dims, dtype, device, gen)
    cache = cos_sin_cache(maxp, int(dims["rotary_dim"]), float(dims.get("base", 10000.0)),
                          dtype, device)
    return [pos, q, k, int(dims["head_size"]), cache, bool(dims.get("is_neox", True))]


def _mrope_inputs(n, dims, dtype, device, gen):
    maxp = int(dims.get("max_position", 8192))
    # three different position rows, so a candidate that mixes up the sections fails parity
    pos = torch.randint(0, maxp, (3, n), generator=gen).to(device)
    q, k = _qk(n, dims, dtype, device, gen)
    cache = cos_sin_cache(maxp, int(dims["rotary_dim"]), float(dims.get("base", 10000.0)),
                          dtype, device)
    return [pos, q, k, int(dims["head_size"]), cache, tuple(dims["mrope_section"]),
            bool(dims.get("interleaved", True))]


def _bytes(n, dims, dtype):
    e = torch.empty((), dtype=dtype).element_size()
    heads = int(dims["heads"]) + int(dims["kv_heads"])
    rot = int(dims["rotary_dim"])
    # the rotated channels are read and written; one cache row read per token
    return (2 * n * heads * rot + n * rot) * e + n * 8


#: q and k are column slices of the fused qkv output (``qkv.split``), v right after them
_ROPE_LAYOUTS = (split_of_one_buffer(1, 2), padded_rows(1, 2))

_QWEN35_ROPE = {"heads": 8, "kv_heads": 2, "head_size": 256, "rotary_dim": 64,
                "max_position": 8192, "base": 1e7}

ROTARY_EMBEDDING = OpSpec(
    name="rotary_embedding", reference=rotary_embedding_ref, make_inputs=_rope_inputs,
    outputs=lambda args, ret: [args[1], args[2]], bytes_moved=_bytes, mutates=(1, 2), key_arg=1,
    default_dims={**_QWEN35_ROPE, "is_neox": True}, layouts=_ROPE_LAYOUTS,
    # whether the model normalises q and k per head right before the rope (Qwen3): it
    # changes how vLLM's compile lowers the rope (``backends/native_vllm``), not the op
    context_dims=("after_qk_norm",),
    doc="in-place rope on query/key, NeoX or GPT-J style, partial rotary_dim")

MROPE = OpSpec(
    name="mrope", reference=mrope_ref, make_inputs=_mrope_inputs,
    outputs=lambda args, ret: [args[1], args[2]], bytes_moved=_bytes, mutates=(1, 2), key_arg=1,
    default_dims={**_QWEN35_ROPE, "mrope_section": (11, 11, 10), "interleaved": True},
    layouts=_ROPE_LAYOUTS,
    doc="Qwen3.5 interleaved 3-section multimodal rope, in place")

SPECS = [ROTARY_EMBEDDING, MROPE]
