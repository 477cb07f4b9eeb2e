"""How fast the Triton checksum pass over landed chunks (``BlockSums``: a read-only plan) reads 128
chunks of 16 blocks (4 GiB, Llama-3-8B geometry: 32 layers of 64 KiB blocks), by CTAs, tile and
warps, each the mean of 20 passes after 3. Every configuration's sums must equal the first's.

One GPU, no vLLM: ``python bench/checksum_ctas.py``.
"""

from __future__ import annotations

import torch

from kvtier import codec
from kvtier.layout import build_layout
from kvtier.ops import triton_ops
from kvtier.ops.span import ChunkSpan

LAYERS, BLOCK, HEADS, DIM = 32, 16, 8, 128  # Llama-3-8B's KV at one rank
NUM_BLOCKS, CHUNK_BLOCKS, CHUNKS = 2100, 16, 128  # a 32k-token pull of 256-token chunks


def timed_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / reps


def main() -> None:
    dev = torch.device("cuda", 0)
    kv = {f"l{i}": torch.randint(-100, 100, (NUM_BLOCKS, 2, BLOCK, HEADS, DIM), device=dev, dtype=torch.int16)
          .view(torch.bfloat16) for i in range(LAYERS)}
    layout = build_layout(kv, BLOCK, NUM_BLOCKS)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ids = torch.randperm(NUM_BLOCKS, device=dev)[: CHUNKS * CHUNK_BLOCKS].to(torch.int64)
    scratch = torch.empty(codec.chunk_bytes(layout, CHUNK_BLOCKS), dtype=torch.uint8, device=dev)
    spans = [ChunkSpan(scratch, CHUNK_BLOCKS, 0, ids[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]) for c in range(CHUNKS)]
    plan = triton_ops.build_plan(layout, spans, write=False)
    nbytes = CHUNKS * CHUNK_BLOCKS * layout.bytes_per_block
    print(f"{sms} SMs; {nbytes / 2**30:.2f} GiB in {plan.num_units} units of {layout.regions[0].block_bytes} B")
    ref = None
    for tile in (16384, 32768):
        for warps in (8, 16):
            for mult in (1, 2, 4, 8):
                sums = torch.zeros(CHUNKS, dtype=torch.int64, device=dev)

                def one_pass():
                    sums.zero_()
                    triton_ops.launch(plan, gather=True, sums=sums, max_ctas=mult * sms, tile_bytes=tile, num_warps=warps)

                ms = timed_ms(one_pass)
                ref = sums.clone() if ref is None else ref
                print(f"tile {tile // 1024:2d} KiB warps {warps:2d} ctas {mult * sms:5d}: {ms:.2f} ms, "
                      f"{nbytes / ms / 1e6:.0f} GB/s, sums {'ok' if torch.equal(sums, ref) else 'DIFFER'}")


if __name__ == "__main__":
    main()
