"""kvtier's side of LMCache's RemoteBackend on a Redis or Valkey server that many engines share.

Sizes are in bytes, times in seconds unless named ``_ms``. LMCache's redis connector stores a
chunk as two values, ``<key>kv_bytes`` then ``<key>metadata`` (shape, dtype, length); kvtier
keeps its byte format inside, so a chunk read back is verified like any other (checksum, layout
fingerprint) by the load path.

What this module adds around the backend:

* **Bounded reads.** The connector allocates the chunk's buffer from the shape the server sends.
  Reads go through :class:`_ReadAllocator`, which only hands out kvtier's own chunk shape from
  the store's CPU pool, without blocking, and frees a buffer the connector allocated but then
  dropped (value evicted between its two GETs, truncated, or of another length).
* **Bounded writes.** Write-through is asynchronous; at most ``write_bytes`` are in flight, the
  rest are dropped and counted. Each write holds its chunk's CPU reference until it lands.
* **Failure.** Every network call is bounded by the socket timeouts in the URL. A server that
  fails a call, or is unreachable at start, marks the tier down for :data:`RETRY_S`: reads and
  lookups miss at once, writes are dropped. The next call after that pings it and brings the
  tier back by itself. One log line when it goes down, one when it is back.
* **Lookups** ask for both values of every rank's key of a prompt's next chunks in one
  pipelined round trip (:meth:`SharedTier.prefix`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable

from . import _lmcache as lm
from .types import redact

logger = logging.getLogger(__name__)

RETRY_S = 2.0  # how long a failed server is left alone before it is tried again
PING_S = 1.0  # least time a ping (at start, and to bring the tier back) waits for an answer
SLOW_CALLS = 2  # calls in a row that only ran out of time before a slow server counts as down
_VALUES = (b"kv_bytes", b"metadata")  # suffixes LMCache's redis connector appends to a key


class _ReadAllocator:
    """Stands in for the LocalCPUBackend the connector allocates read buffers from.

    ``alloc(nbytes)``: a CPU-pool MemoryObj of kvtier's chunk shape, or None (never blocks).
    Everything else (config, metadata) is the real backend's.
    """

    def __init__(self, cpu: Any, alloc: Callable[[int], Any]):
        self._cpu = cpu
        self._alloc = alloc
        self.window: list[Any] | None = None  # buffers handed out during the read in progress
        self.strays = 0  # buffers handed out with no read waiting (a read that timed out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cpu, name)

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None, *args: Any, **kwargs: Any) -> Any:
        shape = shapes[0] if isinstance(shapes, (list, tuple)) and len(shapes) == 1 and not isinstance(shapes[0], int) else shapes
        dtype = dtypes[0] if isinstance(dtypes, (list, tuple)) and len(dtypes) == 1 else dtypes
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError):
            return None
        if dtype != lm.KEY_DTYPE or fmt != lm.KEY_FMT or len(dims) != 4 or dims[:2] != (1, 1) or dims[3] != 1 \
                or dims[2] <= 0:
            return None  # not a kvtier chunk: a miss
        obj = self._alloc(dims[2])
        if obj is not None:
            window = self.window
            if window is None:
                self.strays += 1
            else:
                window.append(obj)
        return obj


class SharedTier:
    """One store's view of the shared server. Thread-safe.

    ``url``: the user's URL (for logs; redacted). ``backend``: LMCache's RemoteBackend, built on
    ``loop`` with ``allocator``; closed by :meth:`close`. ``timeout_s``: the socket timeout of
    one network call. ``write_bytes``: most bytes of writes in flight.
    """

    def __init__(self, url: str, backend: lm.RemoteBackend, allocator: _ReadAllocator, loop: asyncio.AbstractEventLoop,
                 timeout_s: float, write_bytes: int):
        self.url = redact(url)
        self.backend = backend
        self._allocator = allocator
        self._loop = loop
        self.timeout_s = timeout_s
        self.write_bytes = write_bytes
        self._lock = threading.Lock()  # state below
        self._read_lock = threading.Lock()  # one read at a time: the allocator's window is per read
        self._inflight = 0  # bytes of writes in flight
        self._writes_done = threading.Condition(self._lock)
        self._down_until = 0.0  # monotonic; > now while the tier is down
        self._slow = 0  # calls in a row that timed out
        self.up = True
        self.writes = self.dropped_writes = self.failed_writes = 0
        self.reads = self.read_misses = 0
        problem = self._ping()
        if problem is not None:
            self._mark_down(f"unreachable at start ({problem})")

    # ------------------------------------------------------------------ state

    def _client(self) -> Any:
        """The connector's redis.asyncio client (None if LMCache could not build it)."""
        connection = self.backend.connection
        return None if connection is None else connection.getWrappedConnector().connection

    def _run(self, coro_fn: Callable[[Any], Any], timeout_s: float) -> Any:
        """Run ``coro_fn(client)`` on LMCache's loop; raises on failure or after ``timeout_s``."""
        client = self._client()
        if client is None:
            raise ConnectionError("LMCache has no connection to it")

        async def bounded() -> Any:
            return await asyncio.wait_for(coro_fn(client), timeout_s)

        return asyncio.run_coroutine_threadsafe(bounded(), self._loop).result(timeout_s + 1.0)

    def _ping(self) -> str | None:
        try:
            # At least a second: a first connection on a busy host is slow, and a ping that
            # gives up early would keep a healthy server out for RETRY_S.
            self._run(lambda c: c.ping(), max(self.timeout_s, PING_S))
            return None
        except Exception as exc:  # noqa: BLE001 - any failure means: not usable now
            return _why(exc)

    def _failed(self, why: str, exc: BaseException | None = None) -> None:
        """A call failed. A refused or broken connection takes the tier down at once; a call that
        only ran out of time (a busy host, a long queue) does so after SLOW_CALLS in a row."""
        if exc is None or isinstance(exc, (TimeoutError, asyncio.TimeoutError)) or "Timeout" in type(exc).__name__:
            with self._lock:
                self._slow += 1
                if self._slow < SLOW_CALLS:
                    return
        self._mark_down(why if exc is None else f"{why} ({_why(exc)})")

    def _succeeded(self) -> None:
        self._slow = 0

    def _mark_down(self, why: str) -> None:
        with self._lock:
            self._slow = 0
            self._down_until = time.monotonic() + RETRY_S
            was_up, self.up = self.up, False
        if was_up:
            logger.warning("kvtier shared tier %s %s; serving without it, retrying every %g s.", self.url, why, RETRY_S)

    def available(self) -> bool:
        """True if the tier may be used now; while it is down, pings it once per RETRY_S."""
        with self._lock:
            if self.up:
                return True
            if time.monotonic() < self._down_until:
                return False
            self._down_until = time.monotonic() + RETRY_S  # one caller probes, the others miss
        problem = self._ping()
        if problem is not None:
            return False
        with self._lock:
            self.up = True
        logger.warning("kvtier shared tier %s is back.", self.url)
        return True

    # ------------------------------------------------------------------ writes

    def submit(self, eks: list[Any], objs: list[Any]) -> None:
        """Write chunks (already stored in CPU) through to the server; never blocks or raises."""
        if not self.available():
            with self._lock:
                self.dropped_writes += len(eks)
            return
        for ek, obj in zip(eks, objs):
            nbytes = obj.get_physical_size()
            with self._lock:
                if self._inflight + nbytes > self.write_bytes:
                    self.dropped_writes += 1
                    continue
                self._inflight += nbytes
            obj.ref_count_up()  # the chunk stays put (unevictable, unreused) until it is written
            try:
                future = self.backend.submit_put_task(ek, obj)
            except Exception as exc:  # noqa: BLE001
                future = None
                self._write_done(obj, nbytes, exc)
            if future is not None:
                future.add_done_callback(lambda f, o=obj, n=nbytes: self._write_done(o, n, f.exception()))

    def _write_done(self, obj: Any, nbytes: int, exc: BaseException | None) -> None:
        obj.ref_count_down()
        with self._lock:
            self._inflight -= nbytes
            if exc is None:
                self.writes += 1
            else:
                self.failed_writes += 1
            self._writes_done.notify_all()
        if exc is not None:
            self._failed("failed a write", exc)

    def wait_writes(self, timeout: float) -> bool:
        """Wait until no write is in flight; False on timeout."""
        with self._lock:
            return self._writes_done.wait_for(lambda: self._inflight == 0, timeout)

    # ------------------------------------------------------------------ reads

    def read(self, ek: Any) -> Any:
        """The chunk as a CPU-pool MemoryObj (reference ours), or None: absent, partly evicted,
        not a kvtier chunk, no CPU room, or the server down or slower than the timeout."""
        if not self.available():
            return None
        blocking_s = self.backend.config.blocking_timeout_secs
        with self._read_lock:
            self._allocator.window = window = []
            start = time.monotonic()
            try:
                obj = self.backend.get_blocking(ek)
            except Exception as exc:  # noqa: BLE001 - e.g. a metadata value that does not parse
                logger.debug("shared tier read of %s failed: %s", ek, exc)
                obj = None
            finally:
                self._allocator.window = None
            elapsed = time.monotonic() - start
        completed = elapsed < blocking_s  # else the connector's coroutine may still write into its buffer
        for other in window:
            if other is not obj and completed:
                other.ref_count_down()  # allocated, then dropped by the connector
        with self._lock:
            self.reads += 1
            self.read_misses += obj is None
        if obj is None and elapsed >= self.timeout_s:
            self._failed(f"did not answer a read in {elapsed * 1e3:.0f} ms")
        elif obj is not None:
            self._succeeded()
        return obj

    def prefix(self, rows: list[list[Any]], timeout_s: float) -> int:
        """How many leading ``rows`` have every key's chunk (both values) on the server; one
        pipelined round trip. ``rows[i]``: the LMCache keys of chunk i (one per TP rank)."""
        if not rows or not self.available():
            return 0
        names = [[ek.to_string().encode() + suffix for suffix in _VALUES] for row in rows for ek in row]

        async def exists(client: Any) -> list[int]:
            pipe = client.pipeline(transaction=False)
            for pair in names:
                pipe.exists(*pair)
            return await pipe.execute()

        try:
            found = self._run(exists, min(timeout_s, self.timeout_s))
        except Exception as exc:  # noqa: BLE001
            self._failed("failed a lookup", exc)
            return 0
        self._succeeded()
        width = len(rows[0])
        count = 0
        for i in range(len(rows)):
            if any(n != len(_VALUES) for n in found[i * width : (i + 1) * width]):
                break
            count += 1
        return count

    def remove(self, ek: Any) -> None:
        """Delete a chunk found unusable, so no engine is offered it again (best effort)."""
        if not self.available():
            return
        name = ek.to_string().encode()
        try:
            self._run(lambda c: c.delete(*(name + s for s in _VALUES)), self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            self._failed("failed a delete", exc)

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, int]:
        """Counters since start: chunks written, dropped (backlog full or tier down), failed;
        reads and the reads that missed; read buffers leaked by reads that timed out; and
        ``up``: 1 while the tier is in use, 0 while it is down."""
        with self._lock:
            return {"up": int(self.up), "writes": self.writes, "dropped_writes": self.dropped_writes, "failed_writes": self.failed_writes,
                    "reads": self.reads, "read_misses": self.read_misses, "stray_buffers": self._allocator.strays}

    def close(self, timeout: float) -> None:
        """Wait up to ``timeout`` for writes in flight, then close LMCache's connection.

        Not through RemoteBackend.close: LMCache's redis connector closes its job queue with a
        blocking call made on its own event loop, which deadlocks that loop (0.5.6)."""
        if not self.wait_writes(timeout):
            logger.warning("kvtier shared tier %s: closing with writes still in flight.", self.url)
        connection = self.backend.connection
        if connection is None:
            return
        connector = connection.getWrappedConnector()

        async def close() -> None:
            await connector.pq_executor.shutdown_async(wait=False)  # wait=True never returns once cancelled
            await connector.connection.aclose()

        try:
            asyncio.run_coroutine_threadsafe(asyncio.wait_for(close(), timeout), self._loop).result(timeout + 1.0)
        except Exception as exc:  # noqa: BLE001 - cleanup only
            logger.debug("shared tier close: %s", exc)


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 200 else text[:200] + "..."
