"""The executor's client and the policy server over TLS (``rediss://``) with an ACL user.

A real redis-server listens with TLS only (its certificate signed by a private CA made here) and
knows one user, ``placer``, allowed the keys under the deployment's prefix and nothing else (the
default user is off). Issue #5: "Redis URL with password or ACL user and optional TLS".
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from airflow_drl_executor.client import PlacementClient, PlacementUnavailable
from policy.bench import free_port
from policy.config import ConfigError, ServerConfig
from policy.schema import PlacementRequest, PoolState, ReadyTask, RunGraph, TaskNode
from policy.server import PolicyServer

PREFIX = "t"  # the conftest policy_server's
POOLS = (PoolState("small", "s", slots=2, cpus=4, memory_gb=16),
         PoolState("large", "l", slots=2, cpus=16, memory_gb=128, speed=2.0))


@dataclass
class TLSRedis:
    port: int
    password: str
    ca: Path

    def url(self, password: str | None = None) -> str:
        return f"rediss://placer:{password or self.password}@127.0.0.1:{self.port}/0"


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name | None,
          signer: ec.EllipticCurvePrivateKey, *, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(path: Path, obj: x509.Certificate | ec.EllipticCurvePrivateKey) -> Path:
    if isinstance(obj, x509.Certificate):
        path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    exe = shutil.which("redis-server")
    if exe is None:  # the harness installs it; say so loudly if it did not
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    folder = tmp_path_factory.mktemp("tls-redis")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("drl test CA", ca_key, None, ca_key, ca=True)
    server = _cert("localhost", key, ca.subject, ca_key, ca=False)
    ca_pem = _pem(folder / "ca.pem", ca)
    port, password = free_port(), secrets.token_hex(12)
    proc = subprocess.Popen(
        [exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(_pem(folder / "redis.pem", server)),
         "--tls-key-file", str(_pem(folder / "redis.key", key)), "--tls-ca-cert-file", str(ca_pem),
         "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(folder),
         "--daemonize", "no", "--loglevel", "warning",
         # least privilege: the deployment's keys only, no admin or dangerous commands
         "--user", "default", "off",
         "--user", "placer", "on", f">{password}", f"~{PREFIX}:*", "resetchannels", "+@all", "-@dangerous"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    srv = TLSRedis(port=port, password=password, ca=ca_pem)
    deadline = time.monotonic() + 10
    while True:
        if proc.poll() is not None:
            pytest.fail(f"redis-server with TLS exited with {proc.returncode} (built without TLS?)")
        try:
            redis.Redis.from_url(srv.url(), ssl_ca_certs=str(ca_pem)).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"redis-server with TLS did not answer on port {port} within 10 s")
            time.sleep(0.05)
    yield srv
    proc.terminate()
    proc.wait(5)


@pytest.fixture
def redis_url(tls_redis: TLSRedis) -> str:
    """The TLS Redis as the ACL user, for this module's ``policy_server`` (conftest.py)."""
    return tls_redis.url()


@pytest.fixture
def tls_server(tls_redis: TLSRedis, policy_server: Callable[..., PolicyServer]) -> PolicyServer:
    """A policy server (EFT placer) on the TLS Redis as the ACL user, in a thread."""
    server = policy_server(redis_ca_cert=str(tls_redis.ca), placer="eft")
    assert server.connected, "the policy server did not connect over TLS"
    return server


def _place(client: PlacementClient, rid: str) -> list[tuple[str, str, bool]]:
    g = RunGraph("d/r1", (TaskNode("a", duration_s=10), TaskNode("b", memory_gb=64)), ((0, 1),))
    reply = client.place(PlacementRequest(rid, (ReadyTask(g.run_key, "a"),), POOLS), {g.run_key: g})
    return [(d.task_id, d.pool, d.fallback) for d in reply.decisions]


def test_placements_round_trip_over_tls_as_an_acl_user(tls_redis: TLSRedis, tls_server: PolicyServer) -> None:
    client = PlacementClient(tls_redis.url(), prefix=PREFIX, ca_cert=str(tls_redis.ca), timeout_ms=2000)
    try:
        assert _place(client, "q-1") == [("a", "large", False)]  # the server's decision, not a fallback
        assert _place(client, "q-2") == [("a", "large", False)]  # the graph by reference, same connection
    finally:
        client.close()
    # the user really is confined to the prefix: what the server and client did needed nothing else
    r = redis.Redis.from_url(tls_redis.url(), ssl_ca_certs=str(tls_redis.ca))
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.set("elsewhere", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        r.flushall()
    assert r.hlen(f"{PREFIX}:servers:heartbeat") == 1
    r.close()


def test_an_unverifiable_server_or_a_wrong_password_is_a_fallback_reason(
        tls_redis: TLSRedis, tls_server: PolicyServer) -> None:
    # no CA given: the system's trust store does not know the private CA, so TLS refuses the server
    untrusted = PlacementClient(tls_redis.url(), prefix=PREFIX, timeout_ms=500)
    with pytest.raises(PlacementUnavailable, match="certificate verify failed"):
        _place(untrusted, "q-3")
    untrusted.close()
    wrong = PlacementClient(tls_redis.url(password="not-the-password"), prefix=PREFIX,
                            ca_cert=str(tls_redis.ca), timeout_ms=500)
    with pytest.raises(PlacementUnavailable, match="redis error: .*(password|WRONGPASS)"):
        _place(wrong, "q-4")
    wrong.close()
    # and the server, which was serving all along, still answers a client that is set up right
    good = PlacementClient(tls_redis.url(), prefix=PREFIX, ca_cert=str(tls_redis.ca), timeout_ms=2000)
    assert _place(good, "q-5") == [("a", "large", False)]
    good.close()


def test_the_server_refuses_a_ca_certificate_it_would_ignore(tls_redis: TLSRedis) -> None:
    with pytest.raises(ConfigError, match="redis_ca_cert: .*needs a rediss:// URL"):
        ServerConfig(redis_url=f"redis://127.0.0.1:{tls_redis.port}/0", redis_ca_cert=str(tls_redis.ca))
    with pytest.raises(ConfigError, match="redis_ca_cert: .*not a readable file"):
        ServerConfig(redis_url=tls_redis.url(), redis_ca_cert=str(tls_redis.ca) + ".missing")
