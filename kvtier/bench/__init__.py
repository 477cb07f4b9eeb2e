"""Benchmarks of kvtier's data path, run as ``kvtier-bench <name>`` (see :mod:`kvtier.bench.cli`).

``reload`` (:mod:`kvtier.bench.reload`): save a prompt's KV from engine blocks into the tiers and
reload it into other blocks, next to a raw memcpy and the naive per-block copy.
"""


class BenchError(RuntimeError):
    """The bench could not measure what it set out to: a chunk not stored, a load that failed."""


class VerifyError(BenchError):
    """Reloaded blocks differ from the saved ones."""
