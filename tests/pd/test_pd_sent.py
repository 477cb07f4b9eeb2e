"""A chunk sent over ZMQ without a copy keeps its CPU-tier buffer until ZMQ let go of the message
(:mod:`kvtier.pd.producer.sent`): a real store's buffer, the chunk server's own ROUTER socket
(``bind_router``) and a real decode-side DEALER in a process of its own, stopped (SIGSTOP) so that
a 64 MiB reply cannot leave the kernel's socket buffers. Released at once instead, the buffer could
be reused for another chunk while ZMQ still reads it: the consumer would get torn bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from kvtier.pd.channel import bind_router
from kvtier.pd.producer.sent import SentBuffers
from kvtier.storage import ChunkStore, StoreConfig

PAYLOAD = 64 << 20  # far above the kernel's loopback socket buffers
PEER = """
import sys, time, zmq
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.RCVHWM, 1)
s.connect(sys.argv[1])
s.send(b"hello")
time.sleep(600)
"""


@pytest.fixture
def sent_to_stopped_peer():
    """``(router, peer identity, peer process)``: the peer said hello, then was stopped."""
    router, port = bind_router("tcp://127.0.0.1:0", None, 1 << 16, 16)
    peer = subprocess.Popen([sys.executable, "-c", PEER, f"tcp://127.0.0.1:{port}"])
    try:
        assert router.poll(30_000), "the peer never said hello"
        identity, _ = router.recv_multipart()
        os.kill(peer.pid, signal.SIGSTOP)
        yield router, identity, peer
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait()
        router.close()


def _send(router: zmq.Socket, identity: bytes, sent: SentBuffers, store: ChunkStore):
    buffer = store.allocate(PAYLOAD)
    buffer.data.fill_(7)
    tracker = router.send_multipart([identity, b"reply", memoryview(buffer.data.numpy())], copy=False, track=True)
    sent.add(tracker, buffer)
    return tracker, buffer


def test_a_buffer_zmq_still_reads_is_released_only_once_the_peer_took_it(sent_to_stopped_peer):
    router, identity, peer = sent_to_stopped_peer
    sent = SentBuffers()
    with ChunkStore(StoreConfig(cpu_bytes=2 * PAYLOAD)) as store:
        tracker, buffer = _send(router, identity, sent, store)
        time.sleep(0.3)  # ZMQ has written what the kernel takes; the rest waits for the stopped peer
        sent.release_done()
        assert not tracker.done and not buffer.released and sent.count == 1
        os.kill(peer.pid, signal.SIGCONT)  # its ZMQ thread reads the reply in
        tracker.wait(30)
        sent.release_done()
        assert buffer.released and sent.count == 0 and sent.total == 1


def test_at_close_the_messages_zmq_drops_give_their_buffers_back(sent_to_stopped_peer):
    router, identity, _ = sent_to_stopped_peer
    sent = SentBuffers()
    with ChunkStore(StoreConfig(cpu_bytes=2 * PAYLOAD)) as store:
        tracker, buffer = _send(router, identity, sent, store)
        sent.release_done()
        assert not buffer.released
        router.close()  # LINGER 0: what the stopped peer did not take is dropped
        sent.close()
        assert tracker.done and buffer.released and sent.count == 0
