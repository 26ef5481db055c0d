"""Parity: does a candidate compute the op, within the dtype's tolerance, on real inputs?

Checked before any timing (a fast wrong kernel must never win), on cloned inputs (an
in-place candidate cannot corrupt the next one's inputs), against the op's reference run
in high precision: fp64 on CPU, fp32 on GPU (fp64 is slow there and fp32 math already
exceeds every candidate dtype's precision by orders of magnitude).

Score = fraction of output elements with |out - ref| <= atol + rtol*|ref|, over all of the
op's outputs (for in-place ops: the mutated arguments). NaN or inf where the reference is
finite fails the whole candidate. A pure op that mutates its inputs fails too: vLLM's
callers reuse them. The measured error (mean |out - ref| / mean |ref|) is kept as the
candidate's precision, which the precision tiebreak compares.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ..ops.base import ATOL_SCALE, RTOL, OpSpec, clone_args, upcast_args
from ..ops.layouts import outside_view_changed

PARITY_FLOOR = 0.99


@dataclass
class ParityResult:
    score: float                 # fraction of elements within tolerance, 0..1
    rel_error: float             # mean |out-ref| / mean |ref| (the precision measure)
    max_abs_error: float
    passed: bool
    reason: Optional[str] = None  # why it failed (NaN, shape, mutated input, raised, ...)
    #: serving layouts checked (``check_layouts``): name -> "ok" | "declared unsupported:
    #: <why>" | the failure; empty when only the tidy inputs were checked
    layouts: dict = None

    def as_dict(self):
        return {"score": self.score, "rel_error": self.rel_error,
                "max_abs_error": self.max_abs_error, "passed": self.passed,
                "reason": self.reason}


def reference_outputs(spec: OpSpec, args: list) -> list[torch.Tensor]:
    """The op's outputs computed in high precision on copies of ``args``."""
    hi = torch.float64 if args_device(args).type == "cpu" else torch.float32
    ref_args = upcast_args(args, hi)
    ret = spec.reference(*ref_args)
    return [t.detach() for t in spec.outputs(ref_args, ret)]


def args_device(args) -> torch.device:
    return next(a for a in args if isinstance(a, torch.Tensor)).device


def check(spec: OpSpec, fn, args: list, dtype: torch.dtype, *,
          reference: Optional[list] = None, floor: float = PARITY_FLOOR) -> ParityResult:
    """Run ``fn`` on clones of ``args`` and score it against the reference."""
    ref = reference if reference is not None else reference_outputs(spec, args)
    call_args = clone_args(args)
    try:
        ret = fn(*call_args)
        outs = list(spec.outputs(call_args, ret))
    except Exception as e:
        return ParityResult(0.0, float("inf"), float("inf"), False,
                            f"raised {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    if len(outs) != len(ref):
        return ParityResult(0.0, float("inf"), float("inf"), False,
                            f"returned {len(outs)} outputs, expected {len(ref)}")
    for i, (a, b) in enumerate(zip(args, call_args)):
        # no candidate may touch memory around a view it was given (the rest of a qkv
        # buffer, a padded row's tail): that is another tensor's data in serving
        if isinstance(a, torch.Tensor) and outside_view_changed(a, b):
            return ParityResult(0.0, float("inf"), float("inf"), False,
                                f"wrote outside its view of argument {i} (shape "
                                f"{tuple(a.shape)}, strides {tuple(a.stride())})")
        # only the arguments the op documents as in-place may change (none for pure ops):
        # vLLM's callers reuse weights, caches and positions across calls
        if i not in spec.mutates and isinstance(a, torch.Tensor) and not torch.equal(a, b):
            what = "is out of place" if not spec.mutates else \
                f"may only write arguments {list(spec.mutates)}"
            return ParityResult(0.0, float("inf"), float("inf"), False,
                                f"mutated input argument {i}, but {spec.name} {what}")
    rtol, atol_scale = (spec.tolerance(args, dtype) if spec.tolerance is not None
                        else (RTOL[dtype], ATOL_SCALE[dtype]))
    good = total = 0
    err_sum = ref_sum = 0.0
    max_abs = 0.0
    for o, r in zip(outs, ref):
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(r.shape):
            shape = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
            return ParityResult(0.0, float("inf"), float("inf"), False,
                                f"output shape {shape}, expected {tuple(r.shape)}")
        of = o.detach().to(r.dtype)
        if not torch.isfinite(of).all() and torch.isfinite(r).all():
            return ParityResult(0.0, float("inf"), float("inf"), False,
                                "output has NaN/inf where the reference is finite")
        diff = (of - r).abs()
        scale = r.abs().mean().item() or 1.0
        ok = diff <= atol_scale * scale + rtol * r.abs()
        good += int(ok.sum().item())
        total += ok.numel()
        err_sum += diff.sum().item()
        ref_sum += r.abs().sum().item()
        max_abs = max(max_abs, diff.max().item() if diff.numel() else 0.0)
    score = good / total if total else 1.0
    rel = err_sum / ref_sum if ref_sum else err_sum
    passed = score >= floor
    return ParityResult(score, rel, max_abs, passed,
                        None if passed else f"parity {score:.4f} below floor {floor}")


#: tokens of the small inputs the serving layouts are checked on: even (per-head views
#: group rows), several rows, cheap enough to check every candidate of every shape
LAYOUT_TOKENS = 6

_layout_cache: dict = {}


def check_layouts(spec: OpSpec, impl, dims: dict, dtype: torch.dtype, device,
                  floor: float = PARITY_FLOOR) -> ParityResult:
    """Parity of ``impl`` on every serving layout of ``spec`` (``OpSpec.layouts``).

    A layout the candidate declares it does not take (``OpImpl.supports``) is skipped:
    dispatch never gives it such a call. Every other layout must pass like the tidy
    inputs, and nothing outside a view may change. Checked once per (op, shape, dtype,
    candidate, device) in a process: whether a kernel honours strides does not depend on
    the token count, and compiling candidates (Inductor) recompile per layout."""
    # keyed by the function itself (held, so its identity cannot be reused), not only the
    # id: two candidates may share an id across registries
    # (the context dims too: they are not in the signature, and native.vllm compiles other
    # graphs per context, each of which must meet the serving layouts)
    key = (spec.name, spec.signature(dims), tuple(sorted(spec.context(dims).items())), dtype,
           impl.impl_id, impl.fn, str(device))
    hit = _layout_cache.get(key)
    if hit is not None:
        return hit
    gen = torch.Generator().manual_seed(1)
    tidy = spec.make_inputs(LAYOUT_TOKENS, dims, dtype, str(device), gen)
    seen, worst = {}, None
    for layout in spec.layouts:
        if not layout.applies(tidy):
            continue
        args = layout.build(tidy)
        why = impl.unsupported(args)
        if why is not None:
            seen[layout.name] = f"declared unsupported: {why}"
            continue
        with warnings.catch_warnings():
            # e.g. torch's "Mismatch dtype between input and weight": the point of the
            # fp32-weight layout, not news for the person calibrating
            warnings.simplefilter("ignore", UserWarning)
            p = check(spec, impl.fn, args, dtype, floor=floor)
        seen[layout.name] = "ok" if p.passed else p.reason
        if not p.passed and worst is None:
            # a raise keeps its prefix: the race records it as refused, not as wrong
            what = "raised on" if p.reason.startswith("raised") else "wrong on"
            worst = ParityResult(p.score, p.rel_error, p.max_abs_error, False,
                                 f"{what} serving layout {layout.name} ({layout.doc}): "
                                 f"{p.reason}")
    result = worst or ParityResult(1.0, 0.0, 0.0, True)
    result.layouts = seen
    _layout_cache[key] = result
    return result


def check_candidate(spec: OpSpec, impl, args: list, dims: dict, dtype: torch.dtype, *,
                    reference: Optional[list] = None,
                    floor: float = PARITY_FLOOR) -> ParityResult:
    """The race's parity: the tidy inputs first (their score and error are the ones the
    precision tiebreak compares), then the serving layouts. A candidate that is right only
    on packed inputs fails here with the layout named, however fast it is."""
    p = check(spec, impl.fn, args, dtype, reference=reference, floor=floor)
    if not p.passed or not spec.layouts:
        return p
    lay = check_layouts(spec, impl, dims, dtype, args_device(args), floor)
    if not lay.passed:
        return ParityResult(p.score, p.rel_error, p.max_abs_error, False, lay.reason,
                            lay.layouts)
    p.layouts = lay.layouts
    return p


def as_contract(spec: OpSpec, fn):
    """``fn`` (which returns an in-place op's outputs instead of writing them: an
    ``OpImpl.timed``) wrapped to keep the op's contract, so :func:`check` can score it."""
    def call(*args):
        ret = fn(*args)
        if not spec.mutates:
            return ret
        rets = ret if isinstance(ret, (tuple, list)) else (ret,)
        for i, r in zip(spec.mutates, rets):
            args[i].copy_(r)
        return tuple(args[i] for i in spec.mutates)
    return call


def check_timed(spec: OpSpec, impl, args: list, dtype: torch.dtype, *,
                reference: Optional[list] = None,
                floor: float = PARITY_FLOOR) -> Optional[ParityResult]:
    """Parity of the call the race times when it is not ``fn`` (``OpImpl.timed``), on the
    tidy inputs; ``None`` when the candidate has none. A timed path that computes something
    else would be timing the wrong thing."""
    if getattr(impl, "timed", None) is None:
        return None
    return check(spec, as_contract(spec, impl.timed), args, dtype, reference=reference,
                 floor=floor)
