"""Hypothesis fuzz of the P/D messages kvtier decodes, beyond the chunk server's own fuzz
(``test_chunk_server_fuzz.py``): mutated encodings of valid requests against a real chunk server
without a secret (so they reach the decoder), every reply a decode engine reads from a hostile
producer (real ZMQ, real fetch code, a real CPU tier to land chunks in), and the
``kv_transfer_params`` a proxy hands an engine.

Each must be refused clearly (a ``refused`` reply, a ``PeerError``, ``None``), never crash, and
the server must answer the next valid peer. Where bytes may land in a decode engine's KV (a
hostile producer naming any engine blocks, in and out of the count its handshake gave; params
naming any ``remote_block_ids`` P's blocks are READ from before its reply, whatever
``kvtier_lent_until`` says), only the blocks D named change, and those hold the producer's bytes
or are reported for a recompute. ``KVTIER_FUZZ_EXAMPLES`` sets the examples per test (CI: 200;
the slow run: 100000; the tests against a producer run a tenth of it: a hostile producer that
answers nothing costs a timeout, a real one a whole transfer).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fuzzing import ask, mutated
from kvtier.pd.consumer import landing as pd_landing
from kvtier.pd import params as pd
from kvtier.pd.channel import bind_router
from kvtier.pd.consumer.fetch import Consumer, FetchSpec, PeerError, fetch_chunks
from kvtier.pd.consumer.hello import introduce
from kvtier.pd.protocol import (
    VERSION, ChunkReplies, ChunkReply, Fetch, Fetches, Hello, HelloReply, Release, decode_reply, decode_request, encode,
    mac,
)
from kvtier.jobs import Landed
from kvtier.pd.hbm import Landing, RegionSpan
from kvtier.storage import ChunkStore, StoreConfig

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
FP = b"f" * 16
CHUNK_BYTES = 4096 + 64  # what the fetch below expects per chunk
ENGINE_BLOCK = 4096  # bytes of one engine block in the HBM-to-HBM fuzz (one region)
P_BLOCKS = 4  # the hostile producer's engine blocks: its lent buffer holds 4 (and a bit)


block_ids = st.one_of(st.integers(0, 70), st.integers(0, 1 << 40))  # an engine's 64 blocks, and beyond
nonces = st.binary(max_size=16)
fetches = st.builds(Fetch, st.just(VERSION), st.text(min_size=1, max_size=20), st.integers(0, 9),
                    st.binary(min_size=16, max_size=16), st.integers(0, 9), st.booleans(), hbm=st.booleans(),
                    blocks=st.lists(block_ids, max_size=4).map(tuple), nonce=nonces)
requests = st.one_of(
    st.builds(Hello, st.just(VERSION), st.integers(0, 3), st.integers(0, 3), st.just(FP), st.text(max_size=20),
              st.integers(0, 1 << 10), hbm=st.booleans(), transfer_id=st.text(max_size=20),
              regions=st.lists(st.tuples(*[st.integers(0, 1 << 40)] * 3), max_size=3).map(tuple),
              fetches=st.lists(fetches, max_size=3).map(tuple), num_blocks=st.integers(0, 1 << 20), nonce=nonces,
              sent_ms=st.one_of(st.integers(0, 1 << 53), st.builds(lambda: int(time.time() * 1000)))),
    fetches,
    st.builds(Fetches, st.just(VERSION), st.lists(fetches, min_size=1, max_size=4).map(tuple), nonces),
    st.builds(Release, st.just(VERSION), st.text(min_size=1, max_size=20), st.booleans(), nonces),
).map(encode)


@pytest.fixture(scope="module")
def open_producer(tmp_path_factory):
    """A real chunk server with no secret: every body reaches the decoder."""
    from pd_workers import make_engine

    engine = make_engine(tmp_path_factory.mktemp("pd-fuzz"), "p", 3)
    yield engine
    engine.side.close()


@FUZZ
@given(body=st.one_of(mutated(requests), st.binary(max_size=200)))
def test_mutated_requests_are_refused_clearly_and_the_chunk_server_keeps_serving(open_producer, body):
    endpoint = open_producer.endpoint
    try:
        message = decode_request(body)
        inner = getattr(message, "fetches", ())  # a batch's, or those a hello carries
        valid = message.version == VERSION and all(f.version == VERSION for f in inner)
    except (msgspec.DecodeError, ValueError):
        message, valid = None, False
    before = open_producer.side.chunk_server.rejected
    reply = ask(endpoint, [b"", body], timeout_ms=5000 if not valid or not isinstance(message, Release) else 100)
    if not valid:
        assert reply is not None, "a malformed request got no answer"
        answer = decode_reply(reply[1])
        assert isinstance(answer, ChunkReply) and answer.status == "refused" and answer.error
        assert open_producer.side.chunk_server.rejected == before + 1
    hello = ask(endpoint, [b"", encode(introduce(Hello(VERSION, 0, 1, FP, "fuzz", 32)))], timeout_ms=5000)
    assert hello is not None and isinstance(decode_reply(hello[1]), HelloReply), "the chunk server stopped answering"


class HostileProducer:
    """A ROUTER that answers each message with the next queued list of frames (a batch of fetches
    with as many as it holds; a hello with one more per fetch it carries, when ``hello_fetches``).
    A queued handshake reply answering a hello gets that hello's nonce (``echo``), signed again
    with ``secret`` (which also makes the ROUTER a CURVE server, as a chunk server with it is)."""

    def __init__(self, secret: bytes | None = None):
        self.socket, self.port = bind_router("tcp://127.0.0.1:0", secret, 1 << 20, 1000)
        self.secret = secret
        self.echo = True
        self.replies: list[list[bytes]] = []
        self.hello_fetches = False  # a hello's fetches take replies too (P lends the transfer)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(10):
                continue
            identity, *_, body = self.socket.recv_multipart()
            try:
                message = decode_request(body)
            except (msgspec.DecodeError, ValueError):
                message = None
            with self.lock:
                count = len(message.fetches) if isinstance(message, Fetches) else 1
                if isinstance(message, Hello) and self.hello_fetches:  # answered with it, as a lending P does
                    count += len(message.fetches)
                replies, self.replies[:count] = self.replies[:count], []
            if isinstance(message, Hello) and replies and self.echo:
                replies[0] = self.echoed(replies[0], message.nonce)
            for reply in replies:
                with contextlib.suppress(zmq.ZMQError):  # D gave up and went: its replies go nowhere
                    self.socket.send_multipart([identity, *reply])

    def echoed(self, frames: list[bytes], nonce: bytes) -> list[bytes]:
        """``frames`` (a handshake reply, if they decode as one) answering the hello of ``nonce``."""
        try:
            reply = decode_reply(frames[1]) if len(frames) == 2 else None
        except (msgspec.DecodeError, ValueError):
            reply = None
        if not isinstance(reply, HelloReply):
            return frames
        body = encode(msgspec.structs.replace(reply, nonce=nonce))
        return [mac(self.secret, body) if self.secret is not None else frames[0], body]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close()


@pytest.fixture(scope="module")
def hostile():
    producer = HostileProducer()
    store = ChunkStore(StoreConfig(cpu_bytes=8 << 20))
    yield producer, store
    producer.close()
    store.close()


good_hello = encode(HelloReply(VERSION, FP, "fuzz", 32, 1))
chunk_bodies = st.one_of(
    st.builds(ChunkReply, st.one_of(st.just(VERSION), st.integers(-2, 3)), st.integers(-1, 3),
              st.sampled_from(["ok", "missing", "pending", "refused", "released"]), st.text(max_size=10)).map(encode),
    mutated(st.just(encode(ChunkReply(VERSION, 0, "ok")))),
    st.binary(max_size=64),
)
reply_frames = st.one_of(
    st.tuples(st.just(b""), chunk_bodies).map(list),
    st.tuples(st.just(b""), chunk_bodies, st.one_of(st.binary(max_size=64), st.just(b"\0" * CHUNK_BYTES))).map(list),
    st.lists(st.binary(max_size=32), max_size=4),
)


def fetch_from_hostile(producer, store, wait: bool = False, nixl=None, landing=None) -> None:
    """Fetch two one-block chunks from the hostile producer with the real fetch code; each chunk
    that arrives must have the asked size (or, with ``landing``, have landed in the engine blocks),
    and is released. Only a ``PeerError`` may end it."""
    got = []
    try:
        consumer = Consumer(Hello(VERSION, 0, 1, FP, "fuzz", 32), 100, None, store.allocate, lambda n: CHUNK_BYTES,
                            nixl=nixl)
        spec = FetchSpec(f"tcp://127.0.0.1:{producer.port}", "t", [(b"k" * 16, 1), (b"l" * 16, 1)], wait,
                         landing=landing)
        for buffer in fetch_chunks(consumer, spec):
            got.append(buffer)
    except PeerError:
        pass  # the clear refusal; anything else fails the test
    finally:
        for buffer in got:
            if isinstance(buffer, Landed):
                assert landing is not None and buffer.nbytes == ENGINE_BLOCK
                continue
            assert buffer.data.numel() == CHUNK_BYTES
            buffer.release()


@settings(FUZZ, max_examples=max(20, EXAMPLES // 10))
@given(hello=st.one_of(st.just([b"", good_hello]), reply_frames, st.tuples(st.just(b""), mutated(st.just(good_hello))).map(list)),
       chunks=st.lists(reply_frames, max_size=3))
def test_a_decode_engine_reads_any_producer_reply_as_chunks_or_a_peer_error(hostile, hello, chunks):
    producer, store = hostile
    with producer.lock:
        producer.replies[:] = [hello, *chunks]
    fetch_from_hostile(producer, store)
    assert store.cpu_bytes_used() == 0  # nothing that arrived leaked


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=12,
)
fields = st.sampled_from(["do_remote_decode", "do_remote_prefill", "remote_request_id", "transfer_id",
                          "kvtier_endpoints", "remote_host", "remote_port", "tp_size", "remote_engine_id",
                          "remote_block_ids", "kvtier_lent_until"])
remote_block_ids = st.one_of(  # P's blocks of the prompt as a proxy passes them on: right, wrong, beyond, malformed
    st.just([10, 11, 12, 13, 20, 21, 22]), st.permutations([10, 11, 12, 13, 20, 21, 22]),
    st.lists(st.one_of(st.integers(0, 70), st.integers(-2, 1 << 40)), max_size=9),
    st.lists(st.lists(st.integers(0, 70), max_size=8), min_size=1, max_size=2), json_values)
lent_until = st.one_of(st.none(), st.floats(), st.integers(-2, 2**40), st.text(max_size=5),
                       st.sampled_from([60.0, -60.0]).map(lambda s: time.time() + s))
transfer_params = st.one_of(
    json_values,
    st.dictionaries(fields, st.one_of(json_values, st.just(True), st.just(["tcp://127.0.0.1:1"]), remote_block_ids,
                                      lent_until), max_size=11),
    st.fixed_dictionaries({"do_remote_prefill": st.just(True), "remote_request_id": st.just("t"),
                           "kvtier_endpoints": st.just(["tcp://127.0.0.1:1"])},
                          optional={"remote_block_ids": remote_block_ids, "kvtier_lent_until": lent_until}),
)


@FUZZ
@given(params=transfer_params)
def test_any_kv_transfer_params_give_a_role_or_none(params):
    role = pd.parse(params)
    assert role is None or isinstance(role, (pd.Produce, pd.Consume))
    if isinstance(role, pd.Consume):
        assert role.endpoints and all(e.startswith("tcp://") for e in role.endpoints) and role.tp_size >= 1
        assert all(type(b) is int and 0 <= b for b in role.remote_blocks) and len(role.remote_blocks) <= pd.MAX_BLOCK_IDS
        until = params.get("kvtier_lent_until")
        if isinstance(until, (int, float)) and not time.time() < until:  # the lease ended: P's blocks are not READ
            assert role.remote_blocks == ()


@pytest.fixture(scope="module")
def hostile_nixl(hostile):
    """The hostile producer, now also with a real NIXL agent and a registered buffer its replies may
    point into (or not); D has a real agent with its CPU tier's pool registered."""
    import torch

    from kvtier.pd import nixl

    producer, store = hostile
    p_agent, d_agent = nixl.make_agent(), nixl.make_agent()
    lent = torch.randint(0, 255, (4 * CHUNK_BYTES,), dtype=torch.uint8)
    p_agent.register([(lent.data_ptr(), lent.numel())])
    d_agent.register([store.pool_memory()])
    yield producer, store, p_agent, d_agent, lent.data_ptr()
    d_agent.deregister([store.pool_memory()])


@settings(FUZZ, max_examples=max(20, EXAMPLES // 10))
@given(garbage_metadata=st.booleans(), push=st.booleans(),
       chunks=st.lists(st.tuples(st.integers(-8, 5 * CHUNK_BYTES), st.sampled_from([CHUNK_BYTES, 1, 0, 2 * CHUNK_BYTES]),
                                 st.integers(-1, 2), st.booleans()), max_size=3))
def test_a_decode_engine_reads_any_lent_chunk_reply_as_chunks_or_a_peer_error(hostile_nixl, garbage_metadata, push,
                                                                              chunks):
    """Over NIXL a reply names an address in the producer's memory, or (push) claims the chunk
    was written into D's buffer: any address, size, index or claim ends in chunks or a
    PeerError, and D leaks no buffer of its CPU tier (a READ is settled before its buffer goes
    back; a buffer named to P and never answered goes back after its quarantine)."""
    producer, store, p_agent, d_agent, base = hostile_nixl
    metadata = os.urandom(64) if garbage_metadata else p_agent.metadata()
    hello = [b"", encode(HelloReply(VERSION, FP, "fuzz", 32, 1, transport="nixl", nixl=metadata))]
    replies = [[b"", encode(ChunkReply(VERSION, index, "ok", address=max(0, base + offset), nbytes=nbytes,
                                       written=written))]
               for offset, nbytes, index, written in chunks]
    with producer.lock:
        producer.replies[:] = [hello, *replies]
    fetch_from_hostile(producer, store, wait=push, nixl=d_agent)
    deadline = time.monotonic() + 3
    while store.cpu_bytes_used() and time.monotonic() < deadline:
        time.sleep(0.01)  # quarantined push buffers: 3 timeouts
    assert store.cpu_bytes_used() == 0


@settings(FUZZ, max_examples=max(20, EXAMPLES // 10))
@given(regions=st.lists(st.tuples(st.integers(-8, 5 * CHUNK_BYTES), st.sampled_from([ENGINE_BLOCK, 1, 2 * ENGINE_BLOCK]),
                                  st.sampled_from([ENGINE_BLOCK, 7])), max_size=2),
       chunks=st.lists(st.tuples(st.integers(-1, 2), st.lists(st.one_of(st.integers(0, 6), st.integers(0, 1 << 40)),
                                                              max_size=3),
                                 st.integers(0, (1 << 64) - 1), st.integers(0, 3)), max_size=3),
       push=st.booleans(), batched=st.booleans(), p_blocks=st.sampled_from([0, 1, 2, P_BLOCKS, 1 << 20]))
@example(regions=[(0, ENGINE_BLOCK, ENGINE_BLOCK)], chunks=[(0, [0], 1, 1), (1, [1], 2, 0)], push=False,
         batched=False, p_blocks=P_BLOCKS)  # both land
@example(regions=[(0, ENGINE_BLOCK, ENGINE_BLOCK)], chunks=[(0, [0], 1, 1), (1, [1], 2, 0)], push=False,
         batched=True, p_blocks=P_BLOCKS)  # both land, from one ChunkReplies
@example(regions=[(0, ENGINE_BLOCK, ENGINE_BLOCK)], chunks=[(0, [2], 1, 0), (1, [5], 2, 0)], push=True,
         batched=False, p_blocks=P_BLOCKS)  # both "written"
@example(regions=[(0, ENGINE_BLOCK, ENGINE_BLOCK)], chunks=[(0, [0], 1, 3)], push=False,
         batched=False, p_blocks=P_BLOCKS)  # more said to follow than asked
@example(regions=[(0, ENGINE_BLOCK, ENGINE_BLOCK)], chunks=[(0, [0], 1, 1), (1, [2], 2, 0)], push=False,
         batched=True, p_blocks=2)  # chunk 1 named beyond P's blocks (its registration holds them: NIXL would READ)
def test_a_decode_engine_reads_any_engine_block_reply_as_landed_chunks_or_a_peer_error(hostile_nixl, regions, chunks,
                                                                                       push, batched, p_blocks):
    """HBM to HBM a producer names its engine KV regions (``p_blocks`` blocks each) and each
    chunk's blocks (pull), or says it wrote each chunk into blocks (push), one reply a message or
    ``batched`` in one ChunkReplies: any regions, block ids, index, checksum or count of replies
    said to follow end in landed chunks or a PeerError, D builds no READ of a block beyond
    ``p_blocks``, and D's engine KV is written only in the blocks D named for the chunks (host
    memory stands in for VRAM)."""
    import torch

    producer, store, p_agent, d_agent, base = hostile_nixl
    kv = torch.zeros(8 * ENGINE_BLOCK, dtype=torch.uint8)  # D's engine KV: 8 blocks, one region
    d_agent.register([(kv.data_ptr(), kv.numel())])
    built, build = [], pd_landing.read_descriptors
    try:
        landing = Landing((RegionSpan(kv.data_ptr(), ENGINE_BLOCK, ENGINE_BLOCK),), "DRAM", 0, [(2,), (5,)])
        hello = [b"", encode(HelloReply(VERSION, FP, "fuzz", 32, 1, transport="nixl", nixl=p_agent.metadata(),
                                        regions=tuple((max(0, base + o), st_, bb) for o, st_, bb in regions),
                                        num_blocks=p_blocks))]
        replies = [ChunkReply(VERSION, index, "ok", blocks=tuple(blocks), checksum=checksum, written=push, more=more)
                   for index, blocks, checksum, more in chunks]
        replies = ([[b"", encode(ChunkReplies(VERSION, tuple(replies)))]] if batched and replies
                   else [[b"", encode(r)] for r in replies])
        with producer.lock:
            producer.replies[:] = [hello, *([hello] if push else []), *replies]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pd_landing, "read_descriptors", lambda local, remote, mine, theirs: (
                built.append(list(theirs)), build(local, remote, mine, theirs))[1])
            fetch_from_hostile(producer, store, wait=push, nixl=d_agent, landing=landing)
        outside = torch.cat([kv[: 2 * ENGINE_BLOCK], kv[3 * ENGINE_BLOCK: 5 * ENGINE_BLOCK], kv[6 * ENGINE_BLOCK:]])
        assert not outside.any(), "a producer's reply wrote outside the blocks D named"
        assert all(b < p_blocks for ids in built for b in ids), f"a READ of P's blocks {built} of {p_blocks}"
    finally:
        d_agent.deregister([(kv.data_ptr(), kv.numel())])
    deadline = time.monotonic() + 3
    while store.cpu_bytes_used() and time.monotonic() < deadline:
        time.sleep(0.01)  # push buffers named where the producer gave no usable regions: quarantined 3 timeouts
    assert store.cpu_bytes_used() == 0


@pytest.mark.parametrize("lending", [False, True], ids=["window", "lending"])
@pytest.mark.parametrize("signer", [b"pd-secret", b"another-secret"], ids=["right-mac", "wrong-mac"])
def test_a_batch_of_engine_block_replies_lands_only_under_the_right_mac(hostile_nixl, signer, lending):
    """With a shared secret a ChunkReplies is authenticated as a whole (every chunk's block ids and
    KVSUM64): one signed with another key ends the transfer before any READ, D's blocks untouched;
    the same batch signed with the secret lands both chunks (the control); alike whether P's
    hello reply said it lends the transfer (D asks for every chunk at once) or not."""
    import torch

    _, store, p_agent, d_agent, base = hostile_nixl
    producer = HostileProducer(b"pd-secret")  # its own: a late message of an earlier test would take a reply queued here
    producer.hello_fetches = lending  # lending: the batch answers the fetches D's hello carried
    kv = torch.zeros(8 * ENGINE_BLOCK, dtype=torch.uint8)  # D's engine KV: 8 blocks, one region
    d_agent.register([(kv.data_ptr(), kv.numel())])
    try:
        landing = Landing((RegionSpan(kv.data_ptr(), ENGINE_BLOCK, ENGINE_BLOCK),), "DRAM", 0, [(2,), (5,)])
        hello = encode(HelloReply(VERSION, FP, "fuzz", 32, 1, transport="nixl", nixl=p_agent.metadata(),
                                  regions=((base, ENGINE_BLOCK, ENGINE_BLOCK),), lending=lending, num_blocks=P_BLOCKS))
        batch = encode(ChunkReplies(VERSION, (ChunkReply(VERSION, 0, "ok", blocks=(0,), more=1),
                                              ChunkReply(VERSION, 1, "ok", blocks=(1,)))))
        with producer.lock:
            producer.replies[:] = [[mac(b"pd-secret", hello), hello], [mac(signer, batch), batch]]
        got, stop = [], threading.Event()

        def progress() -> None:  # P's agent lives in this process: UCX needs its side to progress too
            while not stop.wait(0.001):
                p_agent.progress()

        thread = threading.Thread(target=progress)
        thread.start()
        try:
            with pytest.raises(PeerError) if signer != b"pd-secret" else contextlib.nullcontext():
                consumer = Consumer(Hello(VERSION, 0, 1, FP, "fuzz", 32), 500, b"pd-secret", store.allocate,
                                    lambda n: CHUNK_BYTES, nixl=d_agent)
                spec = FetchSpec(f"tcp://127.0.0.1:{producer.port}", "t", [(b"k" * 16, 1), (b"l" * 16, 1)], False,
                                 landing=landing)
                for chunk in fetch_chunks(consumer, spec):
                    got.append(chunk)
        finally:
            stop.set()
            thread.join()
        lent = torch.frombuffer(bytearray(ctypes.string_at(base, 2 * ENGINE_BLOCK)), dtype=torch.uint8)
        if signer == b"pd-secret":
            assert [type(c) for c in got] == [Landed, Landed]
            assert torch.equal(kv[2 * ENGINE_BLOCK: 3 * ENGINE_BLOCK], lent[:ENGINE_BLOCK])
            assert torch.equal(kv[5 * ENGINE_BLOCK: 6 * ENGINE_BLOCK], lent[ENGINE_BLOCK:])
        else:
            assert got == [] and not kv.any(), "a batch under a wrong MAC was READ"
    finally:
        d_agent.deregister([(kv.data_ptr(), kv.numel())])
        producer.close()


@pytest.fixture(scope="module")
def lending_pair(tmp_path_factory):
    """A real P and D with NIXL; D reached P once (it READs the blocks params name before P's reply)."""
    from pd_workers import make_engine
    from test_pd_hbm_named import warm

    tmp = tmp_path_factory.mktemp("pd-fuzz-pair")
    p, d = make_engine(tmp, "p", 1, pd_transport="nixl"), make_engine(tmp, "d", 2, pd_transport="nixl")
    try:
        assert p.side.nixl_ready() and d.side.nixl_ready()
        warm(p, d)
        yield p, d
    finally:
        d.side.close()
        p.side.close()


_transfers = itertools.count()


@settings(FUZZ, max_examples=max(10, EXAMPLES // 10))
@given(named=remote_block_ids, until=lent_until)
@example(named=[10, 11, 12, 13, 20, 21, 64], until=None)  # the tail's block one past P's last: the next layer's
def test_any_remote_block_ids_end_in_the_producers_bytes(lending_pair, named, until):
    """A real P lends a finished prompt's blocks; the params D gets name any ``remote_block_ids``
    (P's, swapped, beyond P's 64 blocks, malformed) and any ``kvtier_lent_until``. D READs the
    blocks named before P's reply where they can be P's, and P's replies decide: D's blocks of
    the prompt end holding P's bytes, nothing is recomputed, and no other block of D's changes."""
    import torch

    from pd_workers import NUM_BLOCKS, publish, remote_job
    from test_pd_hbm import D_BLOCKS, P_BLOCKS, PROMPT, lend, wait_ended

    p, d = lending_pair
    transfer_id = f"t-fuzz-{next(_transfers)}"
    role = pd.parse({"do_remote_prefill": True, "remote_request_id": transfer_id, "kvtier_endpoints": [p.endpoint],
                     "remote_block_ids": named, "kvtier_lent_until": until})
    assert isinstance(role, pd.Consume)
    d.kv[:, D_BLOCKS] = torch.randn_like(d.kv[:, D_BLOCKS])  # not what P holds: what lands shows
    before = d.kv.clone()
    publish(p, PROMPT, P_BLOCKS, transfer_id)
    lend(p, transfer_id)
    d.side.start_loads((remote_job(f"d-{transfer_id}", PROMPT, D_BLOCKS, transfer_id, p.endpoint,
                                   producer_blocks=role.remote_blocks),))
    assert d.wait_loaded(f"d-{transfer_id}") == set()
    wait_ended(p)
    others = [b for b in range(NUM_BLOCKS) if b not in D_BLOCKS]
    assert torch.equal(d.kv[:, others], before[:, others]), "a READ landed outside the blocks D named"
    assert torch.equal(d.blocks(D_BLOCKS), p.blocks(P_BLOCKS))
