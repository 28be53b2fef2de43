"""``drl-policy bench``: round-trip latency and throughput of a policy server through a real Redis.

Drives the server exactly as the executor does: each client ``XADD``s a request to the stream and
``BLPOP``s its reply key; the first request of a DAG run carries the full graph, later ones a
:class:`~policy.schema.RunRef` (and the full graph again after an ``unknown_graph`` reply). With
``--redis`` it measures the server(s) already running there; without, it starts a private
``redis-server`` (loopback, random port, password) and a server process, measures, and stops them.

Cases: DAG runs of ``--dag-sizes`` tasks x ``--ready`` ready tasks per request x ``--clients``
concurrent clients. Prints a table and writes JSON (``cases[]`` with ``dag_tasks``,
``ready_tasks``, ``clients``, ``p50_ms``, ``p99_ms``, ``decisions_per_s``, ``device``, and the
server's own share, ``server_p50_ms`` and ``server_p99_ms``).

``--soak S`` instead runs one case for ``S`` seconds at ``--rate`` requests/s and reports the
server's RSS at the start, every ``--rss-every`` seconds and at the end. ``--new-run-every K``
makes each client start a new DAG run every ``K`` requests (a new ``run_key``, its full graph
sent once, as a scheduler's finished runs give way to new ones), so the server's per-run caches
fill to their bounds and evict instead of serving the same few runs throughout. The soak's JSON
also has ``timeline`` (the replies per second of each ``--rss-every`` interval: whether the rate
held to the end), ``replicas_cpu_s`` (the CPU seconds each replica had used at each sample) and
``redis`` (the private redis-server's RSS and CPU seconds at each sample).
Each client sends its next request when the last is answered (a closed loop, paced to its share
of ``--rate``), so ``--clients`` bounds the rate to ``clients / mean round trip``: give enough.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import redis

from policy.catalogue import Catalogue, load_catalogue
from policy.errors import CatalogueError
from policy.schema import (
    PlacementReply,
    PlacementRequest,
    ReadyTask,
    RunEntry,
    RunGraph,
    RunRef,
    TaskNode,
    dumps,
)
from policy.transport import DEFAULT_PREFIX, PAYLOAD_FIELD, STREAM_MAXLEN, Keys

log = logging.getLogger(__name__)

DEFAULT_CATALOGUE = Path(__file__).parent / "catalogues" / "demo.yaml"


# --- private processes -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class PrivateRedis:
    """A redis-server on loopback with a password, in a temporary folder."""

    port: int
    password: str
    proc: subprocess.Popen[bytes]
    folder: str

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_redis(port: int | None = None, password: str | None = None) -> PrivateRedis:
    """Start ``redis-server`` on 127.0.0.1 (no persistence); raises RuntimeError if it does not come up."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = port or free_port()
    password = password or secrets.token_hex(12)
    folder = tempfile.mkdtemp(prefix="drl-redis-")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
         "--save", "", "--appendonly", "no", "--dir", folder, "--daemonize", "no",
         "--loglevel", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    srv = PrivateRedis(port=port, password=password, proc=proc, folder=folder)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode} on port {port}")
            try:
                if srv.client().ping():
                    return srv
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {port} within 10 s")
    except BaseException:  # Ctrl-C while waiting too: no redis-server nor folder left (found by review)
        srv.stop()
        raise


def start_server(url: str, prefix: str, extra: list[str] | None = None,
                 log_path: str | None = None) -> subprocess.Popen[bytes]:
    """``drl-policy serve`` as a child process (stdout/stderr to ``log_path`` or discarded)."""
    cmd = [sys.executable, "-m", "policy.cli", "--log-level=WARNING", "serve", "--prefix", prefix, *(extra or [])]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - child owns it
    # the URL (and its password) in the child's environment, not its arguments, which any user of
    # the host reads (found by review)
    env = {**os.environ, "DRL_POLICY_REDIS_URL": url}
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def wait_for_server(r: redis.Redis, keys: Keys, count: int = 1, timeout_s: float = 30.0,
                    procs: Sequence[subprocess.Popen[bytes]] = ()) -> None:
    """Wait until ``count`` replicas have written a heartbeat; a process of ``procs`` (the private
    servers) that exits first ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if r.hlen(keys.heartbeat) >= count:
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"the policy server exited with status {dead[0].returncode} before it served")
        time.sleep(0.05)
    raise RuntimeError(f"no policy server heartbeat on {keys.heartbeat} within {timeout_s} s")


class ServerDidNotStart(RuntimeError):
    """A private server exited, or wrote no heartbeat in time, before the measurement began."""


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- workload ------------------------------------------------------------------------------------


def layered_dag(n_tasks: int, run_key: str, rng: np.random.Generator) -> RunGraph:
    """A layered random DAG: ~sqrt(n) layers, each task with 1-3 parents in the layer above."""
    widths = max(1, int(round(n_tasks ** 0.5)))
    tasks = tuple(
        TaskNode(task_id=f"t{i:05d}", duration_s=float(rng.lognormal(4.5, 0.8)),
                 cpus=float(rng.choice([1, 2, 4])), memory_gb=float(rng.choice([1, 2, 8])),
                 kind="gpu_train" if rng.random() < 0.1 else "default")
        for i in range(n_tasks)
    )
    edges: list[tuple[int, int]] = []
    for i in range(widths, n_tasks):
        layer_start = (i // widths - 1) * widths
        for p in set(rng.integers(layer_start, layer_start + widths, size=int(rng.integers(1, 4)))):
            edges.append((int(p), i))
    return RunGraph(run_key=run_key, tasks=tasks, edges=tuple(edges))


class Client:
    """The executor's side of the protocol: XADD a request, BLPOP the reply."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self.sent: set[tuple[str, str]] = set()

    def ask(self, graphs: list[RunGraph], ready: list[ReadyTask], pools: Catalogue,
            deadline_ms: float = 1000.0) -> PlacementReply:
        runs: list[RunEntry] = [
            RunRef(g.run_key, g.digest) if (g.run_key, g.digest) in self.sent else g for g in graphs
        ]
        reply = self._roundtrip(runs, ready, pools, deadline_ms)
        if reply.error_code == "unknown_graph":
            reply = self._roundtrip(list(graphs), ready, pools, deadline_ms)
        if reply.ok:
            self.sent.update((g.run_key, g.digest) for g in graphs)
        return reply

    def _roundtrip(self, runs: list[RunEntry], ready: list[ReadyTask], pools: Catalogue,
                   deadline_ms: float) -> PlacementReply:
        req = PlacementRequest(request_id=uuid.uuid4().hex, ready=tuple(ready), pools=pools.states(),
                               runs=tuple(runs), created_at=time.time(), deadline_ms=deadline_ms)
        self.r.xadd(self.keys.requests, {PAYLOAD_FIELD: dumps(req)}, maxlen=STREAM_MAXLEN,
                    approximate=True)
        got: Any = self.r.blpop([self.keys.reply(req.request_id)], timeout=deadline_ms / 1000)
        if got is None:
            raise TimeoutError(f"no reply to {req.request_id} within {deadline_ms} ms")
        return PlacementReply.from_json(json.loads(got[1]))


# --- measurement ---------------------------------------------------------------------------------


@dataclass
class CaseResult:
    dag_tasks: int
    ready_tasks: int
    clients: int
    requests: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    decisions_per_s: float
    errors: int
    device: str
    #: the server's own share of each round trip (``PlacementReply.server_ms``: from reading the
    #: batch to its decisions), so a round trip splits into the server and the rest (Redis, the
    #: client's JSON, the operating system's scheduling)
    server_p50_ms: float = float("nan")
    server_p99_ms: float = float("nan")
    #: the slowest round trip (a pause of the server, e.g. a garbage collection, shows here first)
    max_ms: float = float("nan")
    #: DAG runs the clients asked about (one each, more with ``new_run_every``)
    runs: int = 0
    #: with ``timeline_every_s``: ``[[seconds since the start, good replies per second in the
    #: interval that ends there], ...]``, so a soak shows whether its rate held to the end
    timeline: list[list[float]] = field(default_factory=list)


@dataclass(frozen=True)
class _Load:
    """What each client of a case does (picklable: client processes get it too)."""

    url: str
    keys: Keys
    catalogue: Catalogue
    ready_tasks: int
    duration_s: float
    seed: int
    rate_per_client: float | None
    deadline_ms: float
    #: start a new DAG run (same shape, new run_key) every this many requests; 0: never
    new_run_every: int = 0


#: one client's ``(round-trip seconds of the good replies, their server_ms, errors, runs asked about,
#: when each good reply came: time.perf_counter(), one clock for every process on Linux, decisions
#: the good replies carried)``
_ClientResult = tuple[list[float], list[float], int, int, list[float], int]


def _client(load: _Load, c: int, g: RunGraph, start: Any) -> _ClientResult:
    """One client's loop (see :data:`_ClientResult`)."""
    lat: list[float] = []
    server: list[float] = []
    done: list[float] = []
    errors = decided = 0
    r = redis.Redis.from_url(load.url)
    cl = Client(r, load.keys)
    local = np.random.default_rng(load.seed * 1000 + c)
    try:
        # the first request carries the full graph: give it time, it is not measured
        cl.ask([g], [ReadyTask(g.run_key, g.tasks[0].task_id)], load.catalogue, deadline_ms=30_000)
    except Exception:  # noqa: BLE001 - counted; the client still joins the start (found by review: a
        errors += 1  # ConnectionError here ended the thread before the barrier, the bench hung)
    start.wait()
    period = 1.0 / load.rate_per_client if load.rate_per_client else 0.0
    next_t = time.perf_counter()
    end = next_t + load.duration_s
    base, asked_n, runs = g, 0, 1
    while time.perf_counter() < end:
        if load.new_run_every and asked_n and asked_n % load.new_run_every == 0:
            # a new run of the same shape: the server sees a new run_key and gets its full graph
            g = RunGraph(run_key=f"{base.run_key}/{runs}", tasks=base.tasks, edges=base.edges,
                         digest=base.digest)
            runs += 1
        asked_n += 1
        picks = local.choice(len(g.tasks), size=min(load.ready_tasks, len(g.tasks)), replace=False)
        ready = [ReadyTask(g.run_key, g.tasks[int(i)].task_id) for i in picks]
        t0 = time.perf_counter()
        try:
            reply = cl.ask([g], ready, load.catalogue, deadline_ms=load.deadline_ms)
            # Fewer decisions than ready tasks is fine: the policy holds the rest (late binding).
            asked = {t.task_id for t in ready}
            if not reply.ok or not all(d.task_id in asked for d in reply.decisions):
                errors += 1
            else:
                t1 = time.perf_counter()
                lat.append(t1 - t0)
                server.append(reply.server_ms)
                done.append(t1)
                decided += len(reply.decisions)
        except TimeoutError:
            errors += 1
            cl.sent.clear()  # the server may not have the graph: resend it next time
        except Exception:  # noqa: BLE001 - a broken connection: counted (found by review: the thread
            errors += 1  # ended, its requests and errors lost, and the case read as clean)
            cl.sent.clear()
            time.sleep(0.01)
        if period:
            next_t += period
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
    r.close()
    return lat, server, errors, runs, done, decided


def _clients(load: _Load, ids: list[int], graphs: list[RunGraph], start: Any,
             results: Any = None) -> list[_ClientResult]:
    """Clients ``ids`` as threads of this process; their results, also put on ``results``."""
    out: list[_ClientResult] = [([], [], 0, 0, [], 0)] * len(ids)

    def run(j: int) -> None:
        out[j] = _client(load, ids[j], graphs[j], start)

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if results is not None:
        results.put(out)
    return out


def run_case(url: str, keys: Keys, catalogue: Catalogue, dag_tasks: int, ready_tasks: int,
             clients: int, duration_s: float, seed: int, device: str,
             rate_per_client: float | None = None, deadline_ms: float = 1000.0,
             procs: int = 1, new_run_every: int = 0,
             timeline_every_s: float | None = None) -> CaseResult:
    """One case; with ``procs > 1`` the clients run as threads of that many processes (one
    process's threads share its GIL, which caps the load they can offer)."""
    rng = np.random.default_rng(seed)
    # Warm up: every client's graph is sent (and cached server-side) before timing starts.
    graphs = [layered_dag(dag_tasks, f"bench/{dag_tasks}/{seed}/{c}", rng) for c in range(clients)]
    load = _Load(url, keys, catalogue, ready_tasks, duration_s, seed, rate_per_client, deadline_ms,
                 new_run_every)
    procs = max(1, min(procs, clients))
    groups = [list(range(clients))[i::procs] for i in range(procs)]
    if procs == 1:
        start: Any = threading.Barrier(clients + 1)
        res: list[list[_ClientResult]] = []
        main = threading.Thread(target=lambda: res.append(_clients(load, groups[0], graphs, start)),
                                daemon=True)
        main.start()
        start.wait()
        t0 = time.perf_counter()
        main.join()
    else:
        ctx = multiprocessing.get_context("spawn")
        start = ctx.Barrier(clients + 1)
        queue = ctx.Queue()
        children = [ctx.Process(target=_clients, args=(load, ids, [graphs[c] for c in ids], start, queue),
                                daemon=True) for ids in groups]
        for ch in children:
            ch.start()
        start.wait()
        t0 = time.perf_counter()
        res = [queue.get() for _ in children]
        for ch in children:
            ch.join()
    wall = time.perf_counter() - t0
    results = [r for group in res for r in group]
    all_ms = np.array([x for xs, *_ in results for x in xs]) * 1e3
    server_ms = np.array([x for _, xs, *_ in results for x in xs])
    n = len(all_ms)

    def pct(a: np.ndarray, q: float) -> float:
        return round(float(np.percentile(a, q)), 3) if len(a) else float("nan")

    return CaseResult(
        dag_tasks=dag_tasks, ready_tasks=ready_tasks, clients=clients, requests=n,
        p50_ms=pct(all_ms, 50), p99_ms=pct(all_ms, 99),
        mean_ms=round(float(all_ms.mean()), 3) if n else float("nan"),
        # the decisions the good replies carried (found by review: requests x ready_tasks counted
        # the tasks a policy held and, past a DAG's size, tasks never sent)
        decisions_per_s=round(sum(r[5] for r in results) / wall, 1), errors=sum(r[2] for r in results),
        runs=sum(r[3] for r in results),
        device=device, server_p50_ms=pct(server_ms, 50), server_p99_ms=pct(server_ms, 99),
        max_ms=round(float(all_ms.max()), 3) if n else float("nan"),
        timeline=_timeline([t for r in results for t in r[4]], t0, duration_s, timeline_every_s),
    )


def _timeline(done: Sequence[float], t0: float, duration_s: float,
              every_s: float | None) -> list[list[float]]:
    """``[[end of the interval, replies per second in it], ...]`` over ``duration_s`` from ``t0``
    in steps of ``every_s`` (the last may be shorter); none without ``every_s``."""
    if not every_s or every_s <= 0 or duration_s <= 0:
        return []
    ends = [min(every_s * (i + 1), duration_s) for i in range(math.ceil(duration_s / every_s - 1e-9))]
    # a reply to a request sent before the end may come after it: it counts in the last interval
    at = np.clip(np.asarray(done, dtype=float) - t0, 0.0, duration_s)
    counts = np.histogram(at, bins=[0.0, *ends])[0]
    return [[round(end, 3), round(int(k) / (end - start), 1)]
            for start, end, k in zip([0.0, *ends[:-1]], ends, counts, strict=True)]


def _server_device(r: redis.Redis, keys: Keys) -> str:
    beats = r.hgetall(keys.heartbeat)
    devices = sorted({json.loads(v).get("device", "?") for v in beats.values()})
    return ",".join(devices) or "?"


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used; -1 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1.0
    # after the command's ")": state is field 3 of proc(5), utime and stime fields 14 and 15
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


class _RssSampler:
    """Samples the RSS (KiB) of server processes every ``every_s`` seconds while in its ``with``
    block: ``samples`` is ``[[seconds since the start, KiB of the first], ...]`` and ``each``
    ``[[seconds, KiB of each], ...]``, first at the start, last at the end (empty without pids: a
    server not started by the bench); ``cpu`` ``[[seconds, CPU seconds each has used], ...]`` at
    the same times; ``redis`` ``[[seconds, KiB, CPU seconds], ...]`` of the private redis-server."""

    def __init__(self, pids: Sequence[int], every_s: float, redis_pid: int | None = None) -> None:
        self.pids, self.every_s, self.redis_pid = list(pids), max(every_s, 0.1), redis_pid
        self.redis: list[list[float]] = []
        self.samples: list[list[float]] = []
        self.each: list[list[float]] = []
        self.cpu: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        if self.pids:
            at = round(time.monotonic() - self._t0, 1)
            kib = [_rss_kib(pid) for pid in self.pids]
            self.samples.append([at, kib[0]])
            self.each.append([at, *kib])
            self.cpu.append([at, *(_cpu_s(pid) for pid in self.pids)])
            if self.redis_pid is not None:
                self.redis.append([at, _rss_kib(self.redis_pid), _cpu_s(self.redis_pid)])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> _RssSampler:
        self._t0 = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@contextlib.contextmanager
def _stack(args: argparse.Namespace, keys: Keys) -> Iterator[tuple[str, list[int], int | None]]:
    """Yield (redis url, the servers' pids, redis-server's pid; no pids with --redis): private
    processes unless --redis is given."""
    if args.redis:
        yield args.redis, [], None
        return
    rs = start_redis()
    servers: list[subprocess.Popen[bytes]] = []
    scratch = tempfile.mkdtemp(prefix="drlbench-")
    # the servers' output: kept only to say why one did not start (or where --server-log says)
    log_path = Path(args.server_log or Path(scratch) / "server.log")
    try:
        extra = ["--placer", args.placer, "--batch-max", str(args.batch_max), "--device", args.device,
                 "--batch-wait-ms", str(args.batch_wait_ms)]
        if args.registry:
            extra += ["--registry", args.registry]
        for i in range(args.replicas):
            servers.append(start_server(rs.url, keys.prefix, [*extra, "--consumer", f"bench-{i}"],
                                        log_path=str(log_path)))
        # replicas load torch and the model at the same time: give each some start-up time
        try:
            wait_for_server(rs.client(), keys, count=args.replicas, timeout_s=30.0 + 15.0 * args.replicas,
                            procs=servers)
        except RuntimeError as exc:
            raise ServerDidNotStart(f"{exc}; the end of its log:\n{_tail(log_path)}") from None
        yield rs.url, [server.pid for server in servers], rs.proc.pid
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
        for server in servers:
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                server.kill()
        rs.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def _int_list(lo: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated list of integers >= ``lo``."""
    one = _int_at_least(lo)

    def convert(text: str) -> list[int]:
        try:
            values = [one(item) for item in (x.strip() for x in text.split(",")) if item]
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (in {text!r})") from None
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
        return values

    return convert


def _int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo``."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {lo}")
        return value

    return convert


def _seconds(*, zero_ok: bool) -> Callable[[str], float]:
    """An argparse type: a finite number > 0 (``>= 0`` with ``zero_ok``): a NaN or infinite
    duration or rate made every case print rows of NaN instead of failing."""
    bound = ">= 0" if zero_ok else "> 0"

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
        return value

    return convert


def _catalogue(text: str) -> Catalogue:
    """An argparse type: the catalogue at ``text``, loaded and validated."""
    try:
        return load_catalogue(text)
    except CatalogueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", default=None,
                        help="URL of a Redis with running server(s); default: start private ones")
    parser.add_argument("--prefix", default=None,
                        help="key prefix (default: the servers' with --redis, a fresh one for a private stack)")
    parser.add_argument("--catalogue", type=_catalogue, default=str(DEFAULT_CATALOGUE), help="pool catalogue YAML")
    parser.add_argument("--placer", default="eft", help="placer of the private server (eft, auto, gnn)")
    parser.add_argument("--registry", default=None, help="model registry of the private server")
    parser.add_argument("--batch-max", type=_int_at_least(1), default=64, help="batch_max of the private server")
    parser.add_argument("--batch-wait-ms", type=_int_at_least(0), default=0,
                        help="batch_wait_ms of the private server")
    parser.add_argument("--device", default="auto", help="device of the private server (auto, cpu, cuda)")
    parser.add_argument("--replicas", type=_int_at_least(1), default=1,
                        help="private server replicas sharing the consumer group (one process each)")
    parser.add_argument("--dag-sizes", type=_int_list(1), default="50,200,1000", help="comma-separated DAG sizes")
    parser.add_argument("--ready", type=_int_list(1), default="1,16,64",
                        help="comma-separated ready tasks per request")
    parser.add_argument("--clients", type=_int_list(1), default="1,8", help="comma-separated concurrent clients")
    parser.add_argument("--duration", type=_seconds(zero_ok=False), default=3.0, help="seconds per case")
    parser.add_argument("--client-procs", type=_int_at_least(1), default=1,
                        help="run the clients as threads of this many processes (default: 1)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--soak", type=_seconds(zero_ok=True), default=0.0,
                        help="instead of the cases: run one case this many seconds, report server RSS")
    parser.add_argument("--rate", type=_seconds(zero_ok=False), default=1000.0,
                        help="soak: total requests per second")
    parser.add_argument("--rss-every", type=_seconds(zero_ok=False), default=10.0,
                        help="soak: seconds between samples of the server's RSS")
    parser.add_argument("--new-run-every", type=_int_at_least(0), default=0,
                        help="each client starts a new DAG run every this many requests (0: never)")
    parser.add_argument("--out", default="bench-server.json", help="JSON output file")
    parser.add_argument("--server-log", default=None, help="append the private server's log here")


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    # SIGTERM unwinds as Ctrl-C does, so the private stack is stopped (found by review: a kill left
    # the policy server and redis-server running, orphaned)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        return _run(args)
    except ServerDidNotStart as exc:
        print(f"drl-policy bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # the private stack is stopped by then
        print(f"drl-policy bench: interrupted ({exc or 'Ctrl-C'}); nothing written", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    # with --redis, the running servers' prefix (found by review: a fresh drlbench<pid> there
    # waited 30 s for heartbeats no server writes)
    keys = Keys(args.prefix or (DEFAULT_PREFIX if args.redis else f"drlbench{os.getpid()}"))
    catalogue: Catalogue = args.catalogue  # loaded and validated by the parser
    doc: dict[str, Any] = {"command": " ".join(sys.argv), "host": socket.gethostname(),
                           "cpus": os.cpu_count(), "replicas": None if args.redis else args.replicas,
                           "client_procs": args.client_procs,
                           "cases": []}
    with _stack(args, keys) as (url, pids, redis_pid):
        r = redis.Redis.from_url(url)
        wait_for_server(r, keys, count=1 if args.redis else args.replicas)
        device = _server_device(r, keys)
        if args.soak > 0:
            clients = max(args.clients)
            with _RssSampler(pids, args.rss_every, redis_pid) as rss:
                res = run_case(url, keys, catalogue, args.dag_sizes[0], args.ready[0],
                               clients, args.soak, args.seed, device, rate_per_client=args.rate / clients,
                               procs=args.client_procs, new_run_every=args.new_run_every,
                               timeline_every_s=args.rss_every)
            doc["soak"] = {**asdict(res), "seconds": args.soak, "target_rate": args.rate,
                           "achieved_rate": round(res.requests / args.soak, 1),
                           "new_run_every": args.new_run_every,
                           "server_rss_kib_start": rss.samples[0][1] if rss.samples else -1,
                           "server_rss_kib_end": rss.samples[-1][1] if rss.samples else -1,
                           "server_rss_kib": rss.samples,
                           # every replica's, [seconds, KiB of replica 0, 1, ...] (was: the first only)
                           "replicas_rss_kib": rss.each,
                           # [seconds, CPU seconds replica 0, 1, ... has used]: the cores they took
                           "replicas_cpu_s": rss.cpu,
                           # [seconds, RSS KiB, CPU seconds] of the private redis-server (none with --redis)
                           "redis": rss.redis}
            print(json.dumps(doc["soak"], indent=2))
        else:
            print(f"{'dag':>5} {'ready':>5} {'cli':>3} {'reqs':>7} {'p50 ms':>8} {'p99 ms':>8}"
                  f" {'srv p50':>8} {'srv p99':>8} {'decisions/s':>12} {'err':>4}  device")
            for dag in args.dag_sizes:
                for ready in args.ready:
                    for clients in args.clients:
                        res = run_case(url, keys, catalogue, dag, ready, clients, args.duration,
                                       args.seed, device, procs=args.client_procs)
                        doc["cases"].append(asdict(res))
                        print(f"{dag:>5} {ready:>5} {clients:>3} {res.requests:>7} {res.p50_ms:>8.3f}"
                              f" {res.p99_ms:>8.3f} {res.server_p50_ms:>8.3f} {res.server_p99_ms:>8.3f}"
                              f" {res.decisions_per_s:>12.0f} {res.errors:>4}  {device}",
                              flush=True)
        r.close()
    # null for a figure no good reply gave (found by review: bare NaN is not JSON, jq refused the file)
    Path(args.out).write_text(json.dumps(_no_nan(doc), indent=2, allow_nan=False) + "\n")
    print(f"wrote {args.out}")
    return 0
