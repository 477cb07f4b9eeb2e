"""kvtier's settings, read from vLLM's ``kv_connector_extra_config`` (or any dict)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import psutil

GiB = 1 << 30


class ConfigError(ValueError):
    """A setting a user wrote is unknown or has a bad value; the message names the key."""


def _default_cpu_bytes() -> int:
    """A quarter of the memory available now, at most 64 GiB, at least 256 MiB."""
    return int(min(64 * GiB, max(GiB // 4, psutil.virtual_memory().available // 4)))


@dataclass(frozen=True, slots=True)
class KvtierConfig:
    """Every setting, with its unit.

    cpu_bytes: CPU tier size in bytes. disk_path: directory of the disk tier (None: no disk tier).
    disk_bytes: disk tier size in bytes. chunk_tokens: tokens per stored chunk, a multiple of the
    engine's block size. lookup_address: ZMQ endpoint of the lookup server (default: an IPC socket
    in the temp directory, private to the engine). lookup_timeout_ms: how long the scheduler waits
    for a lookup before treating it as a miss. min_load_tokens: smallest load worth planning, in
    tokens beyond the engine's own prefix-cache hit (default: one chunk). unaligned: how a hit whose
    local floor ends inside a chunk is loaded: ``partial`` (block by block from that chunk),
    ``handoff`` (prefill to the next chunk boundary, then load; needs kvtier's scheduler_cls) or
    ``auto`` (cheaper by the measured cost model). prefill_tokens_per_s: the engine's prefill rate
    for the cost model (default: measured from step times). save_backlog_bytes: most bytes of
    copied-out chunks waiting to be stored; beyond it the oldest are dropped and counted (default:
    a quarter of cpu_bytes). disk_io: ``buffered`` or ``direct`` (O_DIRECT reads of disk chunks).
    """

    cpu_bytes: int = field(default_factory=_default_cpu_bytes)
    disk_path: str | None = None
    disk_bytes: int = 16 * GiB
    chunk_tokens: int = 256
    lookup_address: str | None = None
    lookup_timeout_ms: int = 2000
    min_load_tokens: int | None = None
    unaligned: str = "auto"
    prefill_tokens_per_s: int | None = None
    save_backlog_bytes: int | None = None
    disk_io: str = "buffered"

    def __post_init__(self) -> None:
        if self.unaligned not in ("partial", "handoff", "auto"):
            raise ConfigError(f"kvtier setting 'unaligned' must be 'partial', 'handoff' or 'auto', got {self.unaligned!r}.")
        if self.disk_io not in ("buffered", "direct"):
            raise ConfigError(f"kvtier setting 'disk_io' must be 'buffered' or 'direct', got {self.disk_io!r}.")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> KvtierConfig:
        """Parse user settings; an unknown key or a bad value raises :class:`ConfigError` naming it."""
        raw = dict(raw or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"unknown kvtier setting {unknown[0]!r}; known settings: {', '.join(sorted(known))}.")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            kind = known[name].type
            if "int" in kind:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise ConfigError(f"kvtier setting {name!r} must be an integer, got {value!r}.")
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"kvtier setting {name!r} must be an integer, got {value!r}.") from None
                if value <= 0:
                    raise ConfigError(f"kvtier setting {name!r} must be positive, got {value}.")
            elif value is not None and not isinstance(value, str):
                raise ConfigError(f"kvtier setting {name!r} must be a string, got {value!r}.")
            values[name] = value
        return cls(**values)

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_tokens % block_size:
            raise ConfigError(
                f"kvtier setting 'chunk_tokens' ({self.chunk_tokens}) must be a multiple of the engine block size ({block_size})."
            )

    def lookup_endpoint(self, engine_id: str) -> str:
        """The lookup server's ZMQ endpoint: configured, or an IPC socket named after the engine."""
        if self.lookup_address:
            return self.lookup_address
        return f"ipc://{os.path.join(tempfile.gettempdir(), f'kvtier-lookup-{engine_id}.sock')}"
