"""Faults injected on purpose inside the engine processes, for fault soaks: a chunk corrupted
after it arrived at a decode engine, and a NIXL READ posted late. Off unless ``KVTIER_PD_FAULTS``
is set; then each hook draws at random (seeded) whether to strike.

``KVTIER_PD_FAULTS="corrupt_chunk=0.05,delay_read_ms=200:0.05,seed=7"``:

- ``corrupt_chunk=P``: each chunk handed to :func:`corrupt` has one payload byte flipped with
  probability ``P`` (0-1): a chunk in a CPU-tier buffer (``ChunkBuffer``: past its codec
  header), or one that landed in the engine's own blocks (``Landed``: a byte of its first block,
  in engine KV registered as host memory, ``DRAM``; engine KV on a GPU is left alone). The
  consumer's checks must refuse it: the MAC, the chunk's checksum, the landed blocks' KVSUM64.
- ``delay_read_ms=MS:P``: :func:`delay_read` sleeps, with probability ``P``, a delay drawn
  uniformly from ``MS/2`` to ``3*MS/2`` milliseconds (``delay_read_ms=MS`` alone: always). Called
  just before a READ is posted, it makes the READ race the producer's lease and ``pd_timeout_ms``.
- ``seed=N``: the draws' seed (default 0): the same sequence of draws in every process.

Every strike logs one WARNING line starting with :data:`MARK`, and each hook's first call logs
one line starting with :data:`IN_USE`: a soak counts both in the engines' logs (a hook never
called is a hook not wired in). Unset, every hook returns at once (one global test), so the calls
may stay in the P/D code for good. Hooks may be called from any thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import threading
import time
from dataclasses import dataclass

ENV = "KVTIER_PD_FAULTS"
MARK = "kvtier P/D fault injected:"  # then the fault's name and where it struck
IN_USE = "kvtier P/D fault hook in use:"  # then the hook's name, once per process

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """What ``KVTIER_PD_FAULTS`` asks for. ``corrupt_chunk``: probability a chunk is corrupted
    (0-1); ``delay_read_ms``: a delayed READ's mean delay, ms; ``delay_read_p``: probability a
    READ is delayed (0-1); ``seed``: of the draws."""

    corrupt_chunk: float = 0.0
    delay_read_ms: float = 0.0
    delay_read_p: float = 0.0
    seed: int = 0

    def text(self) -> str:
        """The spec as ``KVTIER_PD_FAULTS`` writes it (``parse(spec.text()) == spec``)."""
        return (f"corrupt_chunk={self.corrupt_chunk:g},delay_read_ms={self.delay_read_ms:g}:{self.delay_read_p:g},"
                f"seed={self.seed}")


def parse(text: str) -> FaultSpec | None:
    """``KVTIER_PD_FAULTS``'s value as a spec; None when empty. Raises ValueError naming the bad item."""
    if not text.strip():
        return None
    values: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            if name == "corrupt_chunk":
                values[name] = _probability(value)
            elif name == "delay_read_ms":
                ms, _, p = value.partition(":")
                values["delay_read_ms"], values["delay_read_p"] = float(ms), _probability(p or "1")
                if not values["delay_read_ms"] >= 0:
                    raise ValueError
            elif name == "seed":
                values[name] = int(value)
            else:
                raise KeyError(name)
        except KeyError:
            raise ValueError(f"{ENV}: unknown fault {name!r} (known: corrupt_chunk, delay_read_ms, seed)") from None
        except ValueError:
            raise ValueError(f"{ENV}: bad value in {item!r}") from None
    return FaultSpec(**values)


def _probability(text: str) -> float:
    p = float(text)
    if not 0.0 <= p <= 1.0:
        raise ValueError(text)
    return p


_spec: FaultSpec | None = None
_rng = random.Random(0)
_lock = threading.Lock()
_used: set[str] = set()
counts = {"corrupt": 0, "delay_read": 0}  # strikes in this process, by fault


def configure(spec: FaultSpec | None) -> None:
    """Arm the hooks with ``spec`` (None: off) and restart the draws from its seed (done once at
    import from the environment; tests call it directly)."""
    global _spec, _rng
    with _lock:
        _spec = spec
        _rng = random.Random(f"kvtier-pd-faults/{spec.seed if spec else 0}")
        _used.clear()
        for name in counts:
            counts[name] = 0


def active() -> bool:
    """Whether any fault is armed in this process."""
    return _spec is not None


def _draw(hook: str, p: float) -> float | None:
    """A uniform draw in [0, 1) when the fault strikes (probability ``p``), else None."""
    with _lock:
        if hook not in _used:
            _used.add(hook)
            logger.warning("%s %s (pid %d, %s)", IN_USE, hook, os.getpid(), _spec.text() if _spec else "off")
        hit = _rng.random() < p
        return _rng.random() if hit else None


def corrupt(chunk, landing=None, index: int = 0):
    """Flip one payload byte of ``chunk`` with probability ``corrupt_chunk``; returns ``chunk``.

    ``chunk``: a ``ChunkBuffer`` (its ``data``: uint8 tensor in host memory, codec header first,
    owned by the caller) or a ``Landed`` whose blocks are ``landing.block_ids[index]`` in
    ``landing.regions`` (``kvtier.pd.hbm.Landing``) of this process. Call it where the chunk has
    arrived and before it is checked."""
    spec = _spec
    if spec is None or spec.corrupt_chunk <= 0:
        return chunk
    where = _draw("corrupt", spec.corrupt_chunk)
    if where is None:
        return chunk
    data = getattr(chunk, "data", None)
    if data is not None:
        from kvtier.codec import HEADER_BYTES

        view = data.numpy()
        if view.size <= HEADER_BYTES:
            return chunk
        offset = HEADER_BYTES + int(where * (view.size - HEADER_BYTES))
        view[offset] ^= 0xFF
        _struck("corrupt", f"byte {offset} of a {view.size} B chunk buffer")
        return chunk
    blocks = landing.block_ids[index] if landing is not None and index < len(landing.block_ids) else None
    if not blocks or landing.kind != "DRAM" or not landing.regions:
        return chunk  # engine KV on a GPU: not reachable from the host here
    region = landing.regions[0]
    offset = int(where * region.block_bytes)
    byte = ctypes.c_uint8.from_address(region.base + blocks[0] * region.stride + offset)
    byte.value ^= 0xFF
    _struck("corrupt", f"byte {offset} of engine block {blocks[0]} (chunk {index}, landed)")
    return chunk


def read_delay_s() -> float:
    """How long to hold the next READ back, s: 0, or with probability ``delay_read_p`` a draw
    from ``delay_read_ms`` / 2 to 3 × ``delay_read_ms`` / 2 (counted as struck)."""
    spec = _spec
    if spec is None or spec.delay_read_p <= 0 or spec.delay_read_ms <= 0:
        return 0.0
    where = _draw("delay_read", spec.delay_read_p)
    if where is None:
        return 0.0
    delay_s = spec.delay_read_ms * (0.5 + where) / 1000
    _struck("delay_read", f"{delay_s * 1e3:.0f} ms before a READ")
    return delay_s


def delay_read() -> float:
    """Sleep :func:`read_delay_s` (call it just before posting a READ); returns the seconds slept."""
    delay_s = read_delay_s()
    if delay_s:
        time.sleep(delay_s)
    return delay_s


def _struck(fault: str, where: str) -> None:
    with _lock:
        counts[fault] += 1
    logger.warning("%s %s, %s (pid %d)", MARK, fault, where, os.getpid())


configure(parse(os.environ.get(ENV, "")))
