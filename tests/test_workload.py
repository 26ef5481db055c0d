"""Model config -> workload: the ops and shapes vLLM's layers call, per-rank shapes under
tensor parallelism, built-in profiles and config directories, and hostile configs that
must give ModelConfigError (with a property test over random configs)."""
from __future__ import annotations

import copy
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, REPO
from fltune.ops import OPS, get_op
from fltune.tune.workload import (PROFILE_DIR, ModelConfigError, Workload, derive,
                                  known_profiles, load_config)

QWEN35 = "Qwen3.5-0.8B"


def _items(w: Workload) -> dict:
    """(op, where) -> (dims dict, calls)"""
    return {(i.op, i.where): (i.dims_dict, i.calls) for i in w.items}


def _profile(name) -> dict:
    return json.loads((PROFILE_DIR / f"{name}.json").read_text())


def _write(dirpath: Path, cfg) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    p = dirpath / "config.json"
    p.write_text(json.dumps(cfg))
    return dirpath


# ---- Qwen3.5-0.8B ----------------------------------------------------------------------

def test_qwen35_08b_workload():
    w = derive(QWEN35)
    assert w.model == QWEN35 and w.tp == 1 and w.dtype == "bf16"
    it = _items(w)
    assert it[("gemma_rms_norm", "layer 0 input_layernorm")] == (
        {"eps": 1e-6, "hidden": 1024}, 1)
    assert it[("gemma_fused_add_rms_norm", "input/post_attention layernorm, final norm")] == (
        {"eps": 1e-6, "hidden": 1024}, 48)
    # 24 layers, every 4th full attention -> 6 full, 18 linear-attention layers
    assert it[("gemma_rms_norm", "q_norm (per head)")] == (
        {"eps": 1e-6, "hidden": 256, "rows_per_token": 8}, 6)
    assert it[("gemma_rms_norm", "k_norm (per head)")] == (
        {"eps": 1e-6, "hidden": 256, "rows_per_token": 2}, 6)
    assert it[("mrope", "full attention rope")] == (
        {"heads": 8, "kv_heads": 2, "head_size": 256, "rotary_dim": 64, "max_position": 8192,
         "base": 1e7, "mrope_section": [11, 11, 10], "interleaved": True}, 6)
    assert it[("rms_norm_gated", "gated delta net output norm")] == (
        {"eps": 1e-6, "hidden": 128, "rows_per_token": 16, "group_size": 0,
         "norm_before_gate": True}, 18)
    assert it[("silu_and_mul", "mlp act_fn")] == ({"intermediate": 3584}, 24)
    assert len(w.items) == 7
    assert {i.op for i in w.items} == {"gemma_rms_norm", "gemma_fused_add_rms_norm", "mrope",
                                       "rms_norm_gated", "silu_and_mul"}


def test_qwen35_default_dims_are_the_workload_shapes():
    """The ops' default dims claim to be Qwen3.5-0.8B's; hold them to it."""
    it = _items(derive(QWEN35))
    for (op, _), (dims, _) in it.items():
        default = {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in get_op(op).default_dims.items()}
        if op == "gemma_rms_norm" and "rows_per_token" in dims:
            continue                                  # the per-head q/k norms
        assert {k: default[k] for k in dims} == dims, op


def test_tp2_halves_heads_and_intermediate():
    one, two = _items(derive(QWEN35)), _items(derive(QWEN35, tp=2))
    assert two[("silu_and_mul", "mlp act_fn")][0] == {"intermediate": 1792}
    assert two[("gemma_rms_norm", "q_norm (per head)")][0]["rows_per_token"] == 4
    assert two[("gemma_rms_norm", "k_norm (per head)")][0]["rows_per_token"] == 1
    rope = two[("mrope", "full attention rope")][0]
    assert (rope["heads"], rope["kv_heads"], rope["head_size"], rope["rotary_dim"]) == (4, 1, 256, 64)
    assert two[("rms_norm_gated", "gated delta net output norm")][0]["rows_per_token"] == 8
    # norms over the hidden size do not shard; calls per step do not change
    for key in (("gemma_rms_norm", "layer 0 input_layernorm"),
                ("gemma_fused_add_rms_norm", "input/post_attention layernorm, final norm")):
        assert two[key] == one[key]
    assert {k: v[1] for k, v in two.items()} == {k: v[1] for k, v in one.items()}


def test_tp_beyond_kv_heads_replicates_kv():
    rope = _items(derive(QWEN35, tp=4))[("mrope", "full attention rope")][0]
    assert rope["heads"] == 2 and rope["kv_heads"] == 1          # never below one per rank


@pytest.mark.parametrize("tp", [0, -2, 3, 1025, "2"])
def test_bad_tp(tp):
    with pytest.raises(ModelConfigError):
        derive(QWEN35, tp=tp)


def test_dtype_override_and_bad_dtype():
    assert {i.dtype for i in derive(QWEN35, dtype="fp16").items} == {"fp16"}
    assert derive(QWEN35, dtype="float32").dtype == "fp32"
    with pytest.raises(ModelConfigError, match="unknown dtype"):
        derive(QWEN35, dtype="int8")


def test_unknown_model_lists_profiles():
    with pytest.raises(ModelConfigError) as e:
        derive("Qwen9-1T")
    msg = str(e.value)
    assert "Qwen9-1T" in msg
    names = sorted(p.stem for p in (REPO / "fltune" / "profiles").glob("*.json"))
    assert names == known_profiles()
    # README lists the built-in names; the list stays in step with the package data
    readme = (REPO / "README.md").read_text()
    listed = readme.split("Built-in model profiles (", 1)[1].split("):", 1)[1].split(".\n", 1)[0]
    assert sorted(n.strip() for n in listed.split(",")) == names
    assert {"Qwen3.5-0.8B", "Qwen3.5-4B", "Qwen3.5-9B"} <= set(names) and len(names) >= 5
    for name in names:
        assert name in msg


@pytest.mark.parametrize("name", known_profiles())
def test_every_profile_derives_runnable_items(name):
    """Every built-in profile gives a workload whose dims the op contracts accept: inputs
    can be made and the reference runs on them."""
    for tp in (1, 2):
        w = derive(name, tp=tp)
        assert w.items and all(i.calls > 0 and i.op in OPS for i in w.items)
        for item in w.items:
            spec = get_op(item.op)
            args = spec.make_inputs(2, item.dims_dict, torch.float32, "cpu",
                                    torch.Generator().manual_seed(0))
            spec.reference(*args)
            assert item.signature == spec.signature(dict(item.dims))


# ---- config directories and files ------------------------------------------------------

def test_config_dir_with_nested_text_config(tmp_path):
    cfg = _profile(QWEN35)
    assert "text_config" in cfg
    d = _write(tmp_path / "Qwen3.5-0.8B-local", cfg)
    from_dir, from_file = derive(str(d)), derive(str(d / "config.json"))
    assert from_dir.model == str(d / "config.json")
    assert from_dir.items == from_file.items == derive(QWEN35).items


def test_flat_config_and_fixture_dir():
    w = derive(str(FIXTURES / "tiny_qwen3"))
    it = _items(w)
    assert it[("rms_norm", "layer 0 input_layernorm")] == ({"eps": 1e-6, "hidden": 64}, 1)
    assert it[("fused_add_rms_norm", "input/post_attention layernorm, final norm")][1] == 4
    assert it[("rms_norm", "q_norm (per head)")][0] == {"eps": 1e-6, "hidden": 32,
                                                       "rows_per_token": 4}
    assert it[("rms_norm", "k_norm (per head)")][0]["rows_per_token"] == 2
    rope = it[("rotary_embedding", "attention rope")][0]
    assert rope["rotary_dim"] == rope["head_size"] == 32 and rope["is_neox"] is True
    assert it[("silu_and_mul", "mlp act_fn")] == ({"intermediate": 128}, 2)
    # Qwen3's q/k norms feed its rope: a context dim for native.vllm, not in the signature
    assert rope["after_qk_norm"] is True
    (item,) = [i for i in w.items if i.op == "rotary_embedding"]
    assert "after_qk_norm" not in item.signature and "rotary_dim=32" in item.signature


def test_qwen3_next_rope_follows_its_qk_norms(tmp_path):
    cfg = _profile(QWEN35)
    cfg.get("text_config", cfg).get("rope_parameters", {}).pop("mrope_section", None)
    cfg["model_type"] = "qwen3_next"
    items = derive(str(_write(tmp_path / "m", cfg))).items
    (rope,) = [i for i in items if i.op in ("rotary_embedding", "mrope")]
    assert rope.op == "rotary_embedding" and rope.dims_dict["after_qk_norm"] is True


def test_a_rope_without_qk_norms_has_no_after_qk_norm(tmp_path):
    cfg = _profile("tiny-qwen3")
    cfg["model_type"] = "qwen2"
    (item,) = [i for i in derive(str(_write(tmp_path / "m", cfg))).items
               if i.op == "rotary_embedding"]
    assert "after_qk_norm" not in item.dims_dict


def test_text_config_values_win_over_top_level(tmp_path):
    cfg = _profile(QWEN35)
    cfg["hidden_size"] = 4096                    # a top-level decoy (vision tower etc.)
    cfg["torch_dtype"] = "float32"
    w = derive(str(_write(tmp_path / "m", cfg)))
    assert _items(w)[("gemma_rms_norm", "layer 0 input_layernorm")][0]["hidden"] == 1024
    assert w.dtype == "bf16"


def test_llama_style_and_activation(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
           "hidden_act": "gelu_pytorch_tanh", "torch_dtype": "float16"}
    w = derive(str(_write(tmp_path / "llama", cfg)))
    it = _items(w)
    assert w.dtype == "fp16"
    assert it[("gelu_tanh_and_mul", "mlp act_fn")] == ({"intermediate": 512}, 3)
    assert it[("rotary_embedding", "attention rope")][0]["head_size"] == 32   # 256 / 8
    assert not any(op == "rms_norm" and "q_norm" in where for op, where in it)
    cfg["hidden_act"] = "relu2"
    with pytest.raises(ModelConfigError, match="hidden_act 'relu2'"):
        derive(str(_write(tmp_path / "relu", cfg)))


# ---- hostile configs -------------------------------------------------------------------

def _qwen35_with(**changes):
    cfg = _profile(QWEN35)
    tc = cfg["text_config"]
    for k, v in changes.items():
        if v is _DROP:
            tc.pop(k, None)
        else:
            tc[k] = v
    return cfg


_DROP = object()


@pytest.mark.parametrize("changes,match", [
    ({"hidden_size": _DROP}, "missing required key 'hidden_size'"),
    ({"intermediate_size": _DROP}, "intermediate_size"),
    ({"num_hidden_layers": _DROP}, "num_hidden_layers"),
    ({"linear_num_value_heads": _DROP}, "linear_num_value_heads"),
    ({"hidden_size": 0}, "out of range"),
    ({"intermediate_size": -3584}, "out of range"),
    ({"num_attention_heads": 0}, "out of range"),
    ({"num_key_value_heads": -1}, "out of range"),
    ({"hidden_size": 10**12}, "out of range"),
    ({"num_hidden_layers": 10**9}, "out of range"),
    ({"head_dim": 2**40}, "out of range"),
    ({"hidden_size": 1024.5}, "must be an integer"),
    ({"hidden_size": "1024"}, "must be an integer"),
    ({"num_hidden_layers": True}, "must be an integer"),
    ({"intermediate_size": None}, "missing required key"),
    ({"intermediate_size": [3584]}, "must be an integer"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rms_norm_eps": 2.0}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ({"full_attention_interval": 0}, "full_attention_interval"),
    ({"model_type": "mamba"}, "model_type 'mamba' is not supported"),
    ({"torch_dtype": "int4"}, "unknown dtype"),
])
def test_hostile_config_values(tmp_path, changes, match):
    cfg = _qwen35_with(**changes)
    cfg.pop("torch_dtype", None)           # so a text_config torch_dtype change is what counts
    with pytest.raises(ModelConfigError, match=match) as e:
        derive(str(_write(tmp_path / "m", cfg)))
    assert "config.json" in str(e.value)             # names the file


def test_head_dim_not_derivable(tmp_path):
    cfg = {"model_type": "qwen3", "hidden_size": 100, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 3}
    with pytest.raises(ModelConfigError, match="head_dim"):
        derive(str(_write(tmp_path / "m", cfg)))


def test_tp_must_divide(tmp_path):
    with pytest.raises(ModelConfigError, match="num_attention_heads=8 is not divisible by --tp 3"):
        derive(QWEN35, tp=3)
    cfg = _profile("tiny-qwen3")
    cfg["intermediate_size"] = 130
    with pytest.raises(ModelConfigError, match="intermediate_size=130"):
        derive(str(_write(tmp_path / "m", cfg)), tp=4)


@pytest.mark.parametrize("content,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2, 3]", "expected a JSON object"),
    ("\"qwen\"", "expected a JSON object"),
    ("{}", "missing required key 'hidden_size'"),
])
def test_not_a_config(tmp_path, content, match):
    p = tmp_path / "config.json"
    p.write_text(content)
    with pytest.raises(ModelConfigError, match=match):
        derive(str(tmp_path))
    with pytest.raises(ModelConfigError, match=match):
        derive(str(p))


def test_empty_dir_is_unknown_model(tmp_path):
    with pytest.raises(ModelConfigError, match="unknown model"):
        derive(str(tmp_path))


# Bugs found: these hostile values escape as other exception types or give an invalid
# workload. Each is a deterministic repro of one defect in fltune/tune/workload.py.
@pytest.mark.parametrize("where,key,value", [
    ("text", "rms_norm_eps", "tiny"),
    ("text", "rms_norm_eps", [1e-6]),
    ("rope", "rope_theta", "ten million"),
    ("rope", "partial_rotary_factor", None),
])
def test_non_numeric_float_fields(tmp_path, where, key, value):
    cfg = _profile(QWEN35)
    (cfg["text_config"] if where == "text" else cfg["text_config"]["rope_parameters"])[key] = value
    with pytest.raises(ModelConfigError):
        derive(str(_write(tmp_path / "m", cfg)))


def test_rope_parameters_not_a_mapping(tmp_path):
    cfg = _profile(QWEN35)
    cfg["text_config"]["rope_parameters"] = "default"
    with pytest.raises(ModelConfigError):
        derive(str(_write(tmp_path / "m", cfg)))


@pytest.mark.parametrize("rope_change", [
    {"partial_rotary_factor": 0},
    {"partial_rotary_factor": 4},
    {"mrope_section": [100, -3, 1]},
    {"mrope_section": [11, 11, "10"]},
])
def test_invalid_rotary_geometry_rejected(tmp_path, rope_change):
    cfg = _profile(QWEN35)
    cfg["text_config"]["rope_parameters"].update(rope_change)
    with pytest.raises(ModelConfigError):
        derive(str(_write(tmp_path / "m", cfg)))


# ---- property: derive() returns a valid workload or raises ModelConfigError ------------

#: the integer facts derive() validates (head_dim is exercised separately below: it also
#: drives the rotary geometry, which derive() does not validate yet)
INT_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "full_attention_interval", "linear_num_value_heads",
            "linear_value_head_dim", "max_position_embeddings"]

hostile_value = st.one_of(
    st.integers(min_value=-(2**31), max_value=2**31),
    st.integers(min_value=-4, max_value=4096),
    st.sampled_from([0, 1, 2, 3, 7, 8, 16, 2**20, 2**20 + 1, 2**24]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1.0, 8.0, 0.5, 64.0]),
    st.booleans(), st.none(), st.text(max_size=4), st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
)

_BASES = [_profile(QWEN35), _profile("tiny-qwen3"), _profile("Llama-3.1-8B")]
_DROP_KEY = "__drop__"


def _assert_positive(w: Workload, tp):
    """The brief's validity: a well-formed workload whose dims are all positive."""
    assert isinstance(w, Workload) and w.tp == tp and w.dtype in ("bf16", "fp16", "fp32")
    assert w.items
    for item in w.items:
        assert item.op in OPS and item.calls > 0 and item.dtype == w.dtype
        for k, v in item.dims_dict.items():
            if k == "eps":
                assert 0 < v < 1
            elif k == "base":
                assert math.isfinite(v) and v > 0
            elif isinstance(v, bool):
                continue
            elif isinstance(v, int):
                assert v > 0 or (k == "group_size" and v == 0), (item.op, k, v)


def _assert_runnable(w: Workload):
    """Stricter: the rotary geometry is consistent and every op runs on these dims."""
    for item in w.items:
        dims = item.dims_dict
        if "rotary_dim" in dims:
            assert 0 < dims["rotary_dim"] <= dims["head_size"] and dims["rotary_dim"] % 2 == 0
        if "mrope_section" in dims:
            assert all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                       for x in dims["mrope_section"])
            assert sum(dims["mrope_section"]) == dims["rotary_dim"] // 2
        spec = get_op(item.op)
        small = {**dims, "max_position": min(dims.get("max_position", 64), 64)} \
            if "max_position" in dims else dims
        spec.reference(*spec.make_inputs(1, small, torch.float32, "cpu",
                                         torch.Generator().manual_seed(0)))


def _derive_cfg(cfg, tp=1):
    with tempfile.TemporaryDirectory() as d:
        _write(Path(d), cfg)
        return derive(d, tp=tp)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(range(len(_BASES))),
       changes=st.dictionaries(st.sampled_from(INT_KEYS),
                               st.one_of(st.just(_DROP_KEY), hostile_value), max_size=4),
       model_type=st.sampled_from([None, "qwen3_5_text", "qwen3_next", "qwen3", "qwen2",
                                   "llama", "mistral", "gpt2", ""]),
       tp=st.sampled_from([1, 2, 4, 8]))
@example(base=0, changes={"hidden_size": 0}, model_type=None, tp=1)
@example(base=1, changes={"num_attention_heads": 3}, model_type="llama", tp=1)
@example(base=0, changes={"linear_num_value_heads": 2**20 + 1}, model_type=None, tp=2)
@example(base=2, changes={"num_key_value_heads": _DROP_KEY}, model_type=None, tp=8)
def test_property_derive_valid_or_model_config_error(base, changes, model_type, tp):
    cfg = copy.deepcopy(_BASES[base])
    text = cfg["text_config"] if "text_config" in cfg else cfg
    for k, v in changes.items():
        if isinstance(v, str) and v == _DROP_KEY:
            text.pop(k, None)
        else:
            text[k] = v
    if model_type is not None:
        text["model_type"] = model_type
        cfg["model_type"] = model_type
    try:
        w = _derive_cfg(cfg, tp)
    except ModelConfigError as e:
        assert str(e)
        return
    _assert_positive(w, tp)


@settings(max_examples=100, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(head_dim=st.one_of(st.just(_DROP_KEY), hostile_value),
       eps=st.one_of(st.just(_DROP_KEY), hostile_value),
       rope=st.one_of(st.just(_DROP_KEY), hostile_value,
                      st.fixed_dictionaries({}, optional={
                          "rope_theta": hostile_value,
                          "partial_rotary_factor": hostile_value,
                          "mrope_section": st.one_of(hostile_value,
                                                     st.lists(hostile_value, max_size=4))})))
@example(head_dim=2, eps=_DROP_KEY, rope=_DROP_KEY)
def test_property_head_dim_eps_and_rope_fields(head_dim, eps, rope):
    cfg = _profile(QWEN35)
    text = cfg["text_config"]
    for key, v in (("head_dim", head_dim), ("rms_norm_eps", eps), ("rope_parameters", rope)):
        if isinstance(v, str) and v == _DROP_KEY:
            text.pop(key, None)
        else:
            text[key] = v
    try:
        w = _derive_cfg(cfg)
    except ModelConfigError:
        return
    _assert_positive(w, 1)
    _assert_runnable(w)


def test_profiles_running_names_the_built_in_model_of_a_signature():
    """A winner without its run is traced back to the built-in profile whose workload runs
    its (op, signature, dtype), GEMMs (opt-in on CPU) included, at the dtype asked (the
    hint passes it as ``--dtype``); a signature no profile runs names none."""
    from fltune.tune.workload import derive, profiles_running

    work = derive("Qwen3-0.6B", device="cuda")
    rope = next(i for i in work.items if i.op == "rotary_embedding")
    gemm = next(i for i in work.items + work.opt_in if i.op == "linear")
    keys = {(rope.op, rope.signature, rope.dtype), (gemm.op, gemm.signature, gemm.dtype),
            ("silu_and_mul", "intermediate=7", "bf16"), (rope.op, rope.signature, "fp32")}
    found = profiles_running(keys)
    assert found[(rope.op, rope.signature, rope.dtype)] == ["Qwen3-0.6B"]
    assert "Qwen3-0.6B" in found[(gemm.op, gemm.signature, gemm.dtype)]
    assert found[("silu_and_mul", "intermediate=7", "bf16")] == []
    assert "Qwen3-0.6B" in found[(rope.op, rope.signature, "fp32")]   # derived at that dtype
