"""Redis keys and framing shared by the executor's client and the policy server.

Requests go to one Redis stream read through a consumer group, so several server replicas share
the queue and a crashed replica's pending entries can be claimed by another. Each reply is pushed
to a per-request list that the client blocks on, with a short TTL so nothing accumulates when the
client has given up.
"""

from __future__ import annotations

from dataclasses import dataclass

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
