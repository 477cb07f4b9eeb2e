"""A consumer's READs into its own engine blocks (HBM to HBM) from one producer: each has a
deadline, and none is left running when the blocks may take other bytes.

A READ that lands late writes wherever its descriptors point: into blocks whose checksum was
already checked, whose chunk was then copied from P's CPU tier, or that vLLM has handed to
another request. So every READ into engine blocks is tracked here from its posting
(:meth:`Fence.track`), and its blocks are given to nothing else until it settled:

- a READ that ends (done or failed) before its deadline, ``timeout_s`` (``pd_timeout_ms``)
  after its posting, settles then, and NIXL's handle goes back;
- one still running at its deadline fails its transfer at once (one warning naming the
  producer), and the producer's NIXL agent is torn down on this side (:meth:`Agent.forget
  <kvtier.pd.nixl.Agent.forget>`, NIXL's ``remove_remote_agent``: this agent can no longer post
  to it and its connection to it closes; a READ not posted yet by then never is). It is then
  waited for once more, up to ``timeout_s``, and counts as settled either way: its producer is
  gone for this engine, and a fetch that reaches that producer again adds its agent afresh.

The transfer's thread calls :meth:`Fence.settle` before the fetch returns (so before the load
is reported, its blocks checked or handed back to vLLM), and before anything else is posted
into blocks an earlier READ took (:meth:`kvtier.pd.consumer.landing.Landings.settle_early`). Used by
that thread only.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvtier.pd.nixl import Agent, NixlError, Transfer

logger = logging.getLogger(__name__)
_POLL_S = 20e-6  # how often a waiting READ looks at its state, s


class Fence:
    """The READs that ``agent`` posts from NIXL peer ``peer`` (the producer's chunk server at
    ``endpoint``) into this engine's blocks. ``broken``: one missed its deadline, the peer was torn
    down: nothing more of this transfer is READ."""

    def __init__(self, agent: Agent, peer: str, endpoint: str):
        self.agent, self.peer, self.endpoint = agent, peer, endpoint
        self._posted: dict[Transfer, float] = {}  # READ not settled yet -> when it was posted (monotonic s)
        self._fenced: set[Transfer] = set()  # READs that missed their deadline
        self.broken = False

    def track(self, transfer: Transfer) -> Transfer:
        """A READ just posted into this engine's blocks; returns it."""
        self._posted[transfer] = time.monotonic()
        return transfer

    def wait(self, transfer: Transfer, timeout_s: float, cancelled: Callable[[], bool] = bool) -> None:
        """Return once ``transfer`` (tracked) is done. Raises :class:`NixlError` when it failed, when
        ``cancelled()`` (it still runs then: :meth:`settle` waits for it), or at its deadline, ``timeout_s``
        after its posting (it is fenced then: see the module's docstring)."""
        if transfer in self._fenced:
            raise NixlError(f"a READ from {self.endpoint} missed its deadline")
        deadline = self._posted.get(transfer, time.monotonic()) + timeout_s
        while (state := transfer.state()) == "PROC":
            if time.monotonic() > deadline:
                self._miss(transfer, timeout_s)
                raise NixlError(f"a {transfer.nbytes} B READ from {self.endpoint} missed its {timeout_s:.1f} s deadline")
            if cancelled():
                raise NixlError("the request was aborted")
            time.sleep(_POLL_S)
        self._posted.pop(transfer, None)
        if state != "DONE":
            transfer.release()
            raise NixlError(f"a {transfer.nbytes} B READ from {self.endpoint} failed")

    def settle(self, transfer: Transfer | None, timeout_s: float) -> bool:
        """Wait until ``transfer`` (every tracked READ: None) no longer runs, each up to its deadline,
        ``timeout_s`` after its posting (one past it is fenced), and give NIXL's handles back.
        True if each ended before its deadline. Never raises."""
        if transfer is not None and transfer in self._fenced:
            return False
        ok = True
        for read in [transfer] if transfer is not None else list(self._posted):
            if (posted_s := self._posted.get(read)) is None:
                continue  # settled already
            if read.settle(max(0.0, posted_s + timeout_s - time.monotonic())):
                del self._posted[read]
                read.release()
            else:
                self._miss(read, timeout_s)
                ok = False
        return ok

    def _miss(self, transfer: Transfer, timeout_s: float) -> None:
        """``transfer`` runs past its deadline: the load fails, the producer's agent is torn down, and
        the READ is waited for once more, up to ``timeout_s``."""
        self._posted.pop(transfer, None)
        self._fenced.add(transfer)
        if not self.broken:
            self.broken = True
            logger.warning("kvtier P/D: a READ from %s into this engine's blocks did not end in %.1f s; the load fails "
                           "and that producer's NIXL agent is dropped here.", self.endpoint, timeout_s)
            self.agent.forget(name=self.peer)
        if transfer.settle(timeout_s):
            transfer.release()
        else:
            logger.warning("kvtier P/D: a READ from %s still runs %.1f s after its NIXL agent was dropped; its blocks "
                           "are handed back regardless.", self.endpoint, timeout_s)
