"""The chunk server under hostile input: malformed, oversized, wrong-version and unauthenticated
messages are refused (and counted) and the server keeps serving well-formed peers.

A consumer past the handshake (its nonce, its NIXL agent and engine KV given: P may WRITE into
it) sends any fetches of a published transfer under P's lease: HBM or not, naming its own engine
blocks in and out of the count it gave, as many as the chunk's or not, bound to its hello or
not. Each is answered, and P WRITEs only into blocks a fetch named that can be (real NIXL over
UCX on loopback; host memory stands in for VRAM): every other block of the consumer's engine KV
keeps its bytes, and a chunk said written holds the producer's."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import ask
from pd_workers import NUM_BLOCKS, prompt_keys, tokens_of
from kvtier.jobs import Lend, SaveJob
from kvtier.pd.channel import connect_dealer
from kvtier.pd.consumer.hello import introduce
from kvtier.pd.protocol import (
    MAX_BATCH, VERSION, ChunkReplies, Fetch, Fetches, Hello, HelloReply, Release, decode_reply, encode, mac,
)

SECRET = b"fuzz-secret"
EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "60"))  # per test; the slow run sets 100000


PROMPT = tokens_of(100, seed=4)  # three full chunks and a 4-token tail: 7 blocks
P_BLOCKS = [10, 11, 12, 13, 20, 21, 22]
KEYS = [*prompt_keys(PROMPT)[0], prompt_keys(PROMPT)[1]]
CHUNK_BLOCKS = [P_BLOCKS[0:2], P_BLOCKS[2:4], P_BLOCKS[4:6], P_BLOCKS[6:7]]  # P's blocks of each chunk


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    """P with a secret and NIXL, its prompt published as transfer t1 and its blocks lent (a long lease)."""
    from pd_workers import make_engine

    engine = make_engine(tmp_path_factory.mktemp("fuzz"), "p", 1, pd_secret=SECRET.decode(), pd_transport="nixl")
    assert engine.side.nixl_ready()
    engine.side.save((SaveJob("p-req", tuple(KEYS), tuple(P_BLOCKS), publish="t1", final=True, lease=True),))
    assert engine.side.settle()
    engine.side.lend((Lend("p-req", "t1", tuple(P_BLOCKS), tuple(KEYS), 600_000),))
    yield engine
    engine.side.close()


@pytest.fixture(scope="module")
def consumer(tmp_path_factory):
    """A decode engine whose NIXL agent and engine KV the fuzz hands to P (it never fetches itself)."""
    from pd_workers import make_engine

    engine = make_engine(tmp_path_factory.mktemp("fuzz-d"), "d", 2, produce=False, pd_secret=SECRET.decode(),
                         pd_transport="nixl")
    assert engine.side.nixl_ready()
    yield engine
    engine.side.close()


def hello() -> Hello:
    """A hello the server takes: a fresh nonce, sent now."""
    return introduce(Hello(VERSION, 0, 1, b"f" * 16, "fuzz", 32))


def signed(message: msgspec.Struct, secret: bytes | None = SECRET) -> list[bytes]:
    body = encode(message)
    return [mac(secret, body), body]


def still_serves(endpoint: str) -> None:
    reply = ask(endpoint, signed(hello()), timeout_ms=2000, secret=SECRET)
    assert reply is not None, "the chunk server stopped answering"
    assert isinstance(decode_reply(reply[1]), HelloReply)


any_fetch = st.builds(Fetch, st.integers(-2, 7), st.text(max_size=300), st.integers(-1, 1 << 21),
                      st.binary(max_size=20), st.integers(-1, 1 << 21), st.booleans())
structs = st.one_of(
    st.builds(Hello, st.integers(-2, 3), st.integers(-1, 4), st.integers(-1, 4), st.binary(max_size=20),
              st.text(max_size=50), st.integers(-1, 1 << 21), transfer_id=st.text(max_size=300)),
    any_fetch,
    st.builds(Fetches, st.integers(-2, 7), st.lists(any_fetch, max_size=MAX_BATCH + 1).map(tuple)),
    st.builds(Release, st.integers(-2, 3), st.text(max_size=300)),
)
raw_frames = st.lists(st.binary(max_size=200), min_size=0, max_size=4)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=structs, authenticated=st.booleans())
def test_any_struct_signed_or_not_is_answered_or_refused(producer, message, authenticated):
    frames = signed(message, SECRET if authenticated else None)
    before = producer.side.chunk_server.rejected
    ask(producer.endpoint, frames, timeout_ms=300, secret=SECRET)
    if not authenticated:
        assert producer.side.chunk_server.rejected == before + 1
    still_serves(producer.endpoint)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=raw_frames)
def test_garbage_frames_are_refused(producer, frames):
    before = producer.side.chunk_server.rejected
    if frames:
        ask(producer.endpoint, frames, timeout_ms=300, secret=SECRET)
        assert producer.side.chunk_server.rejected == before + 1
    still_serves(producer.endpoint)


def test_oversized_message_is_dropped_unread(producer):
    ask(producer.endpoint, [b"", b"x" * (1 << 20)], timeout_ms=300, secret=SECRET)
    still_serves(producer.endpoint)


def test_tampered_body_fails_its_mac(producer):
    frames = signed(Release(VERSION, "t"))
    frames[1] = frames[1][:-1] + b"u"
    before = producer.side.chunk_server.rejected
    reply = ask(producer.endpoint, frames, timeout_ms=2000, secret=SECRET)
    assert producer.side.chunk_server.rejected == before + 1
    assert decode_reply(reply[1]).status == "refused"


def test_non_loopback_bind_without_a_secret_is_refused_at_start():
    from kvtier.config import ConfigError, KvtierConfig

    with pytest.raises(ConfigError, match="'pd_bind'"):
        KvtierConfig.from_dict({"pd_bind": "0.0.0.0"})
    assert KvtierConfig.from_dict({"pd_bind": "0.0.0.0", "pd_secret": "s"}).secret == b"s"


@st.composite
def consumer_fetch(draw) -> tuple:
    """(chunk of P's prompt (4: a chain key P does not have), its block count (None: the chunk's),
    hbm, wait, the consumer's engine blocks P may WRITE it into): mostly as many as the chunk's,
    in and out of the consumer's count (and registration), sometimes any."""
    chunk = draw(st.integers(0, 4))
    count = len(CHUNK_BLOCKS[min(chunk, 3)])
    ids = st.integers(0, NUM_BLOCKS + 2)
    blocks = draw(st.one_of(st.lists(ids, min_size=count, max_size=count, unique=True).map(tuple), st.just(()),
                            st.lists(st.one_of(ids, st.integers(0, 1 << 40)), max_size=3).map(tuple)))
    num_blocks = draw(st.one_of(st.none(), st.none(), st.integers(0, 3)))
    return chunk, num_blocks, draw(st.booleans()), draw(st.booleans()), blocks


consumer_fetches = st.lists(consumer_fetch(), min_size=1, max_size=6)


@settings(max_examples=max(20, EXAMPLES // 5), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fetched=consumer_fetches, claimed=st.sampled_from([NUM_BLOCKS, NUM_BLOCKS // 2]), batched=st.booleans(),
       bound=st.sampled_from([True, True, True, False]))
def test_a_consumer_past_the_handshake_is_written_only_where_its_fetches_name_blocks_that_can_be(
        producer, consumer, fetched, claimed, batched, bound):
    """``claimed``: the engine block count the consumer's hello gives (half its registered KV: the
    blocks past it are registered, NIXL would take them). ``bound``: its fetches carry its hello's
    nonce (else another, as replayed from another connection)."""
    regions = tuple((r.base, r.stride, r.block_bytes) for r in consumer.side.engine_kv.spans)
    hello = introduce(consumer.side._hello, transports=("nixl", "zmq"), hbm=True, transfer_id="t1",
                      nixl=consumer.side.nixl.metadata(), regions=regions, num_blocks=claimed)
    nonce = hello.nonce if bound else b"n" * 16  # another hello's
    keys = [*KEYS, b"u" * 16]  # and one P does not have
    fetches = [Fetch(VERSION, "t1", i, keys[c], len(CHUNK_BLOCKS[min(c, 3)]) if n is None else n, wait, tokens=0,
                     hbm=hbm, blocks=blocks, nonce=nonce)
               for i, (c, n, hbm, wait, blocks) in enumerate(fetched)]
    messages = [Fetches(VERSION, tuple(fetches), nonce)] if batched and len(fetches) > 1 else fetches
    writable = [f for f in fetches if bound and f.blocks and len(f.blocks) == f.num_blocks
                and all(b < claimed for b in f.blocks)]
    before = consumer.kv.clone()
    socket = connect_dealer(producer.endpoint, SECRET, 1 << 24)
    try:
        socket.send_multipart(signed(hello))
        assert socket.poll(5000) and isinstance(decode_reply(socket.recv_multipart()[1]), HelloReply)
        for message in messages:
            socket.send_multipart(signed(message))
        replies, expected = [], (len(fetches) if bound else len(messages))
        deadline = time.monotonic() + 10
        while len(replies) < expected:
            assert time.monotonic() < deadline, f"{len(replies)} of {expected} fetches answered"
            consumer.side.nixl.progress()  # P WRITEs into this agent's memory
            if socket.poll(1):
                reply = decode_reply(socket.recv_multipart()[1])
                replies += [r for r in (reply.replies if isinstance(reply, ChunkReplies) else (reply,))
                            if r.status != "pending"]
    finally:
        socket.close(0)
    if not bound:
        assert all(r.status == "refused" for r in replies)
    named = [b for f in writable for b in f.blocks]
    allowed = set(named)
    others = [b for b in range(NUM_BLOCKS) if b not in allowed]
    assert torch.equal(consumer.kv[:, others], before[:, others]), "P wrote into blocks no fetch could name"
    for reply in replies:
        if reply.status == "ok" and reply.written and reply.blocks:
            fetch = fetches[reply.index]
            assert fetch in writable and tuple(reply.blocks) == fetch.blocks
            chunk = KEYS.index(fetch.key)
            if all(named.count(b) == 1 for b in fetch.blocks):  # no other fetch may have written there
                assert torch.equal(consumer.blocks(fetch.blocks), producer.blocks(CHUNK_BLOCKS[chunk]))
