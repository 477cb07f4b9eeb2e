"""The e2e tests' chat model lives in :mod:`kvtier.bench.chat_model` (the benches build it too)."""

from kvtier.bench.chat_model import *  # noqa: F401,F403
from kvtier.bench.chat_model import __all__  # noqa: F401
