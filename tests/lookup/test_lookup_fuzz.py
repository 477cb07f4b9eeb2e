"""Hypothesis fuzz of every lookup message kvtier decodes, over real ZMQ sockets.

Server side: lookups, hold reports and peer addresses, as valid structs with hostile values,
mutated valid encodings (bytes flipped, cut, inserted) and raw garbage, one or several frames.
Each must be answered as the message deserves (a malformed or wrong-version message with an
error reply, a valid lookup with tiers, a valid report with nothing or a refusal) and the server
must answer the next valid lookup. Client side: the scheduler's LookupClient and a worker's
HoldReporter against a server that answers garbage: a miss (None), never an exception, and the
next valid answer is read.

``KVTIER_FUZZ_EXAMPLES`` sets the examples per test (CI: 200; the slow run: 100000).
"""

from __future__ import annotations

import os
import threading
import uuid

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import mutated
from kvtier.lookup import HoldReporter, LookupClient, LookupServer
from kvtier.lookup.protocol import (
    KEY_BYTES, VERSION, HoldReport, LookupReply, LookupRequest, PeerAddress, decode_message, decode_reply, encode,
)

EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
KEY = b"k" * KEY_BYTES
WAIT_MS = 5000  # a reply from a live server on a loaded box


def endpoint(tmp_path) -> str:
    return f"ipc://{tmp_path}/{uuid.uuid4().hex[:8]}.sock"


keys = st.lists(st.one_of(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), st.binary(max_size=20)), max_size=5)
versions = st.one_of(st.just(VERSION), st.integers(-2**63, 2**63 - 1))
ints = st.one_of(st.integers(-3, 5), st.integers(-2**63, 2**63 - 1))
valid_structs = st.one_of(
    st.builds(LookupRequest, versions, keys),
    st.builds(HoldReport, versions, ints, ints, st.binary(max_size=20), keys,
              st.lists(st.sampled_from(["cpu", "disk", "", "tape"]), max_size=5)),
    st.builds(PeerAddress, versions, ints, ints, st.text(max_size=40)),
)


encoded = valid_structs.map(encode)
payloads = st.one_of(
    encoded,
    mutated(encoded),
    st.binary(max_size=300),
    st.dictionaries(st.text(max_size=10), st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=20), st.text(max_size=10),
                                                    st.none(), st.lists(st.integers(-5, 5), max_size=3)),
                    max_size=6).map(msgspec.msgpack.encode),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One real server for every example: it must survive them all."""
    server = LookupServer(endpoint(tmp_path_factory.mktemp("lookup-fuzz")), 1, lambda: {"cpu": 1.0})
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    yield server, sock
    sock.close()
    server.close()


def expected_answer(message: bytes) -> str:
    """What the server owes ``message``: "error", "tiers" or "maybe" (a report: nothing, or a refusal)."""
    try:
        decoded = decode_message(message)
    except (msgspec.DecodeError, ValueError):  # msgspec raises UnicodeDecodeError on bad UTF-8
        return "error"
    if decoded.version != VERSION:
        return "error"
    return "tiers" if isinstance(decoded, LookupRequest) else "maybe"


def reply(sock: zmq.Socket) -> LookupReply:
    assert sock.poll(WAIT_MS), "the lookup server stopped answering"
    return decode_reply(sock.recv_multipart()[-1])


def check_answers(sock: zmq.Socket, message: bytes) -> None:
    """``message`` was sent on ``sock``; send a valid lookup behind it and read both answers in
    order (one socket, one server thread): the message's, if it is owed one, then the lookup's."""
    owed = expected_answer(message)
    sock.send_multipart([b"", encode(LookupRequest(VERSION, [KEY]))])
    first = reply(sock)
    if owed == "error":
        assert first.error and first.tiers == [], first
    elif owed == "tiers":
        assert not first.error, first
    if owed != "maybe" or first.error:  # a report is answered only to refuse it
        first = reply(sock)
    assert not first.error and first.chunk_load_ms == {"cpu": 1.0}, first


@FUZZ
@given(message=payloads)
def test_every_message_is_answered_as_it_deserves_and_the_server_keeps_serving(served, message):
    server, sock = served
    sock.send_multipart([b"", message])
    check_answers(sock, message)


@FUZZ
@given(frames=st.lists(st.one_of(payloads, st.binary(max_size=64)), min_size=1, max_size=5))
def test_any_frame_count_leaves_the_server_serving(served, frames):
    server, sock = served
    sock.send_multipart(frames)  # the server reads the last frame as the message
    check_answers(sock, frames[-1])


class GarbageServer:
    """A ROUTER that answers every message with the next queued reply frames (the fuzzed ones)."""

    def __init__(self, address: str):
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(address)
        self.replies: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.stop.is_set():
            if not self.socket.poll(20):
                continue
            frames = self.socket.recv_multipart()
            if self.replies:
                self.socket.send_multipart([*frames[:-1], self.replies.pop(0)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.socket.close()


@pytest.fixture(scope="module")
def garbage(tmp_path_factory):
    server = GarbageServer(endpoint(tmp_path_factory.mktemp("lookup-garbage")))
    yield server
    server.close()


good_reply = encode(LookupReply(VERSION, ["cpu"], chunk_load_ms={"cpu": 2.0}))
reply_payloads = st.one_of(
    st.builds(LookupReply, versions, st.lists(st.text(max_size=6), max_size=4), st.text(max_size=20),
              st.dictionaries(st.text(max_size=6), st.floats(allow_nan=True), max_size=3),
              st.lists(st.text(max_size=20), max_size=3)).map(encode),
    mutated(st.just(good_reply)),
    st.binary(max_size=200),
)


@FUZZ
@given(reply=reply_payloads)
def test_the_scheduler_client_reads_any_reply_as_an_answer_or_a_miss(garbage, reply):
    client = LookupClient(garbage.socket.getsockopt_string(zmq.LAST_ENDPOINT), timeout_ms=WAIT_MS)
    try:
        garbage.replies[:] = [reply, good_reply]
        got = client.lookup([KEY])
        assert got is None or isinstance(got, LookupReply)
        assert client.lookup([KEY]) == decode_reply(good_reply)  # the next valid answer is read
    finally:
        client.close()


def test_a_reporter_answered_with_garbage_keeps_reporting(garbage):
    """A worker's reporter decodes what rank 0 answers (refusals only): garbage is ignored."""
    held = {KEY: "cpu"}
    reporter = HoldReporter(garbage.socket.getsockopt_string(zmq.LAST_ENDPOINT), 0, 1, KEY, held.get)
    try:
        for junk in (b"", b"\xc1", b"\x81\xa4type\xa4hold", encode(LookupReply(VERSION + 1, [], error="x"))):
            garbage.replies[:] = [junk]
            reporter.changed([KEY])
            assert reporter.flush()
        assert reporter._thread.is_alive()
        sent = reporter.sent_reports
        reporter.changed([KEY])
        assert reporter.flush() and reporter.sent_reports == sent + 1
    finally:
        reporter.close()
