"""GPU copy backends (Triton, CUDA C++, DMA) equal the per-block reference byte for byte, and their
KVSUM64 checksums equal the CPU reference and catch corrupted chunks. Skipped without CUDA."""

import threading
from functools import partial

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from kvtier import codec
from kvtier.layout import Layout, Region, build_layout
from kvtier.ops import ChunkSpan, cuda_ops, dma_ops, reference, triton_ops
from kvtier.ops.checksum import payload_checksum, to_unsigned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32]
BACKENDS = ["triton", "triton-tile512", "cuda", "dma-staged", "dma-staged-triton", "dma-batch", "dma-loop"]
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _triton_small_tiles(plan, *, gather, sums=None, max_ctas=None):
    # 512-byte tiles: blocks span several tiles, exercising the masked tail of the tile loop
    triton_ops.launch(plan, gather=gather, sums=sums, max_ctas=max_ctas, tile_bytes=512, num_warps=4)


def ops(name: str, ctas: int):
    """``(gather, scatter)`` of backend ``name`` with a CTA budget; skips if it can't run here."""
    if name.startswith("triton") and not triton_ops.available():
        pytest.skip("triton unavailable")
    if name == "triton":
        return partial(triton_ops.gather, max_ctas=ctas), partial(triton_ops.scatter, max_ctas=ctas)
    if name == "triton-tile512":
        return (
            lambda lay, sp, out=None: triton_ops.run_copy(lay, sp, _triton_small_tiles, gather=True, checksums_out=out, max_ctas=ctas),
            lambda lay, sp, exp=None: triton_ops.run_copy(lay, sp, _triton_small_tiles, gather=False, expected_checksums=exp, max_ctas=ctas),
        )
    if name == "cuda":
        if not cuda_ops.available():
            pytest.skip(f"CUDA C++ extension unavailable: {cuda_ops.build_error()}")
        return partial(cuda_ops.gather, max_ctas=ctas), partial(cuda_ops.scatter, max_ctas=ctas)
    _, mode, *kernel = name.split("-")
    if not dma_ops.available(mode):
        pytest.skip(f"DMA mode {mode} unavailable")
    # a small staging area forces several groups per slot ring, so slots are reused
    kw = dict(mode=mode, max_ctas=ctas, stage_bytes=1 << 17, kernel=kernel[0] if kernel else "auto")
    return partial(dma_ops.gather, **kw), partial(dma_ops.scatter, **kw)


@st.composite
def layouts(draw):
    """Random engine memory: 1-3 layers of 1-3 regions, random block sizes (multiples of 16 B)
    and padding inside and between blocks, in a random dtype filled with random bytes."""
    dtype = draw(st.sampled_from(DTYPES))
    num_blocks = draw(st.integers(2, 24))
    regions, backings = [], []
    for layer in range(draw(st.integers(1, 3))):
        sizes = [16 * draw(st.integers(1, 96)) for _ in range(draw(st.integers(1, 3)))]
        gaps = [16 * draw(st.integers(0, 4)) for _ in range(len(sizes) + 1)]
        stride = sum(sizes) + sum(gaps)
        backing = torch.empty(num_blocks, stride // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device="cuda")
        raw = backing.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda"))
        at = gaps[0]
        for i, size in enumerate(sizes):
            regions.append(Region(f"l{layer}.{i}", raw[:, at : at + size]))
            at += size + gaps[i + 1]
        backings.append(raw)
    return Layout(tuple(regions), 16, bytes(16)), backings


@st.composite
def chunk_spans(draw, num_blocks):
    """``[(n, first, block_ids)]``: sub-ranges of chunks onto distinct engine blocks."""
    perm = draw(st.permutations(range(num_blocks)))
    out, used = [], 0
    for _ in range(draw(st.integers(1, 4))):
        if used == num_blocks:
            break
        n = draw(st.integers(1, 6))
        first = draw(st.integers(0, n - 1))
        k = draw(st.integers(1, min(n - first, num_blocks - used)))
        out.append((n, first, perm[used : used + k]))
        used += k
    return out


def make_spans(layout, plans, *, pinned=True):
    spans = []
    for n, first, ids in plans:
        size = codec.chunk_bytes(layout, n)
        buf = torch.randint(0, 256, (size,), dtype=torch.uint8)
        buf = buf.pin_memory() if pinned else buf.cuda()
        spans.append(ChunkSpan(buf, n, first, torch.tensor(ids, dtype=torch.int64, device="cuda")))
    return spans


def clone_spans(spans):
    """Copies of the spans' buffers, where they were (pinned host stays pinned)."""
    copy = lambda b: b.clone().pin_memory() if b.is_pinned() else b.clone()  # noqa: E731
    return [ChunkSpan(copy(s.buffer), s.num_blocks, s.first, s.block_ids) for s in spans]


def span_checksum(layout, span) -> int:
    """KVSUM64 of the span's own blocks at their chunk positions, by the CPU reference."""
    buf, k, total = span.buffer.cpu(), span.block_ids.numel(), 0
    for region, off in zip(layout.regions, codec.region_offsets(layout, span.num_blocks)):
        a = off + span.first * region.block_bytes
        total += payload_checksum(buf[a : a + k * region.block_bytes], (a - codec.HEADER_BYTES) // 4)
    return to_unsigned(total)


def chunk_checksum(layout, span) -> int:
    return payload_checksum(span.buffer.cpu()[codec.HEADER_BYTES : codec.chunk_bytes(layout, span.num_blocks)])


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(data=st.data())
def test_gather_matches_reference_and_checksums(backend, data):
    layout, _ = data.draw(layouts())
    plans = data.draw(chunk_spans(layout.num_blocks))
    gather, _ = ops(backend, data.draw(st.sampled_from([1, 3, 16, 132])))
    ours = make_spans(layout, plans, pinned=data.draw(st.booleans()) or backend.startswith("dma"))
    theirs = clone_spans(ours)
    sums = torch.zeros(len(ours), dtype=torch.int64, device="cuda")
    gather(layout, ours, sums)
    reference.gather(layout, theirs)
    torch.cuda.synchronize()
    for a, b in zip(ours, theirs):
        assert torch.equal(a.buffer.cpu(), b.buffer.cpu())  # header and other blocks untouched too
    assert [to_unsigned(v) for v in sums.tolist()] == [span_checksum(layout, s) for s in theirs]


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(data=st.data())
def test_scatter_matches_reference_and_verifies(backend, data):
    layout, backings = data.draw(layouts())
    plans = data.draw(chunk_spans(layout.num_blocks))
    _, scatter = ops(backend, data.draw(st.sampled_from([1, 3, 16, 132])))
    spans = make_spans(layout, plans, pinned=data.draw(st.booleans()) or backend.startswith("dma"))
    before = [b.clone() for b in backings]
    reference.scatter(layout, spans)
    want = [b.clone() for b in backings]
    for b, old in zip(backings, before):
        b.copy_(old)
    verify = data.draw(st.booleans())
    ok = scatter(layout, spans, [chunk_checksum(layout, s) for s in spans] if verify else None)
    assert ok == [True] * len(spans)
    for got, expected in zip(backings, want):  # whole allocations: padding and other blocks untouched
        assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(data=st.data())
def test_corrupted_chunk_is_reported(backend, data):
    layout, _ = data.draw(layouts())
    plans = data.draw(chunk_spans(layout.num_blocks))
    _, scatter = ops(backend, 16)
    spans = make_spans(layout, plans)
    expected = [chunk_checksum(layout, s) for s in spans]
    bad = data.draw(st.integers(0, len(spans) - 1))
    payload = layout.payload_bytes(spans[bad].num_blocks)
    at = codec.HEADER_BYTES + data.draw(st.integers(0, payload - 1))  # also outside a partial span
    spans[bad].buffer[at] ^= 1 << data.draw(st.integers(0, 7))
    assert scatter(layout, spans, expected) == [i != bad for i in range(len(spans))]


def test_swapped_blocks_are_reported():
    if not triton_ops.available():
        pytest.skip("triton unavailable")
    alloc = torch.randn(2, 8, 16, 2, 64, device="cuda").to(torch.bfloat16)
    layout = build_layout({"l0": alloc}, 16, 8)
    span = make_spans(layout, [(4, 0, [5, 2, 7, 0])])[0]
    expected = [chunk_checksum(layout, span)]
    size = layout.regions[0].block_bytes
    a = codec.HEADER_BYTES + torch.arange(size)
    block0, block1 = span.buffer[a].clone(), span.buffer[a + size].clone()
    span.buffer[a], span.buffer[a + size] = block1, block0
    assert triton_ops.scatter(layout, [span], expected) == [False]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [True, False])
def test_vllm_layouts_round_trip(dtype, split):
    """build_layout's real shapes (K/V split and one region per layer): gather then scatter into
    a fresh engine restores the blocks exactly, with verification on."""
    if not triton_ops.available():
        pytest.skip("triton unavailable")
    shape = (2, 32, 16, 8, 128) if split else (32, 16, 8, 256)
    src = {f"l{i}": torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, device="cuda").view(dtype) for i in range(3)}
    dst = {k: torch.zeros_like(v.view(torch.uint8)).view(dtype) for k, v in src.items()}
    ids = torch.randperm(32, device="cuda")[:12]
    spans = make_spans(build_layout(src, 16, 32), [(4, 0, ids[:4].tolist()), (4, 0, ids[4:8].tolist()), (4, 1, ids[8:11].tolist())])
    sums = torch.zeros(3, dtype=torch.int64, device="cuda")
    triton_ops.gather(build_layout(src, 16, 32), spans, sums)
    ok = triton_ops.scatter(build_layout(dst, 16, 32), spans[:2], sums[:2])
    assert ok == [True, True]
    for name in src:
        s, d = src[name].view(torch.uint8), dst[name].view(torch.uint8)
        blocks = (slice(None), ids[:8]) if split else (ids[:8],)
        assert torch.equal(s[blocks], d[blocks])


@SETTINGS
@given(data=st.data())
def test_triton_and_cuda_are_identical(data):
    if not (triton_ops.available() and cuda_ops.available()):
        pytest.skip("needs both the Triton and the CUDA C++ backends")
    layout, backings = data.draw(layouts())
    plans = data.draw(chunk_spans(layout.num_blocks))
    ctas = data.draw(st.sampled_from([1, 7, 64]))
    a = make_spans(layout, plans)
    b = clone_spans(a)
    sa, sb = (torch.zeros(len(a), dtype=torch.int64, device="cuda") for _ in range(2))
    triton_ops.gather(layout, a, sa, max_ctas=ctas)
    cuda_ops.gather(layout, b, sb, max_ctas=ctas)
    assert all(torch.equal(x.buffer, y.buffer) for x, y in zip(a, b)) and torch.equal(sa, sb)
    src = make_spans(layout, plans)
    expected = [chunk_checksum(layout, s) for s in src]
    before = [x.clone() for x in backings]
    assert triton_ops.scatter(layout, src, expected, max_ctas=ctas) == [True] * len(src)
    after_triton = [x.clone() for x in backings]
    for x, old in zip(backings, before):
        x.copy_(old)
    assert cuda_ops.scatter(layout, src, expected, max_ctas=ctas) == [True] * len(src)
    assert all(torch.equal(x, y) for x, y in zip(backings, after_triton))


def test_staged_calls_in_flight_from_two_threads_keep_their_bytes():
    """Regression for the staging ring shared between calls: several gathers and scatters left in
    flight at once, from two threads (the engine's saves and the load thread), each through a
    ring of tiny slots that later calls reuse. Every byte must equal the per-block reference."""
    if not dma_ops.available("staged"):
        pytest.skip("DMA staged mode unavailable")
    alloc = torch.randint(0, 256, (2, 2, 64, 16, 2, 64), dtype=torch.uint8, device="cuda").view(torch.bfloat16)
    layout = build_layout({f"l{i}": alloc[i] for i in range(2)}, 16, 64)
    kw = dict(stage_bytes=1 << 18, slots=3)
    perm = torch.randperm(64).tolist()
    out_plans = [[(4, 0, perm[8 * c : 8 * c + 4]), (4, 1, perm[8 * c + 4 : 8 * c + 7])] for c in range(4)]
    in_plans = [[(4, 0, perm[32 + 8 * c : 36 + 8 * c])] for c in range(4)]  # blocks no gather reads
    outs = [make_spans(layout, p) for p in out_plans]
    ins = [make_spans(layout, p) for p in in_plans]
    want_out = [clone_spans(s) for s in outs]
    for spans in want_out:
        reference.gather(layout, spans)
    errors = []

    def saves():
        try:
            sums = [torch.zeros(len(s), dtype=torch.int64).pin_memory() for s in outs]
            copying = [dma_ops.gather_async(layout, s, out, **kw) for s, out in zip(outs, sums)]  # all in flight
            for c in copying:
                c.wait()
            assert [[to_unsigned(v) for v in out.tolist()] for out in sums] == \
                [[span_checksum(layout, s) for s in spans] for spans in want_out]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=saves)
    thread.start()
    copying = [dma_ops.scatter_async(layout, s, [chunk_checksum(layout, x) for x in s], **kw) for s in ins]
    assert [c.wait() for c in copying] == [[True]] * len(ins)
    thread.join()
    assert not errors, errors
    for got, want in zip(outs, want_out):
        for a, b in zip(got, want):
            assert torch.equal(a.buffer, b.buffer)
    for spans in ins:  # read back through the reference: the scattered blocks hold the chunks
        back = clone_spans(spans)
        reference.gather(layout, back)
        torch.cuda.synchronize()
        for a, b in zip(spans, back):
            assert torch.equal(a.buffer, b.buffer)


@SETTINGS
@given(data=st.data())
def test_block_sums_read_whole_chunks_like_a_save_and_write_nothing(data):
    """The P/D checksum pass (:class:`kvtier.transfer.landed.BlockSums`): a read-only plan on the
    current stream, whose sums equal those of the chunk a save would write."""
    from kvtier.transfer.landed import BlockSums

    layout, backings = data.draw(layouts())
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ids = data.draw(st.permutations(range(layout.num_blocks)))
    chunks, at = [], 0
    for n in sizes:
        if at + n > layout.num_blocks:
            break
        chunks.append(torch.tensor(ids[at:at + n], dtype=torch.int64, device="cuda"))
        at += n
    assume(chunks)  # a first size past the layout's blocks leaves nothing to sum
    before = [b.clone() for b in backings]
    got = BlockSums(layout, chunk_blocks=4).launch([(c, c.numel()) for c in chunks])
    assert isinstance(got, torch.Tensor) and got.device.type == "cuda"
    saved = [ChunkSpan(torch.zeros(codec.chunk_bytes(layout, c.numel()), dtype=torch.uint8).pin_memory(), c.numel(), 0, c)
             for c in chunks]
    reference.gather(layout, saved)
    torch.cuda.synchronize()
    assert [to_unsigned(v) for v in got.tolist()] == [chunk_checksum(layout, s) for s in saved]
    assert all(torch.equal(a, b) for a, b in zip(before, backings))
