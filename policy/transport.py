"""Redis keys and framing shared by the executor's client and the policy server.

Requests go to one Redis stream read through a consumer group, so several server replicas share
the queue and a crashed replica's pending entries can be claimed by another. Each reply is pushed
to a per-request list that the client blocks on, with a short TTL so nothing accumulates when the
client has given up. A graph one replica was sent in full is also stored under ``Keys.graph`` (with
a TTL), so a later reference to it is resolved by whichever replica reads that request.

Time is Redis's: a request's deadline counts from its stream entry id (the milliseconds at which
Redis added it) and heartbeats carry Redis's clock, so the hosts of the executor and of the
replicas need not agree on the time.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from redis.connection import parse_url

DEFAULT_PREFIX = "drl"


@dataclass(frozen=True)
class Keys:
    """Redis key names under one prefix (one prefix per deployment)."""

    prefix: str = DEFAULT_PREFIX

    @property
    def requests(self) -> str:
        """The request stream."""
        return f"{self.prefix}:requests"

    @property
    def group(self) -> str:
        """The consumer group of the policy server replicas."""
        return f"{self.prefix}:servers"

    def reply(self, request_id: str) -> str:
        """The list a reply to ``request_id`` is pushed to."""
        return f"{self.prefix}:reply:{request_id}"

    def graph(self, run_key: str, digest: str) -> str:
        """The graph store's copy of one run's graph at ``digest``: every replica can resolve a
        :class:`~policy.schema.RunRef` that another replica was sent in full."""
        return f"{self.prefix}:graph:{digest}:{run_key}"

    @property
    def heartbeat(self) -> str:
        """Hash of server replica -> last heartbeat (epoch seconds) and model version."""
        return f"{self.prefix}:servers:heartbeat"


#: Field of a stream entry that holds the JSON request.
PAYLOAD_FIELD = "payload"
#: Seconds a reply list lives if nobody reads it.
REPLY_TTL_S = 30
#: Approximate maximum length of the request stream (XADD MAXLEN ~).
STREAM_MAXLEN = 100_000


def check_url(redis_url: str) -> None:
    """Refuse a Redis URL that redis-py cannot parse, in words that do not repeat it (found by
    review: a password holding ``/``, ``?`` or ``#`` unencoded made redis-py raise "Port could not
    be cast to integer value as '<password>'", a traceback with the password in every log)."""
    try:
        parts = urlsplit(redis_url)
        _ = parts.port  # parses the authority: what redis-py does first
    except ValueError:
        raise ValueError(f"{redacted_url(redis_url)} does not parse: its port is not a number, or its password "
                         "holds '/', '?', '#' or '@' (percent-encode them: '/' as %2F)") from None
    # found by review: redis-py refused a query value it cannot read ("?db=one") only when the
    # executor started, naming no option, and used database 0 for a path that is not a number
    db = parts.path.replace("/", "")
    if parts.scheme in ("redis", "rediss") and db and not db.isdigit():
        raise ValueError(f"{redacted_url(redis_url)}: its path {db!r} is not a database number")
    try:
        parse_url(redis_url)
    except ValueError as exc:  # redis-py's words name the parameter, never the password
        raise ValueError(f"{redacted_url(redis_url)}: {exc}") from None


def check_ca_cert(redis_url: str, ca_cert: str | None) -> None:
    """Refuse a CA bundle that would be ignored or cannot be read (ValueError naming it).

    The bundle verifies the server's certificate of a ``rediss://`` URL (a private CA, as a
    self-hosted Redis with TLS has); with ``redis://`` there is no TLS to verify, so the setting
    is a mistake worth stopping for rather than a silent plain-text connection.
    """
    if not ca_cert:
        return
    if not redis_url.startswith("rediss://"):
        raise ValueError(f"a CA certificate ({ca_cert!r}) needs a rediss:// URL (TLS); the URL is not one")
    if not os.path.isfile(ca_cert) or not os.access(ca_cert, os.R_OK):
        raise ValueError(f"CA certificate {ca_cert!r} is not a readable file")


#: query parameters of a Redis URL that are secrets (redis-py reads ``?password=`` too)
_SECRET_PARAMS = frozenset({"password", "username", "user"})


def scrubbed(text: str, url: str) -> str:
    """``text`` (an error message) without the secrets of the Redis URL ``url``: its password, each
    piece of it between ``/ ? # @ :`` (found by review: redis-py's "Port could not be cast to
    integer value as '<password up to its first />'" put the password on the placements page),
    and the values of its ``password`` / ``username`` query parameters."""
    _, sep, rest = url.partition("://")
    secrets: set[str] = set()
    if sep and "@" in rest:  # the password: after the user's ":", or all before the last "@"
        password = rest.rsplit("@", 1)[0].split(":", 1)[-1]
        secrets.update([password, *re.split(r"[/?#@:]", password)])
    query = rest.partition("?")[2].partition("#")[0]
    try:
        secrets.update(v for k, v in parse_qsl(query, keep_blank_values=True) if k.lower() in _SECRET_PARAMS)
    except ValueError:
        pass
    for secret in sorted((s for s in secrets if len(s) >= 3), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def redacted_url(url: str) -> str:
    """``url`` without its secrets, for logs and reports: the user and password before the last
    ``@`` (a password may hold ``@``, ``/``, ``?`` or ``#``, which a URL parser takes for the end of
    the authority), and ``password`` / ``username`` query parameters (found by review:
    ``unix:///run/redis.sock?password=...`` and ``redis://:ab/cd@host`` were shown whole)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<a Redis URL that does not parse>"
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        # "user:password": the user stays (an ACL user says who, not a secret); anything else
        # before the "@" may be a password alone, and goes
        auth = f"{userinfo.split(':', 1)[0]}:***@" if ":" in userinfo else "***@"
    else:
        auth = ""
    where, qmark, query = rest.partition("?")
    query = query.partition("#")[0]
    if qmark:
        try:
            pairs = parse_qsl(query, keep_blank_values=True)
        except ValueError:
            return f"{scheme}://{auth}{where}?***"
        query = "&".join(f"{k}=***" if k.lower() in _SECRET_PARAMS else (f"{k}={v}" if v else k) for k, v in pairs)
    return f"{scheme}://{auth}{where}" + (f"?{query}" if query else "")


def tls_options(redis_url: str, ca_cert: str | None) -> dict[str, Any]:
    """``redis.Redis.from_url`` keyword arguments for TLS: the CA bundle, when one is given
    for a ``rediss://`` URL (otherwise none: the system's trust store, or no TLS)."""
    return {"ssl_ca_certs": ca_cert} if ca_cert and redis_url.startswith("rediss://") else {}


#: a heartbeat more than this many seconds ahead of Redis's clock is not a replica's (each writes
#: Redis's own time): read as unreadable, never as live for ever (found by review: {"ts": 1e300})
HEARTBEAT_FUTURE_S = 60.0


def freshest_heartbeat(r: Any, keys: Keys) -> float | None:
    """Seconds since the freshest replica heartbeat under ``keys``, on Redis's clock (``HGETALL``
    and ``TIME`` in one round trip on client ``r``); None when no replica has written one."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.heartbeat)
    pipe.time()
    beats, (sec, usec) = pipe.execute()
    if not beats:
        return None
    now = sec + usec / 1e6
    return min(heartbeat_age(v, now) for v in beats.values())


def heartbeat_age(value: bytes | str, now: float) -> float:
    """Seconds since the heartbeat ``value`` was written, ``now`` on Redis's clock; ``inf`` for one
    that does not read or is dated past ``now`` + :data:`HEARTBEAT_FUTURE_S`."""
    ts = heartbeat_ts(value)
    if ts <= 0.0 or ts > now + HEARTBEAT_FUTURE_S:
        return math.inf
    return now - ts


def heartbeat_ts(value: bytes | str) -> float:
    """A heartbeat's time (epoch seconds on Redis's clock): bare, or JSON ``{"ts": ...}``; 0 if
    unreadable (counts as long dead)."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    try:
        ts: Any = float(text)
    except ValueError:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." (found by review)
            return 0.0
        ts = obj.get("ts") if isinstance(obj, dict) else None
        if not isinstance(ts, (int, float)) or isinstance(ts, bool):
            return 0.0
    try:
        ts = float(ts)
    except OverflowError:  # an integer of 400 digits
        return 0.0
    return ts if math.isfinite(ts) else 0.0
