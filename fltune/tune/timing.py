"""Timing in the regime the server runs in.

CUDA (decode regime, the default): K back-to-back calls captured in one CUDA graph,
replayed R times, each replay timed with CUDA events; the per-call time is the replay
time / K. This is how vLLM runs decode batches, and it removes the host launch cost that
would otherwise dominate small bands (the H200 probe: 12-90 us eager vs 1.5-3 us replayed).
A candidate that cannot be captured is timed eagerly and the timer says so.
CUDA eager back-to-back (``eager=True``, for bands above vLLM's CUDA-graph capture sizes):
K eager calls launched back to back, timed with events around the K; the per-call time is
max(host launch cost, GPU time), what a call costs where vLLM runs without a graph (prefill
chunks above the largest capture size, the LM head). Why: on the H200 (session 6) FlagGems'
GEMM took 14 µs of GPU time at 2048 tokens but 80 µs of host time per call, cuBLAS 12 µs
of host time; Qwen3.5-0.8B's prefill of 2048 tokens spent 35 ms of wall on 7.8 ms of
kernels, so there a call's host cost is its cost, and a graph-replay race had picked the
candidate that made the model 23 % slower.
CUDA cold-L2 (``cold_l2=True``, for prefill bands): eager calls, each after overwriting a
buffer larger than L2, timed with events around the call alone.
CPU: ``time.perf_counter`` around each call.

Candidates are **interleaved** — round r times every candidate once before round r+1 —
so drift (clocks, thermals, other tenants) hits all of them alike. Reported: median, p10,
p90 and n per candidate, in microseconds, and the timer with its settings.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    n: int
    timer: dict = field(default_factory=dict)

    @property
    def noise(self) -> float:
        """(p90 - p10) / median: the spread the run measured, used as its noise level."""
        return (self.p90_us - self.p10_us) / self.median_us if self.median_us else 0.0


def _stats(samples_us, timer) -> Timing:
    s = sorted(samples_us)
    n = len(s)

    def q(p):
        return s[min(n - 1, max(0, int(round(p * (n - 1)))))]
    return Timing(statistics.median(s), q(0.1), q(0.9), n, timer)


def time_candidates(calls: dict, device: str, *, reps: int = 0, budget_s: float = 0.05,
                    graph_calls: int = 20, cold_l2: bool = False, eager: bool = False,
                    timer_extra: dict | None = None, progress=None) -> dict:
    """Time each ``calls[name]()`` (a no-argument closure over its own cloned inputs).

    Returns {name: Timing}; a candidate that raises during timing maps to the exception.
    ``reps`` = 0 picks the repetition count from a probe so the whole race takes about
    ``budget_s`` per candidate (at least 5, at most 200 samples). ``timer_extra`` goes into
    every timing's ``timer`` record (the race's cold-weight copies).
    """
    progress = progress or (lambda phase, name: None)
    if device == "cuda":
        out = _time_cuda(calls, reps, budget_s, graph_calls, cold_l2, progress, eager)
    else:
        out = _time_cpu(calls, reps, budget_s, progress)
    for t in out.values():          # what the caller set up around the calls, recorded
        if isinstance(t, Timing) and timer_extra:
            t.timer.update(timer_extra)
    return out


def _time_cpu(calls, reps, budget_s, progress):
    out, live = {}, {}
    probe = {}
    for name, fn in calls.items():
        progress("warmup", name)
        try:
            fn()                      # warm-up: first calls compile (inductor), fault pages
            t0 = time.perf_counter()
            fn()
            probe[name] = time.perf_counter() - t0
            live[name] = fn
        except Exception as e:
            out[name] = e
    if not live:
        return out
    if reps <= 0:
        worst = max(probe.values())
        reps = int(min(200, max(5, budget_s / max(worst, 1e-7))))
    samples = {n: [] for n in live}
    threads = torch.get_num_threads()
    progress("race", None)
    for _ in range(reps):
        for name, fn in live.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) * 1e6)
    timer = {"timer": "cpu-perf_counter", "reps": reps, "threads": threads}
    out.update({n: _stats(s, timer) for n, s in samples.items()})
    return out


def _back_to_back(fn, k):
    def run():
        for _ in range(k):
            fn()
    return run


def _time_cuda(calls, reps, budget_s, graph_calls, cold_l2, progress, eager=False):
    out, runners = {}, {}
    stream = torch.cuda.Stream()
    for name, fn in calls.items():
        progress("warmup", name)
        try:
            # warm-up on a side stream (compiles, autotunes) before capture
            with torch.cuda.stream(stream):
                fn(); fn()
            torch.cuda.synchronize()
            if cold_l2:
                runners[name] = ("eager-cold-l2", fn, 1)
                continue
            if eager:
                runners[name] = ("eager-back-to-back", _back_to_back(fn, graph_calls),
                                 graph_calls)
                continue
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(graph_calls):
                    fn()
            g.replay(); torch.cuda.synchronize()
            runners[name] = ("cuda-graph", g.replay, graph_calls)
        except Exception as e:
            torch.cuda.synchronize()
            try:
                fn(); torch.cuda.synchronize()
                runners[name] = ("eager", fn, 1)   # cannot be captured: time it as it is
            except Exception as e2:
                out[name] = e2
    if not runners:
        return out
    flush = (torch.empty(int(256 * 2**20), dtype=torch.int8, device="cuda") if cold_l2
             else None)
    if reps <= 0:
        worst = 0.0
        for mode, run, k in runners.values():
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); run(); e.record(); torch.cuda.synchronize()
            worst = max(worst, s.elapsed_time(e) / 1e3)
        reps = int(min(200, max(5, budget_s / max(worst, 1e-6))))
    progress("race", None)
    samples = {n: [] for n in runners}
    ev = {n: [(torch.cuda.Event(True), torch.cuda.Event(True)) for _ in range(reps)]
          for n in runners}
    for r in range(reps):
        for name, (mode, run, k) in runners.items():
            if flush is not None:
                flush.zero_()
            s, e = ev[name][r]
            s.record(); run(); e.record()
    torch.cuda.synchronize()
    for name, (mode, run, k) in runners.items():
        samples[name] = [s.elapsed_time(e) * 1e3 / k for s, e in ev[name]]
        timer = {"timer": mode, "reps": reps,
                 "calls_per_graph": k if mode in ("cuda-graph", "eager-back-to-back") else 1,
                 "cold_l2": bool(cold_l2)}
        out[name] = _stats(samples[name], timer)
    return out
