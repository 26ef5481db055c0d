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
