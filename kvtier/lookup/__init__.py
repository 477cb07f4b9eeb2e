"""The scheduler asks "how much of this prefix is stored, in which tier?" over ZMQ; rank 0 answers
for every rank.

Rank 0's worker runs the :class:`LookupServer`, which keeps a :class:`HoldIndex` of what each rank
holds; every rank's :class:`HoldReporter` keeps it current (the commit protocol: a chunk is
visible only while all ranks hold it). The scheduler half of the connector asks through a
:class:`LookupClient`. Messages are versioned, size-limited ``msgspec`` structs.
"""

from kvtier.lookup.client import LookupClient
from kvtier.lookup.index import HoldIndex
from kvtier.lookup.protocol import HoldReport, LookupReply, LookupRequest
from kvtier.lookup.reporter import HoldReporter
from kvtier.lookup.server import LookupServer

__all__ = ["HoldIndex", "HoldReport", "HoldReporter", "LookupClient", "LookupReply", "LookupRequest", "LookupServer"]
