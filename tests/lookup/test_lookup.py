"""Real ZMQ sockets: answers, malformed messages, a dead server."""

import uuid

import msgspec
import zmq
from hypothesis import given, settings, strategies as st

from kvtier.lookup import LookupClient, LookupServer
from kvtier.lookup.protocol import MAX_MESSAGE_BYTES


def endpoint(tmp_path):
    return f"ipc://{tmp_path}/{uuid.uuid4().hex[:8]}.sock"


def test_answers_leading_hits(tmp_path):
    stored = {b"a" * 16: "cpu", b"b" * 16: "disk"}

    def answer(keys):
        out = []
        for key in keys:
            if key not in stored:
                break
            out.append(stored[key])
        return out

    server = LookupServer(endpoint(tmp_path), answer)
    client = LookupClient(server.endpoint, 2000)
    try:
        assert client.prefix_tiers([b"a" * 16, b"b" * 16, b"c" * 16, b"a" * 16]) == ["cpu", "disk"]
        assert client.prefix_tiers([b"c" * 16]) == []
    finally:
        client.close()
        server.close()


def test_dead_server_is_a_miss_not_a_hang(tmp_path, caplog):
    client = LookupClient(endpoint(tmp_path), 200)
    assert client.prefix_tiers([b"a" * 16]) == []
    assert client.prefix_tiers([b"a" * 16]) == []  # the stuck REQ socket was replaced
    assert "did not answer" in caplog.text
    client.close()


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.binary(max_size=200), st.builds(lambda v, k: msgspec.msgpack.encode({"version": v, "keys": k}),
                                                      st.integers(-5, 5), st.lists(st.binary(max_size=20), max_size=4))))
def test_fuzzed_messages_are_rejected_and_the_server_keeps_serving(tmp_path_factory, message):
    tmp = tmp_path_factory.mktemp("fuzz")
    server = LookupServer(endpoint(tmp), lambda keys: ["cpu"] * len(keys))
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send(message)
        assert sock.poll(2000)
        sock.recv()
        client = LookupClient(server.endpoint, 2000)
        assert client.prefix_tiers([b"k" * 16]) == ["cpu"]
        client.close()
    finally:
        sock.close()
        server.close()


def test_oversized_message_is_dropped_and_server_survives(tmp_path):
    server = LookupServer(endpoint(tmp_path), lambda keys: ["cpu"] * len(keys))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send_multipart([b"", b"x" * (MAX_MESSAGE_BYTES + 1)])
    client = LookupClient(server.endpoint, 2000)
    try:
        assert client.prefix_tiers([b"k" * 16]) == ["cpu"]
    finally:
        client.close()
        sock.close()
        server.close()
