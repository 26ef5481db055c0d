"""Token-count bands: where measurements are taken and how a token count finds its band.

Edges are powers of two up to 512 — each of them one of vLLM's CUDA-graph capture sizes,
so every decode batch the server replays as a graph sits on or under a measured edge —
then powers of two up to ``max_tokens`` (prefill chunks). ``max_tokens`` itself is always
an edge.

The band rule, written into every manifest: band i covers token counts
``(edge[i-1], edge[i]]`` (the first band is ``[1, edge[0]]``) and is measured at its upper
edge ``edge[i]``; a count above the last edge uses the last band (clamped). Measuring at the
top of a band is TensorRT-LLM's and FlashInfer's convention: the kernel picked for a band
has been seen at the largest size it will get.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

BAND_RULE = ("band i covers tokens (edge[i-1], edge[i]] (first band [1, edge[0]]), measured "
             "at edge[i]; counts above the last edge use the last band")
DECODE_LIMIT = 512
DEFAULT_MAX_TOKENS = {"cuda": 16384, "cpu": 2048}


@dataclass(frozen=True)
class Band:
    lo: int
    hi: int

    @property
    def tokens(self) -> int:
        """The token count this band is measured at."""
        return self.hi

    def __str__(self):
        return f"{self.lo}" if self.lo == self.hi else f"{self.lo}-{self.hi}"


def max_tokens_for(device: str, max_tokens=None) -> int:
    """``max_tokens`` if given, else the device's default top band edge (one rule for
    calibrate and bench, so both measure the same bands)."""
    return max_tokens or DEFAULT_MAX_TOKENS.get(device, 2048)


def edges(max_tokens: int) -> list[int]:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, e = [], 1
    while e < max_tokens:
        out.append(e)
        e *= 2
    out.append(max_tokens)
    return out


def bands(max_tokens: int) -> list[Band]:
    es = edges(max_tokens)
    return [Band((es[i - 1] + 1) if i else 1, e) for i, e in enumerate(es)]


def band_of(n: int, band_list: list[Band]) -> Band:
    """The band a token count falls in (clamped at both ends)."""
    his = [b.hi for b in band_list]
    return band_list[min(bisect.bisect_left(his, max(1, n)), len(band_list) - 1)]
