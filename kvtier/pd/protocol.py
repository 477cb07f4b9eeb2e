"""Chunk transfer messages between a decode engine (D) and a prefill engine's chunk server (P).

Bump ``VERSION`` on any change; a peer speaking another version is refused. Every message
travels as ZMQ frames ``[mac, body(, payload)]``: ``body`` a msgpack-encoded struct below,
``payload`` a sealed chunk (codec header + region-major blocks) after an ``ok`` reply, and
``mac`` a keyed BLAKE3 of body and payload header when a shared secret is set (else empty).
The chunk's own header carries its checksum, so authenticating the header authenticates the
payload; payloads whose checksum is not cryptographic (the GPU kernels' KVSUM64) are
authenticated whole.

D → P: :class:`Hello` (once per connection; answered with :class:`HelloReply`) and one
:class:`Fetch` per chunk (answered with a :class:`ChunkReply`, possibly preceded by ``pending``
heartbeats while the chunk is being computed). :class:`Release` ends a transfer: P unpins it.
Fetches go out together as :class:`Fetches` (each answered as if sent alone), and the replies
naming engine blocks (HBM below) of one turn of P's server come back together as
:class:`ChunkReplies`: a 32k-token pull is then a few messages each way, not 128.

Transports: D offers what it has (``Hello.transports``), P picks one (``HelloReply.transport``).
Over ``zmq`` the chunk follows its reply as a payload frame. Over ``nixl`` (:mod:`kvtier.pd.nixl`)
the reply carries no payload but the chunk's address in P's registered CPU pool and P's NIXL
metadata came with the handshake reply; D READs the bytes itself (pull), then checks the MAC over
the bytes it read, exactly as it would over a payload frame. P lends that buffer until D releases
the transfer. In a push transfer (``Fetch.wait``) D also names a buffer of its own registered
pool in each fetch (``address``, ``capacity``), and P WRITEs the chunk there the moment it has
it (its ``ok`` reply then says ``written``). Each side gives its NIXL metadata only to a peer
that passed the handshake: P in its authenticated handshake reply, D in a second
:class:`Hello` sent once that reply checked out (P answers it again). A peer that fails the
handshake never learns how to reach the other's memory.

HBM to HBM (``Hello.hbm``: D registered its engine KV with NIXL): while P holds a finished
request's engine blocks under a lease (:mod:`kvtier.pd.producer.leases`), its handshake reply gives its
engine KV regions (``regions``, ``device``), and a fetch that asks for it (``Fetch.hbm``) is
answered with the chunk's block ids in P's engine (``ChunkReply.blocks``) and the KVSUM64 its
save computed (``checksum``), both under the MAC. A pull's hello names its transfer and carries
its first fetches (``Hello.fetches``): P answers them right after its handshake reply when that
reply says it lends the transfer's blocks (``lending``), and drops them otherwise (D then sends
them again), so a pull under a lease takes one round trip, not two. D READs those blocks into
its own, checks the KVSUM64 of what landed, and releases the transfer when done. Without a lease (it ended, or P
keeps none) the same fetch gets the CPU-tier answer above.

HBM push: D's second hello also gives its engine KV regions, and each fetch names the engine
blocks the chunk goes into (``Fetch.blocks``). P WRITEs the chunk from its own engine blocks
(the running request's, or under the lease that follows it) the moment the chunk is stored; the
``ok`` reply says ``written`` and carries the KVSUM64. A WRITE that fails sends the CPU-tier copy
as a payload instead. A transfer that D gives up with such fetches unanswered is released and
D waits for P's ``released`` answer, which P sends once no WRITE of the transfer is in flight:
no late WRITE lands in blocks D recomputes.

Replay: every :class:`Hello` carries a fresh random ``nonce`` and D's wall-clock send time
(``sent_ms``). P refuses a hello whose nonce it saw already, or sent more than
:data:`HELLO_WINDOW_S` away from its own clock (:mod:`kvtier.pd.producer.handshakes`), and echoes the nonce in
its :class:`HelloReply`, under its MAC: D refuses a reply to any other hello. Every later message
of the connection (:class:`Fetch`, :class:`Fetches`, :class:`Release`) carries the nonce of its
latest hello, and P takes it only from the ZMQ connection that sent that hello; a release only
from the connection that began its transfer (whose hello or first fetch named it). A captured
message replayed on another connection is refused and changes nothing.

Engine blocks: each hello and its reply carry the sender's engine ``num_blocks`` (0: no engine
KV). Block ids naming blocks beyond the other side's count, and regions whose span cannot be
(:func:`kvtier.pd.hbm.region_problem`), are refused before any NIXL descriptor is built: the
registration of interleaved regions is merged, so an id past the end would land in a neighbour.

Encryption: with a secret the side channel (these messages and the ZMQ payload frames, not
NIXL's data plane) is encrypted by ZMQ CURVE (:mod:`kvtier.pd.channel`): the chunk server's key
pair is derived from the secret, so D knows P's public key without another setting, and each
D socket makes a fresh key pair of its own.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

import blake3
import msgspec

from kvtier.codec import HEADER_BYTES
from kvtier.codec.chunk import CHECKSUM_BLAKE3, read_header

VERSION = 8
MAX_REQUEST_BYTES = 64 << 10  # any D → P message; a chunk server refuses larger ones unread
KEY_BYTES = 16
MAC_BYTES = 32
MAX_BATCH = 64  # fetches in one Fetches, replies in one ChunkReplies
BATCH_BYTES = 32 << 10  # a Fetches (or a hello's fetches) stays under this many bytes: half of MAX_REQUEST_BYTES
MAX_HELLO_FETCHES = 256  # fetches a pull's hello may carry
NONCE_BYTES = 16
HELLO_WINDOW_S = 60.0  # a hello sent further than this from P's clock (either way) is refused

Key = Annotated[bytes, msgspec.Meta(min_length=KEY_BYTES, max_length=KEY_BYTES)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MaybeTransferId = Annotated[str, msgspec.Meta(max_length=256)]  # "": none
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
Address = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # user-space addresses fit
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Checksum = int  # unsigned 64 bits; msgspec bounds stop at int64, so D compares it as it came
Device = Annotated[int, msgspec.Meta(ge=0, le=1 << 10)]
RegionAddress = tuple[Address, Size, Size]  # (base address, stride between blocks, bytes per block)
Nonce = Annotated[bytes, msgspec.Meta(max_length=NONCE_BYTES)]  # a hello's (b"": none; refused where one is due)
WallMs = Annotated[int, msgspec.Meta(ge=0, le=1 << 53)]  # wall-clock ms since the epoch


@dataclass(frozen=True, slots=True)
class ServedLayout:
    """This rank's side of the handshake. ``fingerprint``: 16 bytes; ``description``: in words.
    ``token_bytes``: bytes per token of each region when the layout is token-contiguous (a chunk
    may then be re-cut to the token count a consumer with another block size asks for), else empty.
    ``layout``: this rank's :class:`~kvtier.layout.Layout` when its chunks are keyed by the KV heads
    they hold (a decode rank of a larger TP size is sent its part of them), else None."""

    fingerprint: bytes
    description: str
    chunk_tokens: int
    tp_size: int
    token_bytes: tuple[int, ...] = ()
    layout: Any = None


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """D's rank ``rank`` of ``tp_size`` introduces its layout (fingerprint and its description)."""

    version: int
    rank: Count
    tp_size: Count
    fingerprint: Key
    layout: Text
    chunk_tokens: Count
    transports: tuple[Literal["nixl", "zmq"], ...] = ("zmq",)
    nixl: bytes = b""  # D's NIXL agent metadata (second hello): P may WRITE into D's memory
    hbm: bool = False  # D registered its engine KV with NIXL: it may READ P's engine blocks into it
    regions: tuple[RegionAddress, ...] = ()  # D's engine KV (second hello): P may WRITE blocks into it
    device: Device = 0  # the CUDA device of those regions in D's process
    transfer_id: MaybeTransferId = ""  # the transfer D is about to fetch (P says whether it lends its blocks)
    fetches: Annotated[tuple[Fetch, ...], msgspec.Meta(max_length=MAX_HELLO_FETCHES)] = ()  # a pull's first
    # fetches of that transfer, answered at once if P lends its engine blocks now, else dropped
    num_blocks: Count = 0  # blocks of D's engine KV (0: none registered)
    nonce: Nonce = b""  # fresh for every hello (NONCE_BYTES random bytes)
    sent_ms: WallMs = 0  # D's wall clock when it sent this hello


class Fetch(msgspec.Struct, frozen=True, tag="fetch"):
    """Send chunk ``index`` of transfer ``transfer_id``: chain key ``key``, ``num_blocks`` of D's
    blocks, ``tokens`` token slots (``num_blocks`` × D's block size; 0: as P stored it). A prompt's
    partial tail stored with another count (P's block size differs: token-contiguous layouts
    only) is re-cut to ``tokens`` before it is sent.
    ``wait``: if P has not published it yet but is computing the transfer, send it when sealed."""

    version: int
    transfer_id: TransferId
    index: Count
    key: Key
    num_blocks: Count
    wait: bool = False
    address: Address = 0  # NIXL push: D's buffer P may WRITE the chunk into (0: none)
    capacity: Size = 0  # its size in bytes; P writes only a chunk of exactly this size
    tokens: Count = 0
    hbm: bool = False  # answer with P's engine blocks of the chunk, if P still holds them
    blocks: tuple[Size, ...] = ()  # HBM push: D's engine blocks P may WRITE the chunk into
    nonce: Nonce = b""  # of the connection's latest hello


class Fetches(msgspec.Struct, frozen=True, tag="fetches"):
    """Several fetches in one message (at most :data:`MAX_BATCH`, :data:`BATCH_BYTES` encoded):
    each is answered as if it had come alone."""

    version: int
    fetches: Annotated[tuple[Fetch, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    nonce: Nonce = b""  # of the connection's latest hello (each fetch carries it too)


class Release(msgspec.Struct, frozen=True, tag="release"):
    """D is done with ``transfer_id``: P may unpin its chunks. ``answer``: reply ``released``
    once no WRITE into D's memory for it is in flight."""

    version: int
    transfer_id: TransferId
    answer: bool = False
    nonce: Nonce = b""  # of the connection's latest hello


class HelloReply(msgspec.Struct, frozen=True, tag="hello_reply"):
    version: int
    fingerprint: bytes
    layout: str
    chunk_tokens: int
    tp_size: int
    error: str = ""
    transport: str = "zmq"
    nixl: bytes = b""  # P's NIXL agent metadata, with transport "nixl"
    regions: tuple[RegionAddress, ...] = ()  # P's engine KV, when it may lend engine blocks (hbm)
    device: Device = 0  # the CUDA device of those regions in P's process
    lending: bool = False  # P holds the hello's transfer's engine blocks under a lease: ask for every chunk
    num_blocks: int = 0  # blocks of P's engine KV (0: none lent)
    nonce: bytes = b""  # the nonce of the hello this answers


ChunkStatus = Literal["ok", "missing", "pending", "refused", "released"]


class ChunkReply(msgspec.Struct, frozen=True, tag="chunk"):
    """``ok``: the payload frame follows, or (NIXL) the chunk is at ``address`` in P's registered
    memory, ``nbytes`` long, or (HBM) in P's engine ``blocks``. ``missing``: P does not have it (and will not). ``pending``: a
    heartbeat, P is still computing the transfer. ``refused``: a bad request. ``released``: the
    answer to a :class:`Release` that asked for one: no WRITE of the transfer is in flight."""

    version: int
    index: int
    status: ChunkStatus
    error: str = ""
    address: int = 0
    nbytes: int = 0
    written: bool = False  # NIXL push: the chunk is already in the buffer the fetch named
    blocks: tuple[Size, ...] = ()  # HBM: the chunk's blocks in P's engine, to READ region by region
    checksum: Checksum = 0  # HBM: the chunk's KVSUM64, over its payload as P's save sealed it
    more: Count = 0  # HBM: replies naming engine blocks that follow this one at once (one turn of P's server)


class ChunkReplies(msgspec.Struct, frozen=True, tag="chunks"):
    """``ok`` replies naming engine blocks (``blocks``, HBM), at most :data:`MAX_BATCH`, sent
    together; ``more`` in each still counts the replies of the same turn after it."""

    version: int
    replies: Annotated[tuple[ChunkReply, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


encode = msgspec.msgpack.Encoder().encode
decode_request = msgspec.msgpack.Decoder(Union[Hello, Fetch, Fetches, Release]).decode
decode_reply = msgspec.msgpack.Decoder(Union[HelloReply, ChunkReply, ChunkReplies]).decode


def batches(fetches: list[Fetch]) -> list[Fetch | Fetches]:
    """``fetches`` (of one connection: one nonce) as few messages as :data:`MAX_BATCH` and
    :data:`BATCH_BYTES` allow (one alone goes as itself)."""
    messages, batch, size = [], [], 0
    for fetch in fetches:
        nbytes = len(encode(fetch))
        if batch and (len(batch) == MAX_BATCH or size + nbytes > BATCH_BYTES):
            messages.append(batch)
            batch, size = [], 0
        batch.append(fetch)
        size += nbytes
    if batch:
        messages.append(batch)
    return [b[0] if len(b) == 1 else Fetches(VERSION, tuple(b), b[0].nonce) for b in messages]


def reply_batches(replies: list[ChunkReply]) -> list[ChunkReplies]:
    """``replies`` naming engine blocks (one turn of P's, to one consumer) as :class:`ChunkReplies`
    of at most :data:`MAX_BATCH`, each reply's ``more`` counting those after it."""
    replies = [msgspec.structs.replace(r, more=len(replies) - 1 - k) for k, r in enumerate(replies)]
    return [ChunkReplies(VERSION, tuple(replies[i : i + MAX_BATCH])) for i in range(0, len(replies), MAX_BATCH)]


def read_reply(frames: list, secret: bytes | None, lent_unchecked: bool) -> HelloReply | ChunkReply | ChunkReplies:
    """A producer's reply from its ZMQ frames ``[mac, body(, payload)]`` (``zmq.Frame``), authenticated,
    of this :data:`VERSION`, a :class:`ChunkReplies` holding only ``ok`` replies naming engine blocks.
    ``lent_unchecked``: a chunk lent from P's CPU tier (NIXL: ``ok``, no payload, no blocks) is
    authenticated by the caller, over the bytes it reads. Raises ``ValueError`` (:class:`AuthError`,
    ``msgspec.DecodeError``)."""
    if len(frames) not in (2, 3):
        raise ValueError(f"{len(frames)} frames")
    tag, body, payload = frames[0].bytes, frames[1].bytes, frames[2].buffer if len(frames) == 3 else None
    reply = decode_reply(body)
    lent = isinstance(reply, ChunkReply) and reply.status == "ok" and payload is None and not reply.blocks
    if not (lent and lent_unchecked):
        check_mac(secret, tag, body, payload)
    if reply.version != VERSION:
        raise ValueError(f"protocol version {reply.version}, this is {VERSION}")
    if isinstance(reply, ChunkReplies) and (payload is not None or any(
            r.version != VERSION or r.status != "ok" or not r.blocks for r in reply.replies)):
        raise ValueError("a batch of replies not all naming engine blocks")
    return reply


def layout_problem(hello: Hello, reply: HelloReply) -> str:
    """Why a producer's chunks mean other bytes than the consumer's ("" if they do not): another
    layout fingerprint (which includes the block size unless the layout is token-contiguous: see
    :mod:`kvtier.layout`), or another ``chunk_tokens`` (chunk keys cover that many tokens)."""
    if reply.fingerprint != hello.fingerprint:
        return (f"KV layouts differ (block sizes may differ only where both layouts are token-contiguous, "
                f"e.g. flash attention's NHD or MLA): this engine has {hello.layout}; the producer has {reply.layout}")
    if reply.chunk_tokens != hello.chunk_tokens:
        return (f"chunk_tokens differ ({hello.chunk_tokens} here, {reply.chunk_tokens} on the producer): "
                f"both engines must use the same, a multiple of each one's block size")
    return ""


class AuthError(ValueError):
    """A message whose MAC is missing or wrong."""


def mac(secret: bytes | None, body: bytes, payload: memoryview | bytes | None = None) -> bytes:
    """The MAC frame of a message (empty without a secret). See the module docstring."""
    if secret is None:
        return b""
    hasher = blake3.blake3(key=blake3.blake3(secret).digest(32))
    hasher.update(body)
    if payload is not None:
        whole = len(payload) < HEADER_BYTES or _checksum_kind(payload) != CHECKSUM_BLAKE3
        hasher.update(payload if whole else payload[:HEADER_BYTES])
    return hasher.digest(MAC_BYTES)


def check_mac(secret: bytes | None, tag: bytes, body: bytes, payload: memoryview | bytes | None = None) -> None:
    """Raise :class:`AuthError` unless ``tag`` authenticates the message (no-op without a secret)."""
    if secret is not None and not hmac.compare_digest(tag, mac(secret, body, payload)):
        raise AuthError("missing or wrong MAC" if tag else "unauthenticated message (no MAC)")


def _checksum_kind(payload: memoryview | bytes) -> int:
    import torch

    try:
        return read_header(torch.frombuffer(bytearray(payload[:HEADER_BYTES]), dtype=torch.uint8)).checksum_kind
    except ValueError:
        return -1
