"""kvtier's settings, read from vLLM's ``kv_connector_extra_config`` (or any dict)."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any

import psutil

from kvtier.urls import redact, shared_url_problem

GiB = 1 << 30


# LMCache users know the shared store as remote_url; in kvtier "remote" is a P/D producer.
_RENAMED = {"remote_url": ["shared_url"], "remote_timeout_ms": ["shared_timeout_ms"]}


class ConfigError(ValueError):
    """A setting a user wrote is unknown or has a bad value; the message names the key."""


def _default_cpu_bytes() -> int:
    """A quarter of the memory available now, at most 64 GiB, at least 256 MiB."""
    return int(min(64 * GiB, max(GiB // 4, psutil.virtual_memory().available // 4)))


_ZERO_TURNS_OFF = {"pd_hbm_lease_ms", "switch_interval_us", "idle_wait_us"}  # integer settings for which 0 means "off"

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
    copied-out chunks waiting to be stored; where it could not take another save of the same size
    a save waits for its step's forward, beyond it the oldest are dropped and counted (default:
    half of cpu_bytes). disk_io:
    ``buffered`` or ``direct`` (O_DIRECT reads of disk chunks). save_replies: also save the chunks
    a request's generated tokens fill (true, the default: a conversation's next turn loads the
    previous reply too), or only its prompt's (false). veto_slower_loads: recompute a hit the cost
    model predicts slower to load than to compute (true, the default), or load every hit (false).

    P/D (:mod:`kvtier.pd`): pd_bind: address the chunk server binds (loopback by default; any
    other address needs pd_secret). pd_host: address advertised to decode engines (default: the
    bind address, or this host's name when binding all interfaces). pd_port: port of rank 0's
    chunk server, rank r uses pd_port + r (default 0: a free port per rank). pd_secret: shared
    secret that authenticates every peer message and encrypts the side channel (ZMQ CURVE; default:
    env ``KVTIER_PD_SECRET``).
    pd_timeout_ms: a transfer that makes no progress for this long fails and is recomputed.
    pd_hold_bytes: most bytes of published chunks a prefill engine pins for decode engines
    (default: a quarter of cpu_bytes). pd_hold_s: how long a published request's chunks stay
    pinned when no decode engine fetches them. pd_transport: how chunks travel, ``auto`` (NIXL
    when both engines have it, else ZMQ), ``nixl`` (NIXL required: start-up fails without it;
    a producer without it is still read over ZMQ) or ``zmq``. ZMQ stays the control plane.
    pd_hbm_lease_ms: how long a prefill engine keeps a finished P/D request's engine blocks for
    decode engines to READ HBM to HBM over NIXL (0: never; they always fetch from its CPU tier).
    pd_hbm_push: how a decode engine that asked first (push) gets each chunk HBM to HBM the moment
    the producer's step computed it: ``read`` (it READs the producer's live blocks) or ``write``
    (the producer WRITEs into the blocks the decode engine named). A decode engine's setting.

    Shared tier (a Redis or Valkey server many engines use; named "shared" because "remote" is
    P/D's producer): shared_url: ``redis://[:password@]host:port[/db]`` (``valkey://`` alike;
    None: no shared tier); without a password in the URL, env ``KVTIER_SHARED_PASSWORD`` gives
    it. shared_timeout_ms: most milliseconds one network call to it may take; a lookup asks it
    within min(this, lookup_timeout_ms / 2).

    switch_interval_us: Python's thread switch interval to set in each engine worker process, in µs
    (default: env ``KVTIER_SWITCH_INTERVAL_US``, else 500; 0: Python's own 5 ms is left). Each time
    one thread comes back from a wait (vLLM's engine loop from its GPU sync, kvtier's threads from
    a copy, a socket or NIXL) it waits up to this long for the interpreter another thread holds.
    idle_wait_us: how long at most an engine step that computes nothing (its requests all wait for
    loads, or a producer's lent blocks for their decode engines) waits for a load or a lease to
    end, the interpreter released, in µs (default: env ``KVTIER_IDLE_WAIT_US``, else 2000; 0: step
    on at once, as vLLM does).
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
    save_replies: bool = True
    veto_slower_loads: bool = True
    pd_bind: str = "127.0.0.1"
    pd_host: str | None = None
    pd_port: int | None = None
    pd_secret: str | None = None
    pd_timeout_ms: int = 5000
    pd_hold_bytes: int | None = None
    pd_hold_s: int = 120
    pd_transport: str = "auto"
    pd_hbm_lease_ms: int = 2000
    pd_hbm_push: str = "read"
    shared_url: str | None = None
    shared_timeout_ms: int = 1000
    switch_interval_us: int | None = None
    idle_wait_us: int | None = None

    def __post_init__(self) -> None:
        if self.unaligned not in ("partial", "handoff", "auto"):
            raise ConfigError(f"kvtier setting 'unaligned' must be 'partial', 'handoff' or 'auto', got {self.unaligned!r}.")
        if self.disk_io not in ("buffered", "direct"):
            raise ConfigError(f"kvtier setting 'disk_io' must be 'buffered' or 'direct', got {self.disk_io!r}.")
        if self.pd_transport not in ("auto", "nixl", "zmq"):
            raise ConfigError(f"kvtier setting 'pd_transport' must be 'auto', 'nixl' or 'zmq', got {self.pd_transport!r}.")
        if self.pd_hbm_push not in ("read", "write"):
            raise ConfigError(f"kvtier setting 'pd_hbm_push' must be 'read' or 'write', got {self.pd_hbm_push!r}.")
        for name in ("switch_interval_us", "idle_wait_us"):
            if (us := getattr(self, name)) is not None and not 0 <= us <= 5000:
                raise ConfigError(f"kvtier setting {name!r} must be 0 to 5000, got {us!r}.")
        if self.shared_url is not None and (problem := shared_url_problem(self.shared_url)):
            raise ConfigError(f"kvtier setting 'shared_url' ({redact(self.shared_url)!r}) {problem}.")
        if not _is_loopback(self.pd_bind) and not self.secret:
            raise ConfigError(f"kvtier setting 'pd_bind' is {self.pd_bind!r}, which is not a loopback address: "
                              "set 'pd_secret' (or KVTIER_PD_SECRET) so that peers are authenticated.")

    @property
    def secret(self) -> bytes | None:
        """The P/D shared secret (setting, else environment), as bytes; None when unset."""
        secret = self.pd_secret or os.environ.get("KVTIER_PD_SECRET")
        return secret.encode() if secret else None

    @property
    def switch_interval_s(self) -> float:
        """The thread switch interval to set, in seconds (setting, else environment, else 500 µs); 0:
        leave Python's."""
        return _micros(self.switch_interval_us, "KVTIER_SWITCH_INTERVAL_US", 500)

    @property
    def idle_wait_s(self) -> float:
        """How long an idle step waits for a load, in seconds (setting, else environment, else 2 ms)."""
        return _micros(self.idle_wait_us, "KVTIER_IDLE_WAIT_US", 2000)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> KvtierConfig:
        """Parse user settings; an unknown key or a bad value raises :class:`ConfigError` naming it."""
        raw = dict(raw or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1) or _RENAMED.get(unknown[0], [])
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown kvtier setting {unknown[0]!r}{hint}; known settings: "
                              f"{', '.join(sorted(known))}.")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            kind = known[name].type
            if kind == "bool":
                value = _boolean(name, value)
            elif "int" in kind:
                if isinstance(value, bool) or not isinstance(value, (int, str)):
                    raise ConfigError(f"kvtier setting {name!r} must be an integer, got {value!r}.")
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"kvtier setting {name!r} must be an integer, got {value!r}.") from None
                if value < 0 or (value == 0 and name not in _ZERO_TURNS_OFF):
                    raise ConfigError(f"kvtier setting {name!r} must be positive{' or 0' if name in _ZERO_TURNS_OFF else ''}, "
                                      f"got {value}.")
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

    def pd_endpoints(self, rank: int) -> tuple[str, str]:
        """(bind, advertised) ZMQ endpoints of rank ``rank``'s chunk server; port 0 means any free port."""
        port = 0 if self.pd_port is None else self.pd_port + rank
        host = self.pd_host or (socket.gethostname() if self.pd_bind in ("0.0.0.0", "::", "*") else self.pd_bind)
        bind = "*" if self.pd_bind in ("0.0.0.0", "*") else self.pd_bind
        return f"tcp://{_bracket(bind)}:{port}", f"tcp://{_bracket(host)}:{port}"


def _boolean(name: str, value: Any) -> bool:
    """A boolean setting: true or false, as JSON or as a string."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"kvtier setting {name!r} must be true or false, got {value!r}.")


def _micros(us: int | None, env: str, default: int) -> float:
    """A µs setting of 0 to 5000 in seconds: the setting, else the environment variable ``env``."""
    if us is None:
        raw = os.environ.get(env, str(default))
        try:
            us = int(raw)
        except ValueError:
            raise ConfigError(f"{env} must be an integer of µs, got {raw!r}.") from None
    return max(0, min(us, 5000)) / 1e6


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
