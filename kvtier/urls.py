"""URLs of a shared Redis/Valkey server: checked once, redacted wherever they are shown.

No imports beyond the standard library: both the settings (:mod:`kvtier.config`) and the
storage (:mod:`kvtier.storage`) use it.
"""

from __future__ import annotations

import re
import urllib.parse


def shared_url_problem(url: object) -> str | None:
    """Why ``url`` cannot name a shared Redis/Valkey server (a phrase), or None if it can."""
    if not isinstance(url, str):
        return "must be a string"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("redis", "valkey"):
        return "must start with redis:// or valkey://"
    try:
        port = parsed.port
    except ValueError:
        return "has a bad port"
    if not parsed.hostname or port is None:
        return "must name a host and a port (redis://host:6379)"
    if parsed.query or parsed.fragment:
        return "must not carry a query or fragment"
    return None


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and errors."""
    return re.sub(r"^([a-z]+://[^:@/]*):[^@/]*@", r"\1:***@", url)
