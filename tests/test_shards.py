"""Chunks keyed by KV heads (kvtier.shards): head ranges, piece fingerprints, joining pieces of another TP size
into a rank's chunk for every layout kind (bytes compared with slicing one reference tensor), MLA's one piece, and
the layouts that stay per TP rank."""

from __future__ import annotations

import pytest
import torch

from kvtier.layout import build_layout
from kvtier.ops import cpu_library
from kvtier.codec import HEADER_BYTES
from kvtier.ops.cpu_ops import scatter
from kvtier.ops.cpu_pieces import join_checked, split_checked, split_plan
from kvtier.ops.span import PieceSpan
from kvtier.shards import WRITER_TP_SIZES, covers, join_pieces, join_plan, piece_fingerprint, rank_heads

HEADS, NB, BS, HS, LAYERS = 8, 6, 32, 4, 2


def reference(kind: str, seed: int = 0) -> torch.Tensor:
    """Every KV head of ``LAYERS`` layers in ``kind``'s layout, the head dim at :func:`head_dim_of`."""
    g = torch.Generator().manual_seed(seed)
    shape = {"cpu": (NB, LAYERS, HEADS, BS, 2 * HS), "nhd": (LAYERS, 2, NB, BS, HEADS, HS),
             "hnd": (LAYERS, 2, NB, HEADS, BS, HS), "flashinfer": (LAYERS, NB, 2, BS, HEADS, HS),
             "lbnhc": (LAYERS, NB, BS, HEADS, 2 * HS)}[kind]
    return torch.randn(shape, generator=g).to(torch.bfloat16 if kind != "cpu" else torch.float32)


def head_dim_of(kind: str) -> int:
    return {"cpu": 2, "nhd": 4, "hnd": 3, "flashinfer": 4, "lbnhc": 3}[kind]


def rank_kv(kind: str, ref: torch.Tensor, heads: tuple[int, int]) -> dict[str, torch.Tensor]:
    """What a rank holding ``heads`` registers: its own allocation, laid out as the engine lays it out."""
    mine = ref.narrow(head_dim_of(kind), heads[0], heads[1] - heads[0]).contiguous()
    if kind == "cpu":
        return {f"layer.{i}": mine[:, i] for i in range(LAYERS)}
    if kind == "hnd":  # vLLM's view: [2, num_blocks, block_size, heads, head_size] over HND memory
        return {f"layer.{i}": mine[i].transpose(2, 3) for i in range(LAYERS)}
    if kind == "lbnhc":  # vLLM 0.33's flash view: [num_blocks, heads, block_size, 2*head_size] over NHD memory
        return {f"layer.{i}": mine[i].transpose(1, 2) for i in range(LAYERS)}
    return {f"layer.{i}": mine[i] for i in range(LAYERS)}


def layout_of(kind, ref, tp_rank, tp_size, **facts):
    heads = rank_heads(HEADS, tp_rank, tp_size)
    kv = rank_kv(kind, ref, heads)
    return build_layout(kv, BS, NB, model="m", tp_rank=tp_rank, tp_size=tp_size, kv_heads=HEADS // tp_size,
                        total_kv_heads=HEADS, **facts), kv


def payload(layout, ids) -> torch.Tensor:
    """Blocks ``ids`` of every region, region-major: a chunk's payload as a save gathers it."""
    return torch.cat([region.blocks[ids].reshape(-1) for region in layout.regions])


def test_head_ranges_split_evenly():
    assert [rank_heads(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert rank_heads(8, 0, 1) == (0, 8)


def test_covers_are_other_tp_sizes_pieces_fewest_first():
    assert covers(0, 4, 8) == [((0, 8),), ((0, 2), (2, 4)), ((0, 1), (1, 2), (2, 3), (3, 4))]
    assert covers(0, 8, 8) == [((0, 4), (4, 8)), ((0, 2), (2, 4), (4, 6), (6, 8)), tuple((h, h + 1) for h in range(8))]
    assert covers(3, 6, 6) == [((0, 6),)]  # 6 heads: writers at TP 1 and 2 only
    assert all(len(covers(r, r + 1, 8)) == len(WRITER_TP_SIZES) - 1 for r in range(8))


@pytest.mark.parametrize("kind", ["cpu", "nhd", "hnd", "flashinfer", "lbnhc"])
def test_one_base_fingerprint_at_every_tp_size_and_one_piece_key_per_head_range(kind):
    ref = reference(kind)
    layouts = {(t, r): layout_of(kind, ref, r, t)[0] for t in (1, 2, 4, 8) for r in range(t)}  # 8: a head a rank
    assert len({layout.shard.base for layout in layouts.values()}) == 1
    base = layouts[1, 0].shard.base
    for (t, r), layout in layouts.items():
        assert (layout.shard.first, layout.shard.end, layout.shard.total) == (*rank_heads(HEADS, r, t), HEADS)
        assert layout.fingerprint == piece_fingerprint(base, rank_heads(HEADS, r, t))
        assert layout.rank_fingerprint != layout.fingerprint  # the per-rank meaning, kept
    assert len({layout.fingerprint for layout in layouts.values()}) == len(layouts)


@pytest.mark.parametrize("kind", ["cpu", "nhd", "hnd", "flashinfer", "lbnhc"])
@pytest.mark.parametrize("writer, reader", [(1, 2), (2, 1), (4, 2), (2, 4), (1, 4), (4, 1), (1, 8), (8, 1)])
def test_a_rank_joins_its_chunk_from_another_tp_sizes_pieces(kind, writer, reader):
    ref, ids = reference(kind, seed=writer * 10 + reader), [4, 1, 3]
    written = {heads: payload(layout_of(kind, ref, r, writer)[0], ids)
               for r in range(writer) for heads in [rank_heads(HEADS, r, writer)]}
    for r in range(reader):
        layout, _ = layout_of(kind, ref, r, reader)
        shard = layout.shard
        way = next(w for w in covers(shard.first, shard.end, HEADS) if all(h in written for h in w))
        dst = torch.zeros(layout.payload_bytes(len(ids)), dtype=torch.uint8)
        region_bytes = tuple(g.block_bytes * len(ids) for g in layout.regions)
        join_pieces(dst, shard, region_bytes, [(h, written[h]) for h in way])
        assert torch.equal(dst, payload(layout, ids))  # what the reader's own engine would have saved
        if cpu_library.available():  # the same join in one C pass that sums what it writes and checks
            # each piece: every byte of it summed at its own place, those of heads it does not copy
            # (a piece holding more heads than the reader's) too
            again = torch.full_like(dst, 0xCD)
            kvsum, piece_sums = join_checked(again, [written[h] for h in way], join_plan(shard, region_bytes, tuple(way)))
            assert torch.equal(again, dst) and kvsum == cpu_library.payload_checksum(dst)
            assert piece_sums == [cpu_library.payload_checksum(written[h]) for h in way]


@pytest.mark.skipif(not cpu_library.available(), reason="needs the C library")
@pytest.mark.parametrize("kind", ["cpu", "nhd", "hnd", "flashinfer", "lbnhc"])
@pytest.mark.parametrize("writer, reader", [(1, 2), (1, 4), (2, 4)])
def test_one_pass_splits_a_piece_into_every_reader_s_part(kind, writer, reader):
    """The other way round: one writer's piece cut into the chunks of every reader rank whose heads it
    holds, each summed as written, the piece summed whole; plans that miss a byte are refused."""
    ref, ids = reference(kind, seed=writer * 10 + reader + 1), [2, 0, 3]
    mine, _ = layout_of(kind, ref, 0, writer)
    source = payload(mine, ids)
    theirs = [layout_of(kind, ref, r, reader)[0] for r in range(reader // writer)]
    held = (mine.shard.first, mine.shard.end)
    parts = tuple((t.shard, tuple(g.block_bytes * len(ids) for g in t.regions)) for t in theirs)
    plan = split_plan(parts, held)
    assert int(plan[:, 3].sum()) == source.numel()
    dsts = [torch.full((t.payload_bytes(len(ids)),), 0xCD, dtype=torch.uint8) for t in theirs]
    sums, whole = split_checked(dsts, source, plan)
    assert whole == cpu_library.payload_checksum(source)
    for dst, t, kvsum in zip(dsts, theirs, sums):
        assert torch.equal(dst, payload(t, ids)) and kvsum == cpu_library.payload_checksum(dst)
    try:  # parts that miss heads of the piece: refused, or short of its bytes (seal_split then cuts none)
        short = int(split_plan(parts[:1], held)[:, 3].sum())
    except ValueError:
        short = None
    assert short != source.numel()


def test_mla_is_one_piece_on_every_rank_and_tp_size():
    latent = torch.randn(NB, BS, 24)
    layouts = [build_layout({"mla": latent.clone()}, BS, NB, model="m", tp_rank=r, tp_size=t, kv_heads=0)
               for t in (1, 2, 4) for r in range(t)]
    assert all(layout.shard.replicated for layout in layouts)
    assert len({layout.fingerprint for layout in layouts}) == 1
    assert len({layout.rank_fingerprint for layout in layouts}) == len(layouts)


def test_a_true_mismatch_changes_the_base_fingerprint():
    ref = reference("nhd")
    base = layout_of("nhd", ref, 0, 2)[0].shard.base
    assert layout_of("hnd", reference("hnd"), 0, 2)[0].shard.base != base  # page layout
    assert build_layout(rank_kv("nhd", ref.half(), (0, 4)), BS, NB, model="m", tp_size=2, kv_heads=4,
                        total_kv_heads=HEADS).shard.base != base  # dtype
    assert build_layout(rank_kv("nhd", ref, (0, 4)), BS, NB, model="other", tp_size=2, kv_heads=4,
                        total_kv_heads=HEADS).shard.base != base  # model
    cpu = reference("cpu")
    kv = rank_kv("cpu", cpu, (0, 8))
    at32 = build_layout(kv, 32, NB, kv_heads=8, total_kv_heads=8).shard.base
    assert build_layout(kv, 16, NB, kv_heads=8, total_kv_heads=8).shard.base != at32  # block size where it matters


def test_layouts_that_cannot_be_joined_stay_per_rank(caplog):
    ref = reference("cpu")
    kv = rank_kv("cpu", ref, (0, 4))
    plain = build_layout(kv, BS, NB, tp_rank=1, tp_size=2)  # no head count given
    assert plain.shard is None and plain.fingerprint == plain.rank_fingerprint
    with caplog.at_level("WARNING", logger="kvtier.layout"):
        replicated = build_layout(rank_kv("cpu", ref, (0, 1)), BS, NB, tp_size=2, kv_heads=1, total_kv_heads=1)
    assert replicated.shard is None and "do not split the model's 1 evenly" in caplog.text
    both = torch.zeros(NB, BS, 2, 2, HS)  # heads or K and V? (not K and V outermost in the block)
    assert build_layout({"l": both}, BS, NB, tp_size=4, kv_heads=2, total_kv_heads=HEADS).shard is None
    outside = torch.zeros(4, NB, BS, HS).transpose(0, 1)  # heads outside the block in memory: a region per head
    assert build_layout({"l": outside}, BS, NB, tp_size=2, kv_heads=4, total_kv_heads=HEADS).shard is None
    assert build_layout(kv, BS, NB, tp_rank=1, tp_size=2, kv_heads=3, total_kv_heads=HEADS).shard is None


@pytest.mark.parametrize("kind", ["cpu", "nhd", "hnd", "flashinfer", "lbnhc"])
def test_one_head_per_rank_keeps_the_base_fingerprint(kind):
    """One head per rank makes vLLM-CPU's block ``[1, block_size, 2*head_size]`` look token-contiguous
    (its size-1 head dim is skipped): the base must still be TP=1's, block size included."""
    ref = reference(kind).narrow(head_dim_of(kind), 0, 2).contiguous()
    bases = {build_layout(rank_kv(kind, ref, rank_heads(2, r, t)), BS, NB, model="m", tp_rank=r, tp_size=t,
                          kv_heads=2 // t, total_kv_heads=2).shard.base for t in (1, 2) for r in range(t)}
    assert len(bases) == 1


@pytest.mark.skipif(not cpu_library.available(), reason="the C copy library does not build here")
@pytest.mark.parametrize("kind", ["cpu", "nhd", "lbnhc"])
@pytest.mark.parametrize("writer, reader", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_pieces_scatter_straight_into_the_readers_head_slices_checked_whole(kind, writer, reader):
    ref, src = reference(kind, seed=writer * 7 + reader), [4, 1, 3]
    pieces = {}
    for r in range(writer):
        data = payload(layout_of(kind, ref, r, writer)[0], src)
        whole = torch.zeros(HEADER_BYTES + data.numel(), dtype=torch.uint8)
        whole[HEADER_BYTES:] = data
        pieces[rank_heads(HEADS, r, writer)] = (whole, cpu_library.payload_checksum(data))
    for r in range(reader):
        engine, _ = layout_of(kind, torch.zeros_like(ref), r, reader)
        want, _ = layout_of(kind, ref, r, reader)
        shard = engine.shard
        way = next(w for w in covers(shard.first, shard.end, HEADS) if all(h in pieces for h in w))
        span = PieceSpan(tuple((h, pieces[h][0]) for h in way), len(src), 1, torch.tensor([5, 0]))  # blocks 1, 2
        assert scatter(engine, [span], [tuple(pieces[h][1] for h in way)]) == [True]
        assert torch.equal(payload(engine, [5, 0]), payload(want, src[1:]))
        assert not payload(engine, [1, 2, 3, 4]).any()  # no other block written
        # a flipped byte in the first piece's last word (heads the reader may not hold) fails the span
        bad = pieces[way[0]][0].clone()
        bad[-1] ^= 0x01
        spoilt = PieceSpan(((way[0], bad), *span.pieces[1:]), len(src), 0, torch.tensor([1, 2, 3]))
        assert scatter(engine, [spoilt], [tuple(pieces[h][1] for h in way)]) == [False]
