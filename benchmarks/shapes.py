"""Named benchmark shapes (SPEC §14) as data.

H ∈ {32, 64}, D = 128, K = 2048, FP8 keys with per-key scales, bf16 queries;
causal prefill chunks (queries at the end of the context) and decode batches.
"""

from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    name: str
    T: int          # queries
    N: int          # context (keys)
    H: int = 32
    D: int = 128
    K: int = 2048
    causal: bool = True


def _prefill(T, N, H=32):
    return Shape(f"prefill_T{T // 1024}k_N{N // 1024}k_H{H}", T, N, H)


def _decode(T, N, H=32):
    return Shape(f"decode_T{T}_N{N // 1024}k_H{H}", T, N, H)


SHAPES = {s.name: s for s in (
    [_prefill(T, N, H) for H in (32, 64) for T in (4096, 16384)
     for N in (131072, 262144, 524288, 1048576)]
    + [_decode(T, N, H) for H in (32, 64) for T in (8, 64) for N in (131072, 1048576)]
    + [Shape("smoke_T256_N16k_H32", 256, 16384, 32),
       Shape("small_T1k_N64k_H32", 1024, 65536, 32)]
)}

#: The shapes named in issue 4's targets (H=32, causal, FP8 keys).
TARGETS = ("prefill_T16k_N128k_H32", "prefill_T16k_N1024k_H32")
#: A quick set that fits one short GPU call.
QUICK = ("prefill_T4k_N128k_H32", "prefill_T16k_N1024k_H32")
