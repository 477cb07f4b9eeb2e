"""The Triton copy kernels compiled at start (``kvtier.ops.warm_kernels``): after the warm-up no
save, load or checksum pass compiles anything, and the warm-up reads and writes no KV.

The GPU test needs CUDA and Triton; the other two run anywhere.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import codec
from kvtier.layout import build_layout
from kvtier.ops import triton_ops, warm_kernels
from kvtier.ops.span import ChunkSpan

BLOCK, CHUNK_BLOCKS, LAYERS, HEADS, HEAD_DIM = 16, 4, 2, 8, 128


def _layout(device: str):
    num_blocks = 4 * CHUNK_BLOCKS
    kv = {f"l{i}": torch.randn(num_blocks, 2, BLOCK, HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
          for i in range(LAYERS)}
    return kv, build_layout(kv, BLOCK, num_blocks)


def test_nothing_to_warm_on_a_cpu():
    _, layout = _layout("cpu")
    assert warm_kernels(layout, "auto") == 0.0


def test_a_warm_up_that_fails_leaves_the_engine_starting(monkeypatch, caplog):
    """No GPU here: the layout's device and the kernel modules are stand-ins; what is tested is
    that a compile failure at start is one warning, not a failed start."""
    from types import SimpleNamespace

    from kvtier.ops import cuda_ops

    def broken(device):
        raise RuntimeError("ptxas not found")

    monkeypatch.setattr(triton_ops, "available", lambda: True)
    monkeypatch.setattr(cuda_ops, "available", lambda: False)
    monkeypatch.setattr(triton_ops, "warm", broken)
    with caplog.at_level("WARNING", logger="kvtier.ops"):
        assert warm_kernels(SimpleNamespace(device=torch.device("cuda", 0)), "dma") == 0.0
    assert "compiling the Triton copy kernels at start failed (RuntimeError: ptxas not found)" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not triton_ops.available(), reason="needs a CUDA device and Triton")
def test_after_the_warm_up_no_copy_compiles_and_no_kv_moved(monkeypatch):
    kv, layout = _layout("cuda")
    before = {name: t.clone() for name, t in kv.items()}
    triton_ops._warm.discard(layout.device)
    assert triton_ops.warm(layout.device) > 0
    assert triton_ops.warm(layout.device) == 0.0  # once per process and device
    torch.cuda.synchronize()
    for name, t in kv.items():
        assert torch.equal(t, before[name]), f"the warm-up changed {name}"

    kernel = triton_ops._copy_kernel  # Triton sets its compile function once the device is bound
    if not hasattr(kernel, "compile"):
        pytest.skip("this Triton compiles through no attribute of the kernel that a test can count")
    compiled: list[str] = []
    real = kernel.compile

    def counting(*args, **kwargs):
        compiled.append("compile")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "compile", counting)
    size = codec.chunk_bytes(layout, CHUNK_BLOCKS)
    chunk = torch.zeros(size, dtype=torch.uint8, device="cuda")
    ids = torch.arange(CHUNK_BLOCKS, dtype=torch.int64, device="cuda")
    sums = torch.zeros(1, dtype=torch.int64, device="cuda")
    triton_ops.gather(layout, [ChunkSpan(chunk, CHUNK_BLOCKS, 0, ids)], checksums_out=sums)  # a save
    triton_ops.gather(layout, [ChunkSpan(chunk, CHUNK_BLOCKS, 0, ids)])  # a copy without sums
    target = ids + CHUNK_BLOCKS
    assert triton_ops.scatter(layout, [ChunkSpan(chunk, CHUNK_BLOCKS, 0, target)], sums) == [True]  # a load
    triton_ops.scatter(layout, [ChunkSpan(chunk, CHUNK_BLOCKS, 0, target)])
    assert compiled == [], "a copy after the warm-up compiled a kernel variant the warm-up missed"
    for name, t in kv.items():  # and the copies moved what they should: the warm-up broke nothing
        assert torch.equal(t[CHUNK_BLOCKS : 2 * CHUNK_BLOCKS], before[name][:CHUNK_BLOCKS])
    # the count can fail: a variant the warm-up never made (another tile) is compiled, and counted
    plan = triton_ops.build_plan(layout, [ChunkSpan(chunk, CHUNK_BLOCKS, 0, ids)])
    triton_ops.launch(plan, gather=True, tile_bytes=1024)
    torch.cuda.synchronize()
    assert compiled == ["compile"], f"a new variant's compile was not counted: {compiled}"
