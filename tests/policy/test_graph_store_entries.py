"""The graph cache, the shared graph store and RunRef resolution on store entries a replica cannot
use (found by review; each test failed on the code before its fix)."""

from __future__ import annotations

import json

import redis
from server_helpers import KEYS, ask, chain, request

from policy.config import ServerConfig
from policy.graph import view
from policy.schema import RunRef, dumps
from policy.server import PolicyServer


def test_a_refused_store_entry_is_replaced_when_the_graph_is_resent_in_full(start_server,
                                                                            rclient: redis.Redis) -> None:
    """The store holds something at a graph's key that no replica can read (a half-written value,
    another release's format): a reference to it is answered ``unknown_graph`` and the client
    resends the graph in full. That resend is the store's only refill, but the reply script writes
    it with ``SET NX``, which leaves the unreadable value in place (and every ``GETEX`` of it
    refreshes its TTL): every other replica keeps bouncing the run's references as unknown_graph
    for as long as the run is referenced."""
    g = chain("review2/refused-entry", 10)
    key = KEYS.graph(g.run_key, g.digest)
    rclient.set(key, b'{"run_key": "review2/refused-entry", "tasks": "truncated', ex=3600)
    a = start_server(consumer="a")
    # the client's first try: a reference, refused (the store entry cannot be read) ...
    first = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t0")]))
    assert first is not None and first.error_code == "unknown_graph"
    # ... then the graph in full, accepted
    resent = ask(rclient, request([g], [(g.run_key, "t0")]))
    assert resent is not None and resent.ok
    a.stop()
    b = start_server(consumer="b")  # another replica, which was never sent the graph
    by_ref = ask(rclient, request([RunRef(g.run_key, g.digest)], [(g.run_key, "t1")]))
    assert by_ref is not None and by_ref.ok, (
        f"the store still holds {rclient.get(key)[:60]!r}: the resent graph did not replace it, and "
        f"replica b answers {by_ref.error_code if by_ref else None}")
    assert b.server.metrics.graph_store_hits._value.get() == 1


def test_a_store_entry_of_another_run_leaves_no_derived_state_behind(rclient: redis.Redis) -> None:
    """Store keys are ``<prefix>:graph:<digest>:<run_key>`` and a RunRef's digest is any string, so
    ``RunRef("x", "<D>:dag")`` reads the entry of run ``dag:x`` at ``D``. ``_stored_graph`` rejects
    it (run key mismatch: right) but only after ``view(graph)`` memoised the other run's view: an
    entry of the view memo whose graph the cache never held, so no ``on_drop`` ever removes it and
    it sits outside the byte bound (the memo keeps up to 4,096 of them). The check belongs before
    ``view`` (and before parsing where the key can tell)."""
    server = PolicyServer(ServerConfig(prefix=KEYS.prefix))
    server._redis = rclient  # resolve against the real store, without the serving loop
    other = chain("dag:review2-x", 200)
    rclient.set(KEYS.graph(other.run_key, other.digest),
                json.dumps(other.to_json(), separators=(",", ":")), ex=3600)
    ref = RunRef("review2-x", f"{other.digest}:dag")
    assert KEYS.graph(ref.run_key, ref.digest) == KEYS.graph(other.run_key, other.digest)
    jobs = server.handle([(b"1-0", {b"payload": dumps(request([ref], [(ref.run_key, "t0")]))})])
    # refused for its digest (not 16 hex digits), or answered unknown_graph: never resolved
    assert jobs[0].reply is not None and jobs[0].reply.error_code in ("bad_request", "unknown_graph")
    gone = (other.run_key, other.digest)
    assert not server.cache.holds(gone)
    assert gone not in view, "the view of a graph the cache never held stays memoised (outside the byte bound)"


def test_a_stored_entry_that_does_not_match_its_key_leaves_no_view_behind(rclient: redis.Redis) -> None:
    """The same leak without the key collision: an entry whose content is another graph than its
    key names was refused only after ``view()`` memoised it."""
    server = PolicyServer(ServerConfig(prefix=KEYS.prefix))
    server._redis = rclient
    wanted, other = chain("review2-y", 5), chain("review2-z", 7)
    rclient.set(KEYS.graph(wanted.run_key, wanted.digest),
                json.dumps(other.to_json(), separators=(",", ":")), ex=3600)
    jobs = server.handle([(b"1-0", {b"payload": dumps(request([RunRef(wanted.run_key, wanted.digest)],
                                                              [(wanted.run_key, "t0")]))})])
    assert jobs[0].reply is not None and jobs[0].reply.error_code == "unknown_graph"
    assert (other.run_key, other.digest) not in view
    assert not rclient.exists(KEYS.graph(wanted.run_key, wanted.digest)), "the refused entry is deleted"
