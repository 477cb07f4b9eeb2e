"""The scheduler asks the workers "how much of this prefix is stored, in which tier?" over ZMQ.

Rank 0's worker serves the answer (:class:`LookupServer`); the scheduler half of the connector
asks through :class:`LookupClient`. Messages are versioned, size-limited ``msgspec`` structs.
"""

from kvtier.lookup.client import LookupClient
from kvtier.lookup.protocol import LookupReply, LookupRequest
from kvtier.lookup.server import LookupServer

__all__ = ["LookupClient", "LookupReply", "LookupRequest", "LookupServer"]
