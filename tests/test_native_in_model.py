"""``benchmarks/native_in_model.py``'s attribution, which the README's native.vllm table rests
on: which of the model's kernels hold an op. No GPU: the profiles are written out here in
the shape the script records them (name -> [calls per step, µs per step])."""
from __future__ import annotations

import io
import os
import sys
import tarfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import native_in_model as nim  # noqa: E402

COPY = "triton_poi_fused__to_copy__unsafe_view_add_clone_mean_mm_mul_pow_rsqrt_silu_t_view_2"


def _doc(model_kernels, launches=None):
    row = {"op": "rms_norm_gated", "signature": "s", "scenario": "decode_b1", "tokens": 1,
           "calls_per_step": 18, "timed": {"native.vllm": 2.0},
           "kernels": {"native.vllm": {"triton_per_fused_0": [1.0, 1.5]}}}
    sc = {"tokens": 1, "kernels": model_kernels}
    if launches is not None:
        sc["kernel_launches"] = launches
    return {"alone": {"rows": [row]}, "in_model": {"scenarios": {"decode_b1": sc}}}


def test_the_gated_norm_is_the_unnamed_reduction_not_the_named_copy():
    """vLLM's generated code holds the gated norm in an unnamed persistent reduction; the
    kernel named after it is the copy into out_proj's layout. One name serves another norm
    once per step: its time is shared by call count without launch shapes..."""
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [19.0, 38.0],
                "triton_poi_fused_mul_silu_slice_4": [18.0, 20.0]})
    (e,) = nim.attribute(doc)
    assert e["model_kernels"] == ["triton_per_fused_1"]
    assert e["in_model_us"] == 2.0 and e["in_model_copy_us"] == 1.0
    assert e["kernel_vs_model"] == 0.75


def test_with_launch_shapes_the_gated_norm_is_the_launch_counted_as_often_as_the_copy():
    """...and exactly with them: the launch of that name made as often as the copy."""
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [19.0, 38.0]},
               launches={"triton_per_fused_1 grid=[1, 1, 1] block=[128, 1, 1]": [18.0, 27.0],
                         "triton_per_fused_1 grid=[1, 1, 1] block=[512, 1, 1]": [1.0, 11.0],
                         COPY + " grid=[1, 1, 1] block=[256, 1, 1]": [18.0, 18.0]})
    (e,) = nim.attribute(doc)
    assert e["in_model_us"] == 1.5 and e["kernel_vs_model"] == 1.0


def test_code_origins_reads_what_each_generated_kernel_holds(tmp_path):
    q3 = "'" * 3
    module = ("# kernel path: /x.py\n"
              "# Topologically Sorted Source Nodes: [silu, mul], Original ATen: [aten.silu, aten.mul]\n"
              f"triton_poi_fused_mul_silu_0 = async_compile.triton('triton_poi_fused_mul_silu_0', {q3}\n"
              "@triton_heuristics.pointwise(\n    size_hints={'x': 8388608}, \n"
              f"{q3}, device_str='cuda')\n"
              "# Unsorted Source Nodes: [], Original ATen: []\n"
              f"triton_per_fused_1 = async_compile.triton('triton_per_fused_1', {q3}\n"
              "@triton_heuristics.persistent_reduction(\n    size_hints={'x': 131072, 'r0_': 128},\n"
              f"{q3}, device_str='cuda')\n")
    tgz = tmp_path / "code.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        data = module.encode()
        info = tarfile.TarInfo("inductor_cache/ab/cab.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    got = nim.code_origins(str(tgz))
    (silu,) = got["triton_poi_fused_mul_silu_0"]
    assert silu["aten"] == "aten.silu, aten.mul" and silu["heuristic"] == "pointwise"
    assert silu["size_hints"] == "{'x': 8388608}"
    (red,) = got["triton_per_fused_1"]
    assert red["nodes"] == "" and red["heuristic"] == "persistent_reduction"
    assert "131072" in red["size_hints"]


def test_in_context_column_compares_the_candidate_after_its_producer_with_the_model():
    """The in-context profile's kernels (its bookkeeping keys aside) are summed like the warm
    ones and set against the model's time per call."""
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [18.0, 36.0]})
    doc["alone"]["rows"][0]["kernels_in_context"] = {
        "native.vllm": {"triton_per_fused_0": [1.0, 1.8], "captured": True,
                        "producer_weight_mib": 64.0}}
    (e,) = nim.attribute(doc)
    assert e["native_kernel_in_context_us"] == 1.8
    assert e["in_context_vs_model"] == 0.9 and e["kernel_vs_model"] == 0.75
    doc["alone"]["rows"][0]["kernels_in_context"] = {"native.vllm": {"raised": "OOM"}}
    (e,) = nim.attribute(doc)
    assert e["native_kernel_in_context_us"] is None and "in_context_vs_model" not in e
    assert e["native_kernel_in_step_us"] is None and "in_step_vs_model" not in e
    # the in-step profile (the step's cache state) gets a column of its own
    doc["alone"]["rows"][0]["kernels_in_step"] = {
        "native.vllm": {"triton_per_fused_0": [1.0, 2.2], "captured": True, "step": True}}
    (e,) = nim.attribute(doc)
    assert e["native_kernel_in_step_us"] == 2.2 and e["in_step_vs_model"] == 1.1


def test_producers_write_each_token_input_with_a_gemm_rotating_through_more_than_l2():
    """What the in-context profile runs before each call: every token-sized floating input
    (not the weight, not the scalars) rewritten as ``src @ W_i``, a fresh weight each round
    until the copies together exceed the byte budget, contiguous or not."""
    import torch
    from fltune.ops import OPS

    spec = OPS["gemma_fused_add_rms_norm"]
    args = spec.make_inputs(4, {"hidden": 64, "eps": 1e-6}, torch.float32, "cpu",
                            torch.Generator().manual_seed(0))
    weight = args[2].clone()
    budget = 1 << 20
    prod = nim.producers(args, "gemma_fused_add_rms_norm", k=32, weight_bytes=budget)
    one = 32 * 64 * 4                            # one [k, hidden] fp32 weight
    assert prod.weights == [budget // one, budget // one]   # x and residual, not the weight
    assert prod.weight_bytes >= 2 * budget
    prod(0)
    x0 = args[0].clone()
    prod(1)
    assert not torch.equal(args[0], x0)          # another weight, another product
    prod(prod.weights[0])                         # the rotation comes back round
    assert torch.equal(args[0], x0)
    assert torch.equal(args[2], weight)
    assert args[0].abs().mean() < 3               # activation-sized, not K-sized
    # a strided input gets the product copied in, its neighbours untouched
    buf = torch.full((4, 96), 7.0)
    strided = [buf[:, :64], args[1], args[2], args[3]]
    nim.producers(strided, "gemma_fused_add_rms_norm", k=32, weight_bytes=budget)(0)
    assert torch.equal(buf[:, :64], x0) and bool((buf[:, 64:] == 7.0).all())
    # the in-step rounds write the first input only: the residual stays as it was (read
    # cold in the model, a layer after it was written)
    res = args[1].clone()
    first = nim.producers(args, "gemma_fused_add_rms_norm", k=32, weight_bytes=budget,
                          first_only=True)
    assert first.weights == [budget // one]
    first(3)
    assert torch.equal(args[1], res) and not torch.equal(args[0], x0)


def test_launch_configurations_of_both_sides_are_set_side_by_side():
    """Where the candidate's launches were recorded too, the attributed model kernel's launch
    shapes and the candidate's are listed together (only the attributed kernel's)."""
    launch = "triton_per_fused_1 grid=[1, 1, 1] block=[128, 1, 1]"
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [18.0, 36.0]},
               launches={launch: [18.0, 36.0], COPY + " grid=[2, 1, 1] block=[256, 1, 1]":
                         [18.0, 18.0]})
    (e,) = nim.attribute(doc)
    assert "launches" not in e                   # the candidate's were not recorded
    doc["alone"]["rows"][0]["kernel_launches"] = {
        "native.vllm": {"triton_per_fused_0 grid=[1, 1, 1] block=[64, 1, 1]": [1.0, 1.5]}}
    (e,) = nim.attribute(doc)
    assert e["launches"] == {"model": [launch], "native.vllm": [
        "triton_per_fused_0 grid=[1, 1, 1] block=[64, 1, 1]"]}


def test_in_context_skips_an_op_with_nothing_for_a_gemm_to_write_and_never_reads_zero():
    """No 2-D token input: no producer, so no in-context figure (said, not a bare profile of
    the call alone); and a profile in which none of the candidate's kernels showed up is no
    figure either, not 0 µs."""
    import torch

    got = nim.in_context(lambda: None, [torch.zeros(3)], "silu_and_mul", set())
    assert "skipped" in got and "silu_and_mul" in got["skipped"]
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [18.0, 36.0]})
    doc["alone"]["rows"][0]["kernels_in_context"] = {
        "native.vllm": {"captured": False, "producer_weight_mib": 64.0, "rounds": 128}}
    (e,) = nim.attribute(doc)
    assert e["native_kernel_in_context_us"] is None and e["in_context_captured"] is False


def test_the_in_context_ranking_says_when_the_context_reorders_the_candidates():
    """Two candidates: faster back to back is not always faster after the producer GEMM;
    the ranking lists them by the in-context figure and flags the change. A candidate
    whose in-context profile raised is left out, and one candidate alone is no ranking."""
    row = {"op": "silu_and_mul", "signature": "s", "scenario": "decode_b1",
           "kernels": {"a": {"k_a": [1.0, 1.0]}, "b": {"k_b": [1.0, 1.2]},
                       "c": {"k_c": [1.0, 0.5]}},
           "kernels_in_context": {"a": {"k_a": [1.0, 1.6], "captured": True},
                                  "b": {"k_b": [1.0, 1.3], "captured": True},
                                  "c": {"raised": "boom"}}}
    (r,) = nim.in_context_ranking({"alone": {"rows": [row]}})
    assert [c["impl"] for c in r["candidates"]] == ["b", "a"] and r["reordered"] is True
    assert r["candidates"][0] == {"impl": "b", "warm_us": 1.2, "in_context_us": 1.3}
    row["kernels_in_context"]["a"]["k_a"] = [1.0, 1.25]
    (r,) = nim.in_context_ranking({"alone": {"rows": [row]}})
    assert r["reordered"] is False
    del row["kernels_in_context"]["b"]
    assert nim.in_context_ranking({"alone": {"rows": [row]}}) == []


def test_a_split_k_gemm_is_one_call_of_two_kernels_not_two_calls():
    """cuBLAS's split-K GEMM launches the partial GEMM and ``splitKreduce_kernel`` per call:
    the model's time per call is both kernels' time over the GEMM's launches (28 layers),
    not over all 56 launches (session 21: that halved the down projection in the model)."""
    gemm = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT"
    red = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(x)"
    row = {"op": "linear", "signature": "bias=0,k=3072,n=1024", "scenario": "decode_b1",
           "tokens": 1, "calls_per_step": 28, "timed": {"native.vllm": 6.6},
           "kernels": {"native.vllm": {gemm: [1.0, 5.0], red: [1.0, 1.6]}}}
    sc = {"tokens": 1, "kernels": {gemm: [28.0, 136.8], red: [28.0, 45.6]}}
    (e,) = nim.attribute({"alone": {"rows": [row]}, "in_model": {"scenarios": {"decode_b1": sc}}})
    assert e["model_calls_per_step"] == 28
    assert e["in_model_us"] == round((136.8 + 45.6) / 28, 3)
    assert e["kernel_vs_model"] == round(6.6 / ((136.8 + 45.6) / 28), 3)
    # an op's variants (different kernels, each its own calls) still add up
    assert nim.model_calls({"a_1": [18.0, 1.0], "a_copy_3": [18.0, 2.0]}) == 36
    assert nim.model_calls({red: [4.0, 1.0]}) == 4      # auxiliary alone: counted


def test_the_in_layer_profile_writes_z_apart_and_knows_the_gdn_state_between():
    """Session 21's hypothesis for the gated norm (its z in L2 in the model at 1-16 tokens,
    not at 64): the in-layer rounds write z alone first (``only``), stream the GDN state's
    bytes, then x; the state per sequence comes from the model's GDN ops, and the table gets
    the profile's column."""
    import torch
    from fltune.ops import OPS
    from fltune.tune.workload import derive

    spec = OPS["rms_norm_gated"]
    dims = {"hidden": 32, "eps": 1e-6, "group_size": 0, "norm_before_gate": 1,
            "rows_per_token": 2}
    args = spec.make_inputs(4, dims, torch.float32, "cpu", torch.Generator().manual_seed(0))
    x0, z0 = args[0].clone(), args[1].clone()
    nim.producers(args, "rms_norm_gated", k=16, weight_bytes=1 << 16, only=[1])(0)
    assert torch.equal(args[0], x0) and not torch.equal(args[1], z0)
    # Qwen3.5-0.8B: 16 value heads of 128 x 128 fp32 per sequence; Qwen3-0.6B has no GDN
    # (derived for CUDA, as the GPU run does: on a CPU the GDN ops are opt-in)
    assert nim.gdn_state_bytes(derive("Qwen3.5-0.8B", device="cuda").items) == 16 * 128 * 128 * 4
    assert nim.gdn_state_bytes(derive("Qwen3-0.6B", device="cuda").items) == 0
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [18.0, 36.0]})
    doc["alone"]["rows"][0]["kernels_in_layer"] = {
        "native.vllm": {"triton_per_fused_0": [1.0, 2.1], "captured": True,
                        "layer": {"early": [1], "between_bytes": 2 << 20}}}
    (e,) = nim.attribute(doc)
    assert e["native_kernel_in_layer_us"] == 2.1 and e["in_layer_vs_model"] == 1.05


def test_producers_refuse_a_position_the_op_does_not_have():
    """An in-layer profile that named an input the op lacks would run with nothing written
    early and read as if it had: it is refused instead."""
    import pytest
    import torch
    from fltune.ops import OPS

    args = OPS["silu_and_mul"].make_inputs(4, {"intermediate": 8}, torch.float32, "cpu",
                                           torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="no position 1"):
        nim.producers(args, "silu_and_mul", k=8, weight_bytes=1 << 12, only=[1])


def _pair_eager(op, ins, eps):
    """The layer pair computed op by op, eagerly, with fltune's functional reference."""
    import torch
    from fltune.ops import OPS

    f = OPS[op].functional or OPS[op].reference
    src, w_o, residual, w1, w2, _, *mlp = ins
    if len(mlp) == 1:       # the stand-in: [in, out] weights
        o = src @ w_o
        h1, r1 = f(o.clone(), residual.clone(), w1, eps)
        d = h1 @ mlp[0]
    else:                   # the model's MLP: [out, in] weights, as vLLM's linear layers
        o = src @ w_o.T
        h1, r1 = f(o.clone(), residual.clone(), w1, eps)
        gate_up = h1 @ mlp[0].T
        inter = mlp[1].shape[1]
        d = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ mlp[1].T
    h2, r2 = f(d, r1, w2, eps)
    return o, h2, r2


def test_the_layer_pair_subgraph_computes_two_norms_and_the_boundary_copy():
    """The subgraph that stands for a decoder layer's two fused-add norms (o_proj, norm,
    GEMM, norm, boundary copy), compiled the way native.vllm compiles, computes what the two
    norms compute one after the other and copies o_proj's output into the boundary buffer;
    traced at one token count, it serves another (only the token dimension is dynamic)."""
    import torch

    op = "gemma_fused_add_rms_norm"
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(5, 64, generator=gen), torch.randn(5, 64, generator=gen),
            torch.randn(64, generator=gen) * 0.1, 1e-6]
    run, ins = nim.layer_pair_graph(op, args, copy=True, trace_tokens=16)
    assert ins[0].shape == (5, 64) and ins[2].shape == (5, 64)
    h2, r2 = run(*ins)
    o, want_h2, want_r2 = _pair_eager(op, ins, 1e-6)
    torch.testing.assert_close(h2, want_h2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r2, want_r2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ins[5], o, rtol=1e-5, atol=1e-5)
    # another token count through the same graph, no boundary copy asked: buffer untouched
    run2, ins2 = nim.layer_pair_graph(op, args, copy=False, trace_tokens=16)
    ins2 = nim.pair_inputs(args, tokens=9)
    h2, r2 = run2(*ins2)
    _, want_h2, want_r2 = _pair_eager(op, ins2, 1e-6)
    torch.testing.assert_close(h2, want_h2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r2, want_r2, rtol=1e-4, atol=1e-4)
    assert not ins2[5].any()


def test_the_layer_pair_with_the_models_mlp_computes_the_layer():
    """With the model's shapes (o_proj's input width, the MLP's intermediate size, read from
    the workload) the pair's subgraph is o_proj, norm, gate_up, SiLU-and-mul, down, norm:
    it computes what those compute one after the other, at a token count other than its
    trace's, with the inputs of those shapes."""
    import torch
    from types import SimpleNamespace

    items = [SimpleNamespace(op="silu_and_mul", dims_dict={"intermediate": 48}),
             SimpleNamespace(op="rotary_embedding", dims_dict={"heads": 3, "head_size": 32}),
             SimpleNamespace(op="fused_add_rms_norm", dims_dict={"hidden": 64})]
    shapes = nim.layer_shapes(items)
    assert shapes == {"o_in": 96, "intermediate": 48}
    assert nim.layer_shapes(items[1:]) is None      # no MLP item: the stand-in stays
    op = "fused_add_rms_norm"
    gen = torch.Generator().manual_seed(5)
    args = [torch.randn(7, 64, generator=gen), torch.randn(7, 64, generator=gen),
            torch.randn(64, generator=gen) * 0.1, 1e-6]
    run, ins = nim.layer_pair_graph(op, args, copy=True, trace_tokens=16, shapes=shapes)
    assert [tuple(t.shape) for t in ins] == [(7, 96), (64, 96), (7, 64), (64,), (64,),
                                              (7, 64), (96, 64), (64, 48)]
    h2, r2 = run(*ins)
    o, want_h2, want_r2 = _pair_eager(op, ins, 1e-6)
    torch.testing.assert_close(h2, want_h2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(r2, want_r2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ins[5], o, rtol=1e-5, atol=1e-5)


def test_only_fused_add_norms_have_a_layer_pair():
    import pytest
    import torch

    with pytest.raises(ValueError, match="not a fused-add norm"):
        nim.layer_pair_graph("rms_norm", [torch.zeros(2, 8), None, torch.zeros(8), 1e-6])


def test_each_op_is_judged_in_the_context_its_model_gives_it():
    """The fused-add norms by the layer pair, the gated norm by the in-layer profile where
    it has one and in step where not, everything else in step; GEMMs and points without an
    in-model figure are not counted; a point outside 15 % is named with its context."""
    table = [
        {"op": "gemma_fused_add_rms_norm", "scenario": "prefill_8192",
         "in_step_vs_model": 0.83, "layer_pair_as_model_vs_model": 1.03},
        {"op": "rms_norm_gated", "scenario": "decode_b16", "in_step_vs_model": 1.25,
         "in_layer_vs_model": 0.95},
        {"op": "rms_norm_gated", "scenario": "prefill_2048", "in_step_vs_model": 0.90},
        {"op": "rotary_embedding", "scenario": "prefill_2048", "in_step_vs_model": 1.42,
         "layer_pair_as_model_vs_model": 1.0},
        {"op": "silu_and_mul", "scenario": "decode_b1"},
        {"op": "linear", "scenario": "decode_b1", "in_step_vs_model": 2.0},
    ]
    assert nim.in_model_context(table[0]) == ("layer_pair", 1.03)
    assert nim.in_model_context(table[2]) == ("in_step", 0.90)
    w = nim.within(table)
    assert (w["within"], w["points"]) == (3, 4)
    assert w["outside"] == [{"op": "rotary_embedding", "scenario": "prefill_2048",
                             "context": "in_step", "ratio": 1.42}]


def test_the_rope_with_the_concat_lowering_computes_what_the_candidate_computes():
    """The rope compiled with the ConcatKernel lowering (the hypothesis for its prefill gap
    on Qwen3-0.6B) returns the rotated (query, key) of native.vllm's out-of-place path, at a
    token count other than the one it was traced at."""
    import torch
    from fltune.backends import native_vllm as nv
    from fltune.ops import OPS, workload_dims

    op = "rotary_embedding"
    dims = dict(heads=4, kv_heads=2, head_size=32, rotary_dim=32, max_position=64,
                base=10000.0, is_neox=True)
    gen = torch.Generator().manual_seed(1)
    with workload_dims(dims):
        args = OPS[op].make_inputs(7, dims, torch.float32, "cpu", gen)
        run = nim.rope_concat_graph(op, args, trace_tokens=16)
        q, k = run(*args)
        want_q, want_k = nv._make_timed(op)(*[a.clone() if isinstance(a, torch.Tensor) else a
                                              for a in args])
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert not torch.equal(q, args[1].view_as(q))     # it rotated something


def test_the_q_k_norm_and_rope_subgraph_computes_the_attention_blocks_q_and_k():
    """The attention block's q/k norm and rope compiled as one graph (the next test of the
    rope's prefill gap) returns what the per-head norm and then the rope compute one after
    the other, for a qkv buffer at a token count other than its trace's."""
    import torch
    from fltune.ops import OPS, workload_dims

    dims = dict(heads=4, kv_heads=2, head_size=32, rotary_dim=32, max_position=64,
                base=10000.0, is_neox=True)
    gen = torch.Generator().manual_seed(2)
    with workload_dims(dims):
        args = OPS["rotary_embedding"].make_inputs(6, dims, torch.float32, "cpu", gen)
        run, ins = nim.qk_norm_rope_graph(args, eps=1e-6, trace_tokens=16)
        q, k = run(*ins)
    qkv, pos, q_w, k_w, cache = ins
    assert qkv.shape == (6, 32 * (4 + 2 + 2)) and pos.shape == (6,)
    norm = OPS["rms_norm"].reference
    q0, k0, _ = qkv.split([128, 64, 64], dim=-1)
    qn = norm(q0.reshape(6, 4, 32).clone(), q_w, 1e-6).reshape(6, 128)
    kn = norm(k0.reshape(6, 2, 32).clone(), k_w, 1e-6).reshape(6, 64)
    want_q, want_k = qn.clone(), kn.clone()
    OPS["rotary_embedding"].reference(pos, want_q, want_k, 32, cache, True)
    torch.testing.assert_close(q, want_q, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k, want_k, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(q, qn)      # it rotated


def _pair_doc(model_kernel: str, mlp: dict | None = None):
    """A fused-add norm row with both stand-in layer-pair variants (and ``mlp``'s: the
    model-shaped ones) and one model kernel."""
    row = {"op": "fused_add_rms_norm", "signature": "s", "scenario": "prefill_8192",
           "tokens": 8192, "calls_per_step": 2, "timed": {"native.vllm": 14.0},
           "kernels": {"native.vllm": {"triton_per_fused_add_mean_0": [1.0, 14.0]}},
           "kernels_layer_pair": {"copy": {"per_call_us": 18.0},
                                  "no_copy": {"per_call_us": 16.0}, **(mlp or {})}}
    sc = {"tokens": 8192, "kernels": {model_kernel: [2.0, 32.0]}}
    return {"alone": {"rows": [row]}, "in_model": {"scenarios": {"prefill_8192": sc}}}


def test_the_layer_pair_variant_follows_the_models_kernels():
    """The pair is judged with the boundary copy only where the model's kernels carry one
    (their names say copy_, as Qwen3.5's do); without it where they do not (Qwen3's)."""
    (e,) = nim.attribute(_pair_doc("triton_per_fused__to_copy_add_copy__fused_add_rms_norm_3"))
    assert e["layer_pair_variant"] == "copy" and e["layer_pair_as_model_vs_model"] == 1.125
    assert nim.in_model_context(e) == ("layer_pair", 1.125)
    (e,) = nim.attribute(_pair_doc("triton_per_fused_fused_add_rms_norm_2"))
    assert e["layer_pair_variant"] == "no_copy" and nim.in_model_context(e) == (
        "layer_pair", 1.0)



def test_the_layer_pair_with_the_models_mlp_is_the_one_judged_where_recorded():
    """Where a run recorded the pair with the model's own MLP (both copy variants), that pair
    is the one judged, the copy again following the model's kernels; where one of the two
    failed (a row holds ``raised``), the stand-in pair is judged as before."""
    mlp = {"mlp_copy": {"per_call_us": 20.0}, "mlp_no_copy": {"per_call_us": 17.6}}
    (e,) = nim.attribute(_pair_doc("triton_per_fused_fused_add_rms_norm_2", mlp))
    assert e["layer_pair_variant"] == "mlp_no_copy"
    assert nim.in_model_context(e) == ("layer_pair", 1.1)
    assert e["native_layer_pair_mlp_us"] == 20.0 and e["layer_pair_mlp_vs_model"] == 1.25
    (e,) = nim.attribute(_pair_doc("triton_per_fused__to_copy_add_copy__fused_add_rms_norm_3",
                                   mlp))
    assert e["layer_pair_variant"] == "mlp_copy" and nim.in_model_context(e) == (
        "layer_pair", 1.25)
    half = {"mlp_copy": {"raised": "RuntimeError: x"}, "mlp_no_copy": {"per_call_us": 17.6}}
    (e,) = nim.attribute(_pair_doc("triton_per_fused_fused_add_rms_norm_2", half))
    assert e["layer_pair_variant"] == "no_copy" and nim.in_model_context(e) == (
        "layer_pair", 1.0)


def test_the_swapped_lowering_compiles_a_rope_that_computes_right(concat_kernels):
    """Where Inductor would build a pointwise cat (forced here: on CPU it never does), the
    swap builds a ConcatKernel instead, and the rope compiled that way still computes
    native.vllm's rotated (query, key)."""
    import torch
    from fltune.backends import native_vllm as nv
    from fltune.ops import OPS, workload_dims

    made = concat_kernels
    dims = dict(heads=2, kv_heads=1, head_size=16, rotary_dim=16, max_position=32,
                base=10000.0, is_neox=True)
    gen = torch.Generator().manual_seed(4)
    with workload_dims(dims), torch._inductor.config.patch(force_pointwise_cat=True):
        args = OPS["rotary_embedding"].make_inputs(5, dims, torch.float32, "cpu", gen)
        run = nim.rope_concat_graph("rotary_embedding", args, trace_tokens=12)
        q, k = run(*args)
    assert made and all(n >= 2 for n in made)      # the rope's cats, as ConcatKernels
    want_q, want_k = nv._make_timed("rotary_embedding")(
        *[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


def _gemm_row(sig: str, grid: str, us: float) -> dict:
    name = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"
    return {"op": "linear", "signature": sig, "scenario": "decode_b1", "tokens": 1,
            "calls_per_step": 28, "timed": {"native.vllm": us + 2.0},
            "kernels": {"native.vllm": {name: [1.0, us]}},
            "kernel_launches": {"native.vllm": {
                f"{name} grid=[{grid}] block=[384, 1, 1]": [1.0, us]}}}


def test_a_launch_two_rows_claim_comes_off_the_name_once():
    """o_proj and down_proj can run one grid: both attributed by that launch, it comes off
    the kernel name once for the third row, which falls back to the name."""
    name = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"
    shared, other = (f"{name} grid=[4, 16, 1] block=[384, 1, 1]",
                     f"{name} grid=[4, 24, 1] block=[384, 1, 1]")
    sc = {"tokens": 1, "kernels": {name: [84.0, 56 * 4.0 + 28 * 6.0]},
          "kernel_launches": {shared: [56.0, 56 * 4.0], other: [28.0, 28 * 6.0]}}
    rows = [_gemm_row("k=2048,n=1024", "4, 16, 1", 3.6),
            _gemm_row("k=3072,n=1024", "4, 16, 1", 3.6),
            _gemm_row("k=1024,n=6144", "8, 24, 1", 4.8)]
    doc = {"alone": {"rows": rows}, "in_model": {"scenarios": {"decode_b1": sc}}}
    o_proj, down, third = nim.attribute(doc)
    assert o_proj["attributed_by"] == down["attributed_by"] == "launch"
    assert o_proj["in_model_us"] == down["in_model_us"] == 4.0
    assert (third["attributed_by"], third["in_model_us"]) == ("name", 6.0)
    assert third["model_calls_per_step"] == 28 and third["stem_shared_by"] == 1


def test_gemms_sharing_a_kernel_name_are_told_apart_by_their_launches():
    """Two GEMM shapes that run one cuBLAS kernel name in the model (Qwen3-0.6B's qkv and
    gate_up at one token) are each set beside the model's launches of their own grid; where
    a candidate's launch is not in the model's profile, that candidate falls back to the
    name, and takes what the other's launches leave of it, while the other keeps its own
    launch."""
    name = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"
    sc = {"tokens": 1, "kernels": {name: [56.0, 28 * 4.0 + 28 * 6.0]},
          "kernel_launches": {f"{name} grid=[4, 16, 1] block=[384, 1, 1]": [28.0, 28 * 4.0],
                              f"{name} grid=[4, 24, 1] block=[384, 1, 1]": [28.0, 28 * 6.0]}}
    rows = [_gemm_row("k=1024,n=4096", "4, 16, 1", 3.6),
            _gemm_row("k=1024,n=6144", "4, 24, 1", 4.8)]
    doc = {"alone": {"rows": rows}, "in_model": {"scenarios": {"decode_b1": sc}}}
    qkv, gate_up = nim.attribute(doc)
    assert (qkv["in_model_us"], gate_up["in_model_us"]) == (4.0, 6.0)
    assert qkv["attributed_by"] == gate_up["attributed_by"] == "launch"
    assert qkv["kernel_vs_model"] == 0.9 and gate_up["kernel_vs_model"] == 0.8
    # the candidate launched the second shape otherwise than the model: by name for it
    rows[1] = _gemm_row("k=1024,n=6144", "8, 24, 1", 4.8)
    qkv, gate_up = nim.attribute(doc)
    assert (qkv["in_model_us"], qkv["attributed_by"]) == (4.0, "launch")
    # ... the name's time less the launches qkv claimed, not the two shapes' average
    assert (gate_up["in_model_us"], gate_up["attributed_by"]) == (6.0, "name")
    assert gate_up["stem_shared_by"] == 1 and gate_up["model_calls_per_step"] == 28
    assert gate_up["launches"]["model"] == [f"{name} grid=[4, 24, 1] block=[384, 1, 1]"]
    # where neither is told apart by launch, both read the name's time split by calls
    rows[0] = _gemm_row("k=1024,n=4096", "8, 16, 1", 3.6)
    qkv, gate_up = nim.attribute(doc)
    assert qkv["attributed_by"] == gate_up["attributed_by"] == "name"
    assert qkv["in_model_us"] == gate_up["in_model_us"] == 5.0
    assert qkv["stem_shared_by"] == gate_up["stem_shared_by"] == 2


def _drawn_doc(slow_layers, candidate_us=1.5):
    """Session 26's Qwen3.5 decode_b1: the gated norm's 18 launches split between two
    autotune draws (XBLOCK 32: grid [1], 4.6 µs; XBLOCK 8: grid [2], 1.6 µs), and the
    embedding's norm under the same kernel name once per step (block 32); the candidate
    at the fast launch, ``candidate_us`` a call."""
    fast = 18 - slow_layers
    launches = {"triton_per_fused_1 grid=[1, 1, 1] block=[32, 1, 1]": [1.0, 2.2],
                COPY + " grid=[2, 1, 1] block=[128, 1, 1]": [18.0, 18.0]}
    if slow_layers:
        launches["triton_per_fused_1 grid=[1, 1, 1] block=[64, 1, 1]"] = [
            float(slow_layers), 4.6 * slow_layers]
    if fast:
        launches["triton_per_fused_1 grid=[2, 1, 1] block=[64, 1, 1]"] = [float(fast), 1.6 * fast]
    name_calls = sum(v[0] for k, v in launches.items() if k.startswith("triton_per"))
    name_us = sum(v[1] for k, v in launches.items() if k.startswith("triton_per"))
    doc = _doc({COPY: [18.0, 18.0], "triton_per_fused_1": [name_calls, name_us]},
               launches=launches)
    row = doc["alone"]["rows"][0]
    row["kernel_launches"] = {"native.vllm": {
        "triton_per_fused_0 grid=[2, 1, 1] block=[64, 1, 1]": [1.0, candidate_us]}}
    row["kernels_in_layer"] = {"native.vllm": {"triton_per_fused_0": [1.0, candidate_us]}}
    return doc


def test_layers_that_drew_two_launch_configurations_are_the_ops_calls_together():
    """No single launch is made as often as the copy when the layers' autotunes drew two
    configurations: the set of the name's launches that adds up to the copy's count is the
    op's (16 x 4.6 + 2 x 1.6 over 18 calls), without the embedding norm's launch; the mix
    is reported with the model's time at the candidate's own configuration (1.6 µs)."""
    (e,) = nim.attribute(_drawn_doc(16))
    assert e["in_model_us"] == round((16 * 4.6 + 2 * 1.6) / 18, 3)
    assert e["model_launch_mix"] == {"grid=[1, 1, 1] block=[64, 1, 1]": [16.0, 4.6],
                                     "grid=[2, 1, 1] block=[64, 1, 1]": [2.0, 1.6]}
    assert e["in_model_at_candidate_launch_us"] == 1.6
    w = nim.within([e])
    (miss,) = w["outside"]          # the mix is what the model ran: still a miss, named
    assert miss["ratio"] == e["in_layer_vs_model"] < 0.85
    assert abs(miss["ratio_at_candidate_launch"] - 1.5 / 1.6) < 0.002  # (rounded twice)
    assert (w["within"], w["within_at_candidate_launch"]) == (0, 1)


def test_a_model_that_drew_the_candidates_configuration_everywhere_has_no_mix():
    (e,) = nim.attribute(_drawn_doc(0))
    assert e["in_model_us"] == 1.6 and "model_launch_mix" not in e
    w = nim.within([e])
    assert (w["within"], w["within_at_candidate_launch"]) == (1, 1)


def test_every_layer_on_another_configuration_has_nothing_to_compare_at_the_candidates():
    (e,) = nim.attribute(_drawn_doc(18))
    assert e["in_model_us"] == 4.6
    assert e["model_launch_mix"] == {"grid=[1, 1, 1] block=[64, 1, 1]": [18.0, 4.6]}
    assert e["in_model_at_candidate_launch_us"] is None
    (miss,) = nim.within([e])["outside"]
    assert "ratio_at_candidate_launch" not in miss


def test_launches_that_add_up_two_ways_are_not_guessed():
    """Two sets of one name's launches reach the copy's count: none is taken (the name's
    time is shared by calls, as without launch shapes)."""
    import re
    launches = {"k grid=[1, 1, 1] block=[64, 1, 1]": [9.0, 9.0],
                "k grid=[2, 1, 1] block=[64, 1, 1]": [9.0, 9.0],
                "k grid=[4, 1, 1] block=[64, 1, 1]": [9.0, 9.0]}
    assert nim.launches_summing_to(launches, re.compile("^k"), 18.0) == {}
    assert len(nim.launches_summing_to(launches, re.compile("^k"), 27.0)) == 3


def test_a_point_inside_by_the_mix_but_outside_at_the_candidates_launch_is_counted_there():
    """within_at_candidate_launch reads every point whose model drew other launches at the
    candidate's own launch, not only the misses: a point inside by the mix can be outside
    there."""
    # the candidate's launch is the fast one, but it takes 4.0 µs there: by the mix (4.267)
    # it reads 0.94, inside; at its own launch (the model's 1.6 there) 2.5, far outside
    (e,) = nim.attribute(_drawn_doc(16, candidate_us=4.0))
    w = nim.within([e])
    assert w["within"] == 1 and not w["outside"]
    (d,) = w["drawn_points"]
    assert abs(d["ratio_at_candidate_launch"] - 4.0 / 1.6) < 0.01
    assert w["within_at_candidate_launch"] == 0


def test_a_miss_that_stays_a_miss_at_the_candidates_launch_is_not_excused():
    (e,) = nim.attribute(_drawn_doc(16, candidate_us=0.8))
    w = nim.within([e])
    (miss,) = w["outside"]
    assert abs(miss["ratio_at_candidate_launch"] - 0.5) < 0.01
    assert (w["within"], w["within_at_candidate_launch"]) == (0, 0)


def test_sets_that_add_up_are_looked_for_per_name_and_not_beyond_eight_launches():
    import re
    two_names = {"k_a grid=[1, 1, 1] block=[64, 1, 1]": [16.0, 73.6],
                 "k_a grid=[2, 1, 1] block=[64, 1, 1]": [2.0, 3.2],
                 "k_b grid=[1, 1, 1] block=[64, 1, 1]": [5.0, 5.0]}
    got = nim.launches_summing_to(two_names, re.compile("^k_"), 18.0)
    assert set(got) == {"k_a grid=[1, 1, 1] block=[64, 1, 1]",
                        "k_a grid=[2, 1, 1] block=[64, 1, 1]"}
    # a set may not mix two names' launches: 16 + 2 from k_a only, never 13 + 5
    assert nim.launches_summing_to(two_names, re.compile("^k_"), 21.0) == {}
    nine = {f"k grid=[{i}, 1, 1] block=[64, 1, 1]": [2.0, 2.0] for i in range(1, 10)}
    nine["j grid=[1, 1, 1] block=[64, 1, 1]"] = [18.0, 18.0]
    # nine configurations of one name: open, even though another name adds up alone
    assert nim.launches_summing_to(nine, re.compile("^[kj] "), 18.0) == {}
    # fractions of a call per step are no layer's copy: 17 + 0.4 + 0.6 is not 18 (0.4 is
    # left out; 17 + 0.6 is within half a call but not within half of 0.6)
    frac = {"k grid=[1, 1, 1] block=[64, 1, 1]": [17.0, 17.0],
            "k grid=[2, 1, 1] block=[64, 1, 1]": [0.4, 0.4],
            "k grid=[4, 1, 1] block=[64, 1, 1]": [0.6, 0.6]}
    assert nim.launches_summing_to(frac, re.compile("^k "), 18.0) == {}
    assert nim.launches_summing_to(frac, re.compile("^k "), 17.0) == {
        "k grid=[1, 1, 1] block=[64, 1, 1]": [17.0, 17.0]}


def test_a_launch_mix_with_no_calls_at_the_candidates_configuration_divides_by_nothing():
    model = {"k grid=[1, 1, 1] block=[64, 1, 1]": [18.0, 82.8],
             "k grid=[2, 1, 1] block=[64, 1, 1]": [0.0, 0.0]}
    own = {"k grid=[2, 1, 1] block=[64, 1, 1]": [1.0, 1.5]}
    mix, at_own = nim.launch_mix(model, own)
    assert at_own is None and mix["grid=[2, 1, 1] block=[64, 1, 1]"] == [0.0, None]
