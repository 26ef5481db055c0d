"""Model config -> workload: every (op, shape signature, dtype) the model's vLLM layers
call, with calls per forward step (the weights of workload-level figures).

The mapping follows vLLM's model code (see ../shared/research/models.md):
- Qwen3.5 / Qwen3-Next (``qwen3_5``, ``qwen3_next``): GemmaRMSNorm everywhere — layer 0's
  input norm without residual, every other layer norm and the final norm with it; q/k norms
  per head in the full-attention layers (every ``full_attention_interval``-th); interleaved
  3-section mrope there; RMSNormGated (per value head) in the gated-delta-net layers;
  SiluAndMul in every MLP.
- Qwen3 / Llama / Mistral / Qwen2: RMSNorm (fused-add form for all but the first), q/k
  RMSNorm per head for Qwen3, NeoX rotary_embedding, SiluAndMul.

``--tp N`` shards the way vLLM does: attention heads, KV heads (replicated, never below one
per rank), MLP intermediate size and linear-attention heads divide by N; norms over the
hidden size do not shard.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional

from ..ops import dtype_from_name
from ..ops.base import DTYPE_NAMES

# Built-in model profiles ship inside the package (fltune/profiles/*.json, package data), so a
# wheel install finds them as a source checkout does.
PROFILE_DIR = resources.files("fltune") / "profiles"


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class WorkItem:
    op: str
    dims: tuple            # sorted (key, value) pairs — hashable
    dtype: str             # 'bf16' | 'fp16' | 'fp32'
    calls: int             # calls per forward step
    where: str             # which layer calls it, for reports
    #: the largest token count this item ever runs at, when below the model's: the LM head
    #: multiplies only the sampled rows (one per request), so bands above the engine's
    #: request limit are never served (None: every band)
    max_tokens: Optional[int] = None

    @property
    def dims_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.dims}

    @property
    def signature(self) -> str:
        from ..ops import get_op
        return get_op(self.op).signature(dict(self.dims))


@dataclass
class Workload:
    model: str
    tp: int
    dtype: str
    items: list
    #: items of ops that are measured only when asked for (``--ops``) on this device:
    #: ``linear`` on CPU (``OPT_IN``), whose GEMMs at thousands of tokens cost minutes there
    opt_in: list = field(default_factory=list)

    def restrict(self, ops) -> None:
        """Keep only the items of ``ops`` (calibrate/bench ``--ops``), opt-in ops included.
        An op the model does not run is refused before any work, so a typo never yields a
        silent empty run."""
        pool = self.items + self.opt_in
        have = sorted({i.op for i in pool})
        unknown = sorted(set(ops) - set(have))
        if unknown:
            raise ModelConfigError(f"--ops {','.join(unknown)}: not in {self.model}'s "
                                   f"workload ({', '.join(have)}); nothing was written")
        self.items = [i for i in pool if i.op in ops]
        self.opt_in = []

    def as_dict(self):
        return {"model": self.model, "tp": self.tp, "dtype": self.dtype,
                "items": [{"op": i.op, "signature": i.signature, "dims": i.dims_dict,
                           "dtype": i.dtype, "calls": i.calls, "where": i.where}
                          for i in self.items]}


def known_profiles() -> list[str]:
    return sorted(p.name[:-len(".json")] for p in PROFILE_DIR.iterdir()
                  if p.name.endswith(".json") and p.is_file())


def profiles_running(keys) -> dict:
    """{(op, signature, dtype): [built-in profiles whose workload runs it, at tp 1]} for
    the ``keys`` asked about (an empty list where none does). Why: a winner whose
    calibration run is gone from the DB (a merged or an older DB's) names no model, so a
    hint that re-measures it has none to pass to ``--model``; the built-in profiles are
    the models fltune knows, and a signature is specific enough (widths, heads, eps) to
    name the one that runs it. Opt-in ops count (``linear``), on any device."""
    keys = set(keys)
    out: dict = {k: [] for k in keys}
    for name in known_profiles():
        for dt in sorted({k[2] for k in keys}):
            for key in _profile_signatures(name, dt) & keys:
                if name not in out[key]:
                    out[key].append(name)
    return out


@functools.lru_cache(maxsize=None)
def _profile_signatures(name: str, dtype: str) -> frozenset:
    """The (op, signature, dtype) a built-in profile's workload runs (opt-in ops too), once
    per process: freeze asks twice (the hint's commands, the unknown-stack warning). Read
    from the package's file, not by name: a ``./NAME/`` directory where fltune runs would
    shadow the built-in profile in ``load_config``."""
    try:
        work = derive(str(PROFILE_DIR / f"{name}.json"), dtype=dtype, device="cuda")
    except ModelConfigError:
        return frozenset()
    return frozenset((it.op, it.signature, it.dtype) for it in work.items + work.opt_in)


def load_config(model: str) -> tuple[str, dict]:
    """NAME (built-in profile), a directory with config.json, or a config.json path."""
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        src = str(p)
    elif model in known_profiles():
        p, src = PROFILE_DIR / f"{model}.json", model
    else:
        raise ModelConfigError(f"unknown model {model!r}: not a built-in profile, a directory "
                               f"with config.json, or a config file. Built-in profiles: "
                               f"{', '.join(known_profiles())}")
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{p}: not valid JSON ({e})") from None
    except OSError as e:
        raise ModelConfigError(f"{p}: cannot read the model config ({e.strerror or e})") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{p}: expected a JSON object")
    return src, cfg


def _int(cfg, key, where, default=None, minimum=1, maximum=1 << 20):
    v = cfg.get(key, default)
    if v is None:
        raise ModelConfigError(f"{where}: missing required key {key!r}")
    if (isinstance(v, bool) or not isinstance(v, (int, float))
            or (isinstance(v, float) and not math.isfinite(v)) or int(v) != v):
        raise ModelConfigError(f"{where}: {key} must be an integer, got {v!r}")
    v = int(v)
    if not minimum <= v <= maximum:
        raise ModelConfigError(f"{where}: {key}={v} is out of range [{minimum}, {maximum}]")
    return v


def _float(cfg, key, where, default, lo, hi):
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise ModelConfigError(f"{where}: {key} must be a number, got {v!r}")
    if not lo < float(v) <= hi:
        raise ModelConfigError(f"{where}: {key}={v} is out of range ({lo}, {hi}]")
    return float(v)


def _shard(n, tp, what, where):
    if n % tp and n > tp:
        raise ModelConfigError(f"{where}: {what}={n} is not divisible by --tp {tp}")
    return max(1, n // tp)


#: device type -> ops left out of the default workload there (still measured with ``--ops``):
#: on CPU a cold ``linear`` calibration of Qwen3.5-0.8B costs minutes (README, "linear")
#: and the gated delta net's bands cost minutes and gigabytes there (a decode batch of 2048
#: sequences carries 2048 states of 16x128x128; README, "Gated delta net")
OPT_IN = {"cpu": frozenset({"linear", "gdn_chunk_prefill", "gdn_decode"})}


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def derive(model: str, *, tp: int = 1, dtype: str | None = None,
           device: str | None = None) -> Workload:
    """The model's workload. ``device`` (default: CUDA if available, else CPU) decides
    which ops are opt-in (``OPT_IN``): their items go to ``Workload.opt_in``, and
    ``restrict(ops)`` brings them back when asked for."""
    src, cfg = load_config(model)
    where = src
    if not isinstance(tp, int) or tp < 1 or tp > 1024:
        raise ModelConfigError(f"--tp must be a positive integer, got {tp!r}")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    mtype = str(text.get("model_type") or cfg.get("model_type") or "")
    dt_name = dtype or text.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16"
    try:
        dt = DTYPE_NAMES[dtype_from_name(dt_name)]
    except ValueError as e:
        raise ModelConfigError(f"{where}: {e}") from None

    hidden = _int(text, "hidden_size", where)
    inter = _int(text, "intermediate_size", where)
    layers = _int(text, "num_hidden_layers", where, maximum=4096)
    heads = _int(text, "num_attention_heads", where)
    kv = _int(text, "num_key_value_heads", where, default=heads)
    head_dim = _int(text, "head_dim", where, default=hidden // heads if hidden % heads == 0 else None)
    eps = _float(text, "rms_norm_eps", where, 1e-6, 0.0, 0.5)
    h_tp, kv_tp = _shard(heads, tp, "num_attention_heads", where), _shard(kv, tp, "num_key_value_heads", where)
    i_tp = _shard(inter, tp, "intermediate_size", where)
    items: list[WorkItem] = []

    def add(op, calls, where_, max_tokens=None, **dims):
        if calls > 0:
            items.append(WorkItem(op, tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                   for k, v in dims.items())), dt, calls, where_,
                                  max_tokens))

    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelConfigError(f"{where}: rope_parameters must be an object, got {rope!r}")
    theta = _float(rope, "rope_theta", where, text.get("rope_theta", 10000.0), 0.0, 1e12)

    def rotary_dim(factor_src):
        rot = int(head_dim * _float(factor_src, "partial_rotary_factor", where,
                                    factor_src.get("partial_rotary_factor", 1.0), 0.0, 1.0))
        if rot < 2 or rot % 2:
            raise ModelConfigError(f"{where}: rotary dim {rot} (head_dim {head_dim} x "
                                   f"partial_rotary_factor) must be an even number >= 2")
        return rot
    max_pos = min(_int(text, "max_position_embeddings", where, default=8192, maximum=1 << 24), 8192)

    if mtype.startswith(("qwen3_5", "qwen3_next")):
        interval = _int(text, "full_attention_interval", where, default=4)
        n_full = layers // interval
        n_lin = layers - n_full
        rot = rotary_dim(rope if "partial_rotary_factor" in rope
                         else {"partial_rotary_factor": 0.25})
        section = rope.get("mrope_section") or []
        if section and (not isinstance(section, list) or len(section) != 3 or
                        not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                for x in section) or sum(section) != rot // 2):
            raise ModelConfigError(f"{where}: mrope_section {section!r} must be three positive "
                                   f"integers summing to rotary_dim/2 = {rot // 2}")
        lin_v = _shard(_int(text, "linear_num_value_heads", where), tp, "linear_num_value_heads", where)
        lin_dim = _int(text, "linear_value_head_dim", where)
        add("gemma_rms_norm", 1, "layer 0 input_layernorm", hidden=hidden, eps=eps)
        add("gemma_fused_add_rms_norm", 2 * layers, "input/post_attention layernorm, final norm",
            hidden=hidden, eps=eps)
        add("gemma_rms_norm", n_full, "q_norm (per head)", hidden=head_dim, rows_per_token=h_tp, eps=eps)
        add("gemma_rms_norm", n_full, "k_norm (per head)", hidden=head_dim, rows_per_token=kv_tp, eps=eps)
        if section:
            add("mrope", n_full, "full attention rope", heads=h_tp, kv_heads=kv_tp, head_size=head_dim,
                rotary_dim=rot, max_position=max_pos, base=theta, mrope_section=section,
                interleaved=bool(rope.get("mrope_interleaved", False)))
        else:
            # (Qwen3-Next: its q/k norms feed the rope as Qwen3's do; the lowering that sets
            # follows Inductor's rule, measured on Qwen3-0.6B, not on this model)
            add("rotary_embedding", n_full, "full attention rope", heads=h_tp, kv_heads=kv_tp,
                head_size=head_dim, rotary_dim=rot, max_position=max_pos, base=theta, is_neox=True,
                after_qk_norm=True)
        add("rms_norm_gated", n_lin, "gated delta net output norm", hidden=lin_dim,
            rows_per_token=lin_v, eps=eps, group_size=0, norm_before_gate=True)
        add("silu_and_mul", layers, "mlp act_fn", intermediate=i_tp)
        # gated delta net core (ops/gdn.py): key and value heads shard over tp, the head
        # dims do not; one prefill call and one decode call per linear-attention layer
        gdn = dict(num_k_heads=_shard(_int(text, "linear_num_key_heads", where), tp,
                                      "linear_num_key_heads", where),
                   num_v_heads=lin_v, head_k_dim=_int(text, "linear_key_head_dim", where),
                   head_v_dim=lin_dim)
        add("gdn_chunk_prefill", n_lin, "gated delta net prefill (chunk_gated_delta_rule)",
            seqs=1, **gdn)
        add("gdn_decode", n_lin, "gated delta net decode (packed recurrent step)",
            max_tokens=GDN_DECODE_MAX_SEQS, **gdn)
        # linear layers (vLLM qwen3_next.py / qwen3_5.py, layers/mamba/gdn/
        # qwen_gdn_linear_attn.py): column-parallel layers shard N, row-parallel ones K
        gate = 2 if text.get("attn_output_gate", True) else 1
        lin_k = _shard(_int(text, "linear_num_key_heads", where), tp, "linear_num_key_heads", where)
        lin_kdim = _int(text, "linear_key_head_dim", where)
        lin_out = lin_v * lin_dim
        _add_linear(add, [
            ("qkv_proj (full attention, q with its output gate)", n_full,
             (h_tp * gate + 2 * kv_tp) * head_dim, hidden, bool(text.get("qkv_bias", False))),
            ("o_proj (full attention)", n_full, hidden, h_tp * head_dim, False),
            ("in_proj_qkvz (gated delta net)", n_lin, 2 * lin_k * lin_kdim + 2 * lin_out,
             hidden, False),
            ("in_proj_ba (gated delta net)", n_lin, 2 * lin_v, hidden, False),
            ("out_proj (gated delta net)", n_lin, hidden, lin_out, False),
            ("gate_up_proj (mlp)", layers, 2 * i_tp, hidden, False),
            ("down_proj (mlp)", layers, hidden, i_tp, False),
        ])
    elif mtype in ("qwen3", "qwen2", "llama", "mistral"):
        add("rms_norm", 1, "layer 0 input_layernorm", hidden=hidden, eps=eps)
        add("fused_add_rms_norm", 2 * layers, "input/post_attention layernorm, final norm",
            hidden=hidden, eps=eps)
        if mtype == "qwen3":
            add("rms_norm", layers, "q_norm (per head)", hidden=head_dim, rows_per_token=h_tp, eps=eps)
            add("rms_norm", layers, "k_norm (per head)", hidden=head_dim, rows_per_token=kv_tp, eps=eps)
        rot = rotary_dim(text)
        # Qwen3's q/k norms feed the rope: vLLM's compile then lowers the rope's cat
        # differently (``native.vllm``); a context dim, outside the rope's signature
        add("rotary_embedding", layers, "attention rope", heads=h_tp, kv_heads=kv_tp, head_size=head_dim,
            rotary_dim=rot, max_position=max_pos, base=theta, is_neox=True,
            **({"after_qk_norm": True} if mtype == "qwen3" else {}))
        act = str(text.get("hidden_act", "silu"))
        op = {"silu": "silu_and_mul", "gelu": "gelu_and_mul",
              "gelu_pytorch_tanh": "gelu_tanh_and_mul"}.get(act)
        if op is None:
            raise ModelConfigError(f"{where}: hidden_act {act!r} is not supported (silu, gelu, "
                                   f"gelu_pytorch_tanh)")
        add(op, layers, "mlp act_fn", intermediate=i_tp)
        # linear layers (vLLM qwen3.py / qwen2.py / llama.py): qkv bias on Qwen2 always,
        # else attention_bias (Llama's o_proj too); Llama's MLP bias is mlp_bias
        qkv_bias = mtype == "qwen2" or bool(text.get("attention_bias", False))
        o_bias = mtype in ("llama", "mistral") and bool(text.get("attention_bias", False))
        mlp_bias = bool(text.get("mlp_bias", False))
        _add_linear(add, [
            ("qkv_proj", layers, (h_tp + 2 * kv_tp) * head_dim, hidden, qkv_bias),
            ("o_proj", layers, hidden, h_tp * head_dim, o_bias),
            ("gate_up_proj (mlp)", layers, 2 * i_tp, hidden, mlp_bias),
            ("down_proj (mlp)", layers, hidden, i_tp, mlp_bias),
        ])
    else:
        raise ModelConfigError(f"{where}: model_type {mtype!r} is not supported yet; supported: "
                               f"qwen3_5, qwen3_next, qwen3, qwen2, llama, mistral")
    later = OPT_IN.get(device or _default_device(), frozenset())
    return Workload(model=src, tp=tp, dtype=dt, items=[i for i in items if i.op not in later],
                    opt_in=[i for i in items if i.op in later])


#: the most sequences one decode step of vLLM 0.24 carries by its defaults
#: (``max_num_seqs``: 1024 for the OpenAI server on a large GPU, 256 for ``LLM``): a
#: ``gdn_decode`` call takes one token per sequence, so its bands stop there. On the H200
#: (session 12) the 4096-sequence band made every kernel raise a CUDA "invalid argument"
#: and the 8192 one needed 81 GiB: measured at sizes no step of vLLM reaches.
GDN_DECODE_MAX_SEQS = 1024


def _add_linear(add, layers_) -> None:
    """One ``linear`` item per distinct (N, K, bias), calls summed over the layers that
    share it (o_proj and the GDN out_proj of Qwen3.5 are both 1024x2048), their names
    joined: the calibration measures a shape once, weighted by every call of it.

    The LM head is not among them: vLLM computes the logits outside the model's CUDA
    graphs, eagerly, once per step, so a routed LM head pays fltune's custom op and the
    pick's launch on the host at every step. On the H200 (session 6,
    ``benchmarks/results/h200-2026-12-01-s6``) that was 78-126 µs of host time per call
    against cuBLAS's 22, for at most 9 µs less GPU time (Qwen3.5-0.8B, 248320 x 1024),
    in decode steps whose wall time the host sets."""
    merged: dict = {}
    for where_, calls, n, k, bias in layers_:
        if calls <= 0 or n is None:
            continue
        key = (n, k, bias)
        w0, c0 = merged.get(key, ("", 0))
        merged[key] = (f"{w0}, {where_}" if w0 else where_, c0 + calls)
    for (n, k, bias), (where_, calls) in merged.items():
        add("linear", calls, where_, n=n, k=k, bias=bias)
