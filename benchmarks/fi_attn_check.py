"""Do the cross-built FlashInfer attention modules (benchmarks/flashinfer-aot/attn-fiaot.tgz) load
and compute correctly on the H200, without any JIT?

Why before racing `--attention-backend FLASHINFER`: the modules were compiled on a CPU machine
(no GPU ever ran them). If one of them were missing or wrong, vLLM's FlashInfer backend would
JIT it at engine start (minutes of a 10-minute call) or, worse, serve wrong attention. Here each
of the four variants vLLM 0.24 plans on SM90 (prefill: fa3, decode with tensor cores: fa2; head
128 for Qwen3-0.6B, 256 for Qwen3.5-0.8B; bf16; causal; page size 16) runs once through
FlashInfer's own wrappers with ``FLASHINFER_DISABLE_JIT=1`` (a module that is not in the AOT
directory raises instead of building) and is compared with an fp32 softmax reference.

Usage (GPU machine, after benchmarks/h200_s7.sh's restore): python3 benchmarks/fi_attn_check.py
Prints one JSON line per variant and exits non-zero if any failed.
"""
from __future__ import annotations

import json
import os
import sys

os.environ["FLASHINFER_DISABLE_JIT"] = "1"

import torch  # noqa: E402

PAGE = 16


def reference(q, k, v, causal_offset: int) -> torch.Tensor:
    """fp32 attention with GQA; query i sees keys 0 .. causal_offset + i."""
    nq, nkv = q.shape[1], k.shape[1]
    rep = nq // nkv
    kf = k.float().repeat_interleave(rep, dim=1)
    vf = v.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) / q.shape[-1] ** 0.5
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk, device=q.device)[None, :] > (causal_offset + torch.arange(lq, device=q.device))[:, None]
    s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vf)


def paged(k, v):
    """One sequence's K/V into a (pages, 2, PAGE, nkv, hd) NHD cache, the last page partly filled."""
    n = k.shape[0]
    pages = (n + PAGE - 1) // PAGE
    cache = torch.zeros(pages, 2, PAGE, k.shape[1], k.shape[2], dtype=k.dtype, device=k.device)
    for i, t in ((0, k), (1, v)):
        flat = torch.zeros(pages * PAGE, k.shape[1], k.shape[2], dtype=k.dtype, device=k.device)
        flat[:n] = t
        cache[:, i] = flat.view(pages, PAGE, k.shape[1], k.shape[2])
    dev = k.device
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=dev)
    indices = torch.arange(pages, dtype=torch.int32, device=dev)
    last = torch.tensor([n - (pages - 1) * PAGE], dtype=torch.int32, device=dev)
    return cache, indptr, indices, last


def check(kind: str, nq: int, nkv: int, hd: int, seq: int) -> dict:
    import flashinfer

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(seq, nkv, hd, device=dev, dtype=dt)
    v = torch.randn(seq, nkv, hd, device=dev, dtype=dt)
    cache, indptr, indices, last = paged(k, v)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    if kind == "prefill":
        q = torch.randn(seq, nq, hd, device=dev, dtype=dt)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="auto")
        w.plan(torch.tensor([0, seq], dtype=torch.int32, device=dev), indptr, indices, last,
               nq, nkv, hd, PAGE, causal=True, q_data_type=dt, kv_data_type=dt)
        ref = reference(q, k, v, 0)
    else:
        q = torch.randn(1, nq, hd, device=dev, dtype=dt)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr, indices, last, nq, nkv, hd, PAGE, pos_encoding_mode="NONE",
               q_data_type=dt, kv_data_type=dt)
        ref = reference(q, k, v, seq - 1)
    out = w.run(q, cache)
    torch.cuda.synchronize()
    err = (out.float() - ref).abs().max().item()
    return {"kind": kind, "head_dim": hd, "heads": f"{nq}/{nkv}", "seq": seq,
            "backend": getattr(w, "_backend", "?"), "max_abs_err": err, "ok": bool(err < 2e-2)}


def main() -> int:
    failed = 0
    for nq, nkv, hd in ((16, 8, 128), (8, 2, 256)):       # Qwen3-0.6B, Qwen3.5-0.8B
        for kind in ("prefill", "decode"):
            try:
                r = check(kind, nq, nkv, hd, 1000)
            except Exception as e:  # a missing module raises MissingJITCacheError here
                r = {"kind": kind, "head_dim": hd, "ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
            failed += not r["ok"]
            print(json.dumps(r), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
