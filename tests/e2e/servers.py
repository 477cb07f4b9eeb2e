"""The e2e tests' server helpers live in :mod:`kvtier.bench.servers` (the benches use them too)."""

from kvtier.bench.servers import *  # noqa: F401,F403
from kvtier.bench.servers import __all__  # noqa: F401
