"""KVSUM64: a 64-bit chunk-payload checksum that the copy kernels compute while they copy.

Definition, for a payload of ``P`` bytes (zero-padded to a multiple of 4): with ``w_i`` the
little-endian ``uint32`` words and ``i`` their index in the payload,

    checksum = sum_i  w_i * weight(i)   (mod 2**64)
    weight(i) = h | 1, where (all uint32, wrapping)
        h = (i mod 2**32) * 0x9E3779B1;  h ^= h >> 16;  h *= 0x85EBCA6B;  h ^= h >> 13

Why this shape:

- It is a sum of independent terms, so any thread of any CTA can add its words' terms in any
  order (one ``IMAD.WIDE.U32`` per word plus ~6 ALU ops for the weight) and the partial sums of
  blocks, spans or CTAs just add up: the kernel gets it during the copy for ~free.
- A single bit flip changes the sum by ``±2**b * weight(i)``; weights are odd, so that is never
  0 mod 2**64: every single-bit error is detected (deterministically, not just likely).
- Weights are a non-linear hash of the absolute word position, so swapping, reordering or
  shifting non-identical blocks changes the sum except with probability ~2**-64. (A linear
  weight such as ``i * K`` would miss swaps of blocks whose word sums are equal.)
- Zero words add nothing: padding is harmless, and a span's checksum is the sum of its blocks'.

It is an integrity check against bit rot, torn writes and copy bugs, not a MAC: anyone can craft
a collision. Chunk headers store it as an unsigned 64-bit value; device tensors hold the same bits
as ``int64`` (see :func:`to_signed` / :func:`to_unsigned`).
"""

from __future__ import annotations

import torch

_K1 = 0x9E3779B1
_K2 = 0x85EBCA6B
_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_SLICE_WORDS = 1 << 22  # bounds the temporaries of the CPU reference to ~32 MiB each
_ROW = 1 << 14  # words summed exactly in int64: 2**14 terms of < 2**48 stay < 2**62
_CACHE_WORDS = 1 << 23  # weights are data-independent: cache them for payloads up to 32 MiB
_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def word_weight(index: int) -> int:
    """``weight(index)`` in plain Python: the spec the kernels and :func:`payload_checksum` follow."""
    h = ((index & _M32) * _K1) & _M32
    h ^= h >> 16
    h = (h * _K2) & _M32
    h ^= h >> 13
    return h | 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)``, exact: no int64 product overflows."""
    lo = (x & 0xFFFF) * c  # < 2**48
    hi = ((x >> 16) * c) & 0xFFFF  # only the low 16 bits survive the << 16 below
    return (lo + (hi << 16)) & _M32


def _weights(start: int, count: int, device: torch.device) -> torch.Tensor:
    """``int64 [count]``: weight(start + k) for k < count."""
    h = (torch.arange(start, start + count, dtype=torch.int64, device=device)) & _M32
    h = _mul32(h, _K1)
    h ^= h >> 16
    h = _mul32(h, _K2)
    h ^= h >> 13
    return h | 1


def _weight_halves(start: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``: the low and high 16 bits of weight(start + k), k < count (cached: 8 B/word)."""
    end = start + count
    if end > _CACHE_WORDS:
        h = _weights(start, count, device)
        return h & 0xFFFF, h >> 16
    lo, hi = _cache.get(device, (None, None))
    if lo is None or lo.numel() < end:
        size = min(_CACHE_WORDS, max(end, 2 * (0 if lo is None else lo.numel()), 1 << 16))
        h = _weights(0, size, device)
        lo, hi = (h & 0xFFFF).to(torch.int32), (h >> 16).to(torch.int32)
        _cache[device] = (lo, hi)
    return lo[start:end], hi[start:end]


def _exact_sum(values: torch.Tensor) -> int:
    """Sum of non-negative int64 values < 2**48, exactly, as a Python int."""
    pad = (-values.numel()) % _ROW
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return sum(values.view(-1, _ROW).sum(dim=1).tolist())


def payload_checksum(payload: torch.Tensor, first_word: int = 0) -> int:
    """KVSUM64 of ``payload`` (``uint8 [P]``, any device), as an unsigned int in ``[0, 2**64)``.

    ``first_word`` is the word index of ``payload[0]`` inside the whole chunk payload (a multiple
    of 4 bytes), so the checksum of a sub-range can be computed on its own; sub-range checksums
    of disjoint ranges add up (mod 2**64) to the whole payload's. Pure torch, exact (no reliance on
    integer overflow). ~90 MB/s on a 2-core CI machine: fine for tests and spot checks; the GPU
    kernels compute it during the copy.
    """
    if payload.dtype != torch.uint8:
        raise TypeError(f"payload must be uint8 bytes, got {payload.dtype}.")
    data = payload.reshape(-1)
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    if data.storage_offset() % 4 or not data.is_contiguous():
        data = data.clone()
    words = data.view(torch.int32)
    total_lo = total_hi = 0
    for start in range(0, words.numel(), _SLICE_WORDS):
        w = words[start : start + _SLICE_WORDS].to(torch.int64) & _M32
        lo, hi = _weight_halves(first_word + start, w.numel(), w.device)
        total_lo += _exact_sum(w * lo)  # factors < 2**32 and < 2**16: products < 2**48, exact
        total_hi += _exact_sum(w * hi)
    return (total_lo + (total_hi << 16)) & _M64


def to_signed(value: int) -> int:
    """The int64 whose bits are the unsigned 64-bit ``value`` (how device tensors hold checksums)."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


def to_unsigned(value: int) -> int:
    """The unsigned 64-bit value of an int64 (how chunk headers hold checksums)."""
    return value & _M64


def as_unsigned(checksums: torch.Tensor) -> list[int]:
    """``int64 [n]`` checksums (as ``gather(..., checksums_out=)`` writes them) as unsigned ints."""
    return [to_unsigned(v) for v in checksums.tolist()]
