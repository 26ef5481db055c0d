"""Make PyPI's torchvision importable beside the CPU build of torch (SGLang's test env only).

Why this exists: ``import sglang`` imports torchvision unconditionally
(``sglang/srt/utils/common.py``), so no SGLang layer class can be imported without it. PyPI
only has CUDA builds of torchvision: beside the CPU torch 2.13.0 that CI uses, its ``_C``
extension cannot load (it links ``libtorch_cuda.so``), and then ``import torchvision`` dies in
``_meta_registrations`` with "operator torchvision::nms does not exist": that module
registers a fake kernel for ``torchvision::nms`` unconditionally, while every other op's
registration checks ``extension._has_ops()`` first. (This is also why ``scripts/setup.sh``
removes torchvision from the vLLM venv.)

The fix here defines exactly the two operators it registers that way (``nms`` and
``qnms``), with real CPU kernels (greedy NMS in PyTorch, torchvision's semantics), before torchvision is first imported. Nothing
else of torchvision changes; its other C++ ops stay unavailable, as torchvision itself
reports (``extension._has_ops() is False``). SGLang's text models never call them (they
are for image processors of multimodal models).

It is installed only into the separate SGLang venv (``scripts/setup_sglang.sh`` writes a
``.pth`` line that calls :func:`install`), never into the vLLM venv, and it is a no-op
where torchvision's own extension loads (a CUDA torch, e.g. the H200). :func:`install` only
adds an import hook: torch is not imported until something imports torchvision.
"""
from __future__ import annotations

import importlib.abc
import sys

#: the ops ``torchvision/_meta_registrations.py`` (0.28) registers fakes for unconditionally
_SCHEMAS = {"nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"}
_lib = None        # keeps the torch.library.Library alive


def nms_cpu(dets, scores, iou_threshold: float):
    """torchvision.ops.nms: indices of the kept boxes (x1, y1, x2, y2), by decreasing score."""
    import torch

    if dets.numel() == 0:
        return torch.empty((0,), dtype=torch.long, device=dets.device)
    x1, y1, x2, y2 = dets.unbind(1)
    areas = (x2 - x1) * (y2 - y1)
    order = scores.argsort(descending=True)
    suppressed = torch.zeros(dets.shape[0], dtype=torch.bool)
    keep = []
    for i in order.tolist():
        if suppressed[i]:
            continue
        keep.append(i)
        xx1 = torch.maximum(x1[i], x1)
        yy1 = torch.maximum(y1[i], y1)
        xx2 = torch.minimum(x2[i], x2)
        yy2 = torch.minimum(y2[i], y2)
        inter = (xx2 - xx1).clamp(min=0) * (yy2 - yy1).clamp(min=0)
        iou = inter / (areas[i] + areas - inter)
        suppressed |= iou > iou_threshold
    return torch.tensor(keep, dtype=torch.long, device=dets.device)


def qnms_cpu(dets, scores, iou_threshold: float):
    """torchvision's quantized NMS: the same boxes, dequantized."""
    return nms_cpu(dets.dequantize(), scores.dequantize(), iou_threshold)


def define_missing_ops() -> list:
    """Define ``torchvision::nms`` / ``qnms`` where torchvision's extension did not; returns
    the ops defined here (none where the extension loaded)."""
    global _lib
    import torch

    defined = []
    for name, schema in _SCHEMAS.items():
        try:
            getattr(torch.ops.torchvision, name).default   # the extension defined it
            continue
        except (AttributeError, RuntimeError):
            pass
        if _lib is None:
            _lib = torch.library.Library("torchvision", "FRAGMENT")
        _lib.define(schema)
        if name == "nms":
            _lib.impl(name, nms_cpu, "CPU")
        else:
            _lib.impl(name, qnms_cpu, "QuantizedCPU")
        defined.append(name)
    return defined


def install() -> None:
    """Called from the SGLang venv's ``.pth`` file at interpreter start (cheap: no torch)."""
    if any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionFinder())


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    """Wraps torchvision's loader: after ``torchvision.extension`` (which loads ``_C`` when it
    can) and before ``_meta_registrations``, the missing op is defined."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision._meta_registrations":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                define_missing_ops()
                return spec
        return None
