"""The e2e tests' disk check lives in :mod:`kvtier.bench.disk_check` (the soak bench uses it too)."""

from kvtier.bench.disk_check import bad_chunk_files  # noqa: F401
