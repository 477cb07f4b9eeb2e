"""The chunk server under hostile input: malformed, oversized, wrong-version and unauthenticated
messages are refused (and counted) and the server keeps serving well-formed peers."""

from __future__ import annotations

import os

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import ask
from kvtier.pd.hello import introduce
from kvtier.pd.protocol import MAX_BATCH, VERSION, Fetch, Fetches, Hello, HelloReply, Release, decode_reply, encode, mac

SECRET = b"fuzz-secret"
EXAMPLES = int(os.environ.get("KVTIER_FUZZ_EXAMPLES", "60"))  # per test; the slow run sets 100000


@pytest.fixture(scope="module")
def producer(tmp_path_factory):
    from pd_workers import make_engine

    engine = make_engine(tmp_path_factory.mktemp("fuzz"), "p", 1, pd_secret=SECRET.decode())
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
