"""The local stack: PostgreSQL, Redis, the policy server, Celery workers and Airflow, on loopback.

    python scripts/localstack.py up        # start (or complete) the stack; safe to re-run
    python scripts/localstack.py status    # what runs, where
    python scripts/localstack.py down      # stop everything (data stays in the state folder)
    python scripts/localstack.py stop SERVICE / start SERVICE   # one service (e.g. policy-server)
    python scripts/localstack.py env       # shell exports to talk to the stack

Everything lives in one state folder (``DRL_STACK_DIR``, default ``.stack`` in the repo): the
database cluster, Airflow's home, secrets, pid files and ``logs/``, one log per service. Ports
come from ``DRL_PG_PORT``, ``DRL_REDIS_PORT``, ``DRL_API_PORT``, ``DRL_METRICS_PORT`` and
``DRL_WORKER_LOG_PORT`` (the first of three consecutive ports); with ``DRL_STATSD_PORT`` set,
Airflow's metrics (the executor's ``drl_executor.*`` among them) go to a StatsD daemon on that
UDP port of 127.0.0.1. PostgreSQL runs as the
``postgres`` system user (initdb refuses root); every service listens on 127.0.0.1 only, and
Redis and PostgreSQL require passwords generated at first start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
PG_BIN_CANDIDATES = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


class StackError(RuntimeError):
    """A service could not be started; the message names it and its log."""


@dataclass(frozen=True)
class Ports:
    pg: int
    redis: int
    api: int
    metrics: int
    worker_logs: int
    #: UDP port of a StatsD daemon on 127.0.0.1 that Airflow's metrics go to; 0: metrics off
    statsd: int = 0

    @classmethod
    def from_env(cls) -> Ports:
        return cls(
            pg=int(os.environ.get("DRL_PG_PORT", "55432")),
            redis=int(os.environ.get("DRL_REDIS_PORT", "56379")),
            api=int(os.environ.get("DRL_API_PORT", "28080")),
            metrics=int(os.environ.get("DRL_METRICS_PORT", "29100")),
            worker_logs=int(os.environ.get("DRL_WORKER_LOG_PORT", "28793")),
            statsd=int(os.environ.get("DRL_STATSD_PORT", "0")),
        )


#: The demo's worker pools: (queue, Celery concurrency); must match policy/catalogues/demo.yaml.
POOLS = (("cpu-small", 4), ("cpu-large", 2), ("gpu", 2))
#: a policy server heartbeat at most this old is a live server (they beat every 2 s)
_FRESH_HEARTBEAT_S = 10.0


class Stack:
    def __init__(self, state: Path, ports: Ports, catalogue: Path) -> None:
        self.state = state
        self.ports = ports
        self.catalogue = catalogue
        self.logs = state / "logs"
        self.pids = state / "pids"
        self.home = state / "airflow"
        #: each service's log size when this process spawned it (:meth:`new_log`)
        self.log_start: dict[str, int] = {}

    # --- secrets and environment ---------------------------------------------------------------

    def secret(self, name: str) -> str:
        path = self.state / "secrets" / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.parent.chmod(0o700)
            path.write_text(secrets.token_urlsafe(24))
            path.chmod(0o600)
        return path.read_text().strip()

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.secret('redis')}@127.0.0.1:{self.ports.redis}"

    @property
    def sql_conn(self) -> str:
        return f"postgresql+psycopg2://airflow:{self.secret('postgres')}@127.0.0.1:{self.ports.pg}/airflow"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.api}"

    def airflow_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
        passwords = self.home / "passwords.json"
        self.home.mkdir(parents=True, exist_ok=True)
        if not passwords.exists():
            passwords.write_text(json.dumps({"admin": self.secret("admin")}))
            passwords.chmod(0o600)
        env.update({
            "AIRFLOW_HOME": str(self.home),
            "PATH": f"{VENV_BIN}:{env.get('PATH', '')}",
            "AIRFLOW__CORE__EXECUTOR": "DRLExecutor:airflow_drl_executor.DRLExecutor",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.api_url}/execution/",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__CORE__PARALLELISM": "32",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.sql_conn,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.ports.api),
            "AIRFLOW__API__BASE_URL": self.api_url,
            "AIRFLOW__API__SECRET_KEY": self.secret("api"),
            "AIRFLOW__API_AUTH__JWT_SECRET": self.secret("jwt"),
            "AIRFLOW__CELERY__BROKER_URL": f"{self.redis_url}/1",
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + self.sql_conn.replace("+psycopg2", ""),
            "AIRFLOW__CELERY__SYNC_PARALLELISM": "1",
            "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT": "21600",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "600",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "30",
            "AIRFLOW__DRL_EXECUTOR__REDIS_URL": f"{self.redis_url}/0",
            "AIRFLOW__DRL_EXECUTOR__CATALOGUE": str(self.catalogue),
            # a pool whose worker died is marked down within ~5 s (default 30 s)
            "AIRFLOW__DRL_EXECUTOR__POOL_CHECK_INTERVAL_S": "5",
            "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(self.state / "task-logs"),
            # the nightly retraining DAG: where traces are read from and models promoted to
            "AIRFLOW_CONN_DRL_TRACES": self.sql_conn.replace("postgresql+psycopg2://", "postgresql://"),
            "DRL_REGISTRY_DIR": str(self.state / "registry"),
            "DRL_TRACES_DIR": str(self.state / "traces"),
        })
        if self.ports.statsd:
            env.update({"AIRFLOW__METRICS__STATSD_ON": "True", "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
                        "AIRFLOW__METRICS__STATSD_PORT": str(self.ports.statsd)})
        return env

    # --- process bookkeeping --------------------------------------------------------------------

    def _recorded(self, name: str) -> tuple[int, str | None] | None:
        """The pid (= its process group: each service runs in a session of its own) and start
        time its pid file records; None without a readable one."""
        try:
            fields = (self.pids / f"{name}.pid").read_text().split()
            return int(fields[0]), (fields[1] if len(fields) > 1 else None)
        except (OSError, ValueError, IndexError):
            return None

    def pid(self, name: str) -> int | None:
        """The service's live main process: the pid its file records, still the process it
        started (found by review: after a reboot, a pid file named whatever program had that
        number since, which ``down`` killed with its whole group)."""
        rec = self._recorded(name)
        if rec is None or not _alive(rec[0]):
            return None
        pid, started = rec
        return pid if started is None or _start_time(pid) in (started, None) else None

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        if self.pid(name):
            return
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pids.mkdir(parents=True, exist_ok=True)
        path = self.logs / f"{name}.log"
        # what this process writes starts here (the log is kept across runs: found by review, a
        # worker was taken for ready from the previous run's "ready." line)
        self.log_start[name] = path.stat().st_size if path.exists() else 0
        log = open(path, "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True, stdin=subprocess.DEVNULL)
        (self.pids / f"{name}.pid").write_text(f"{proc.pid} {_start_time(proc.pid) or ''}".strip())

    def new_log(self, name: str) -> bytes:
        """What the service's process has written to its log since :meth:`spawn` started it."""
        data = _read(self.logs / f"{name}.log")
        return data[self.log_start.get(name, 0):]

    def kill(self, name: str, timeout: float = 20.0) -> None:
        """Stop the service's whole process group: SIGTERM, then SIGKILL to whatever of it is left
        after ``timeout`` (found by review: only the main process was waited for and, once dead,
        its pool processes and tasks were left running with no pid file to find them by)."""
        rec = self._recorded(name)
        pgid = rec[0] if rec is not None else None
        if pgid is not None and _alive(pgid) and self.pid(name) is None:
            pgid = None  # the number is another program's now: not ours to signal
        if pgid is not None and _group_alive(pgid):
            try:
                os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            end = time.monotonic() + timeout
            while time.monotonic() < end and _group_alive(pgid):
                time.sleep(0.2)
            if _group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        (self.pids / f"{name}.pid").unlink(missing_ok=True)

    def wait(self, name: str, check: Callable[[], bool], timeout: float) -> None:
        end = time.monotonic() + timeout
        pid_file = self.pids / f"{name}.pid"
        while time.monotonic() < end:
            # the process first: a port can answer for another (found by review: a scheduler that
            # exited at start passed on the health of the one killed before it)
            if pid_file.exists() and self.pid(name) is None:
                raise StackError(f"{name} exited at start; see {self.logs / (name + '.log')}:\n"
                                 + _tail(self.logs / f"{name}.log"))
            if check():
                return
            time.sleep(0.5)
        raise StackError(f"{name} not healthy after {timeout:.0f}s; see {self.logs / (name + '.log')}:\n"
                         + _tail(self.logs / f"{name}.log"))

    # --- services -------------------------------------------------------------------------------

    def pg_bin(self, tool: str) -> str:
        for d in PG_BIN_CANDIDATES:
            if (d / tool).exists():
                return str(d / tool)
        found = shutil.which(tool)
        if not found:
            raise StackError(f"PostgreSQL's {tool} not found: install the Debian package 'postgresql'")
        return found

    @property
    def pg_home(self) -> Path:
        """Where PostgreSQL's data, socket folder (and, when moved, its log) live: the stack's
        folder when the ``postgres`` user can reach it; else (a checkout inside a private folder,
        e.g. ``mktemp -d``'s) a folder of the ``postgres`` user under the system's temp folder,
        named after the stack's path and recorded in ``<state>/pg_home`` (a stack started afresh
        at that path, without the record, starts that folder afresh too)."""
        if _user_exists("postgres"):
            pw = pwd.getpwnam("postgres")
            if not _traversable_by(pw.pw_uid, pw.pw_gid, self.state):
                digest = hashlib.sha1(str(self.state.resolve()).encode()).hexdigest()[:12]
                return Path(tempfile.gettempdir()) / f"drl-pg-{digest}"
        return self.state

    def start_postgres(self) -> None:
        home = self.pg_home
        data = home / "pgdata"
        run_dir = home / "pgrun"
        user = "postgres" if _user_exists("postgres") else None
        if user is None:
            raise StackError("system user 'postgres' missing: install the Debian package 'postgresql'")
        if os.geteuid() != 0:  # (found by review: a PermissionError traceback from chown)
            raise StackError("the local stack runs PostgreSQL as the system user 'postgres' (chown, runuser): "
                             "run make demo / make test as root, as CI does")
        pw = pwd.getpwnam(user)
        for d in (self.state, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        if home != self.state:
            marker = self.state / "pg_home"
            if not marker.exists():  # a folder left by an earlier stack at this path: other secrets
                shutil.rmtree(home, ignore_errors=True)
            home.mkdir(mode=0o700, exist_ok=True)
            os.chown(home, pw.pw_uid, pw.pw_gid)
            marker.write_text(str(home) + "\n")
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chown(run_dir, pw.pw_uid, pw.pw_gid)
        pg_log = (self.logs if home == self.state else home) / "postgres.log"
        pg_log.touch()
        os.chown(pg_log, pw.pw_uid, pw.pw_gid)
        if not (data / "PG_VERSION").exists():
            data.mkdir(parents=True, exist_ok=True)
            os.chown(data, pw.pw_uid, pw.pw_gid)
            # a new cluster has no airflow database: migrate it whatever the marker says (found by
            # review: after a reboot emptied /tmp, the marker skipped the migration of a new cluster)
            (self.state / "migrated").unlink(missing_ok=True)
            pwfile = run_dir / "pwfile"
            pwfile.unlink(missing_ok=True)
            # readable by its owner only, and gone whatever initdb does (found by review: 0644, and
            # left on disk when initdb failed)
            fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(self.secret("postgres") + "\n")
                os.chown(pwfile, pw.pw_uid, pw.pw_gid)
                _run(["runuser", "-u", user, "--", self.pg_bin("initdb"), "-D", str(data), "-U", "airflow",
                      "--pwfile", str(pwfile), "--auth-local=scram-sha-256", "--auth-host=scram-sha-256",
                      "-E", "UTF8"], "initdb")
            finally:
                pwfile.unlink(missing_ok=True)
        if not self._pg_ready():
            # pg_ctl hands -o to /bin/sh: a folder with a space must be quoted (found by review)
            opts = (f"-p {self.ports.pg} -k {shlex.quote(str(run_dir))} -c listen_addresses=127.0.0.1"
                    " -c max_connections=200")
            _run(["runuser", "-u", user, "--", self.pg_bin("pg_ctl"), "-D", str(data), "-l", str(pg_log),
                  "-o", opts, "-w", "-t", "60", "start"], "pg_ctl start")
        env = {**os.environ, "PGPASSWORD": self.secret("postgres")}
        exists = subprocess.run(
            [self.pg_bin("psql"), "-h", "127.0.0.1", "-p", str(self.ports.pg), "-U", "airflow", "-d", "postgres",
             "-tAc", "SELECT 1 FROM pg_database WHERE datname='airflow'"],
            env=env, capture_output=True, text=True, check=False)
        if exists.returncode != 0:
            raise StackError(f"psql cannot reach PostgreSQL: {exists.stderr.strip()}")
        if exists.stdout.strip() != "1":
            (self.state / "migrated").unlink(missing_ok=True)  # a new database: migrate it
            _run([self.pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.ports.pg), "-U", "airflow",
                  "airflow"], "createdb", env=env)

    def _pg_ready(self) -> bool:
        return subprocess.run([self.pg_bin("pg_isready"), "-h", "127.0.0.1", "-p", str(self.ports.pg)],
                              capture_output=True, check=False).returncode == 0

    def stop_postgres(self) -> None:
        data = self.pg_home / "pgdata"
        if (data / "postmaster.pid").exists():
            done = subprocess.run(["runuser", "-u", "postgres", "--", self.pg_bin("pg_ctl"), "-D", str(data),
                                   "-m", "fast", "-w", "stop"], capture_output=True, text=True, check=False)
            # a stale postmaster.pid of a dead server fails too: an error only if it still answers
            # (found by review: "[stack] down" with PostgreSQL running, and make clean deleting its data)
            if done.returncode != 0 and self._pg_ready():
                raise StackError(f"PostgreSQL did not stop (pg_ctl: {(done.stderr or done.stdout).strip()})")

    def start_redis(self) -> None:
        if self.pid("redis"):
            return
        server = shutil.which("redis-server")
        if not server:
            raise StackError("redis-server not found: install the Debian package 'redis-server'")
        (self.state / "redis").mkdir(parents=True, exist_ok=True)
        conf = self.state / "redis" / "redis.conf"
        conf.write_text(
            f"port {self.ports.redis}\nbind 127.0.0.1\nprotected-mode yes\n"
            f"requirepass {self.secret('redis')}\ndir {_redis_quote(str(self.state / 'redis'))}\n"
            'save ""\nappendonly no\n'
        )
        conf.chmod(0o600)
        self.spawn("redis", [server, str(conf)], dict(os.environ))
        self.wait("redis", self._redis_ping, 20)

    def _redis_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.ports.redis), timeout=1) as s:
                s.sendall(f"AUTH {self.secret('redis')}\r\nPING\r\n".encode())
                time.sleep(0.05)
                return b"PONG" in s.recv(256)
        except OSError:
            return False

    def registry(self) -> Path:
        """The model registry folder (the server names the packaged default checkpoint in it at
        first start, see ``policy.registry.ensure_active``)."""
        root = self.state / "registry"
        root.mkdir(parents=True, exist_ok=True)
        return root

    def start_policy_server(self) -> None:
        # the URL (with its password) in the environment, not the arguments any user can read (ps)
        env = {**self.airflow_env(), "DRL_POLICY_REDIS_URL": f"{self.redis_url}/0"}
        argv = [str(VENV_BIN / "drl-policy"), "serve", "--prefix", "drl",
                "--catalogue", str(self.catalogue), "--metrics-port", str(self.ports.metrics),
                "--placer", "auto", "--registry", str(self.registry())]
        self.spawn("policy-server", argv, env)
        self.wait("policy-server", self._policy_alive, 60)

    def _policy_alive(self) -> bool:
        """The server has written a fresh heartbeat to Redis (what the executor checks too)."""
        import redis

        from policy.transport import Keys, heartbeat_age

        try:
            r = redis.Redis.from_url(f"{self.redis_url}/0", socket_timeout=1)
            beats: dict[bytes, bytes] = r.hgetall(Keys().heartbeat)
            secs, micros = r.time()
        except redis.RedisError:
            return False
        # fresh: a replica killed -9 leaves its heartbeat until another prunes it (found by review)
        now = float(secs) + float(micros) / 1e6
        return any(heartbeat_age(v, now) <= _FRESH_HEARTBEAT_S for v in beats.values())

    def migrate(self) -> None:
        marker = self.state / "migrated"
        if marker.exists() and marker.read_text() == _airflow_version():
            return
        _run([str(VENV_BIN / "airflow"), "db", "migrate"], "airflow db migrate", env=self.airflow_env(),
             log=self.logs / "migrate.log")
        marker.write_text(_airflow_version())

    def start_airflow(self) -> None:
        env = self.airflow_env()
        airflow = str(VENV_BIN / "airflow")
        self.spawn("api-server", [airflow, "api-server", "--port", str(self.ports.api), "--host", "127.0.0.1"], env)
        self.spawn("scheduler", [airflow, "scheduler"], env)
        self.spawn("dag-processor", [airflow, "dag-processor"], env)
        # deferrable operators wait in the triggerer (without one they stay deferred for ever).
        # No log servers (found by review: Airflow binds them on every interface, the triggerer's
        # on the fixed 8794 that a second stack cannot bind; on one host the api-server reads the
        # log files from the shared folder)
        self.spawn("triggerer", [airflow, "triggerer", "--skip-serve-logs"], env)
        for i, (pool, concurrency) in enumerate(POOLS):
            wenv = dict(env)
            name = f"{pool}@{socket.gethostname()}"
            wenv.update({
                "DRL_WORKER_NAME": name,
                "AIRFLOW__CORE__HOSTNAME_CALLABLE": "airflow_drl_executor.hostname.worker_hostname",
                "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.ports.worker_logs + i),
            })
            self.spawn(f"worker-{pool}", [airflow, "celery", "worker", "-q", pool, "-H", f"{pool}@%h",
                                          "--concurrency", str(concurrency), "--without-mingle",
                                          "--without-gossip", "--skip-serve-logs"], wenv)
        self.wait("api-server", self._api_healthy, 180)
        self.wait("scheduler", lambda: self._component_healthy("scheduler"), 180)
        self.wait("dag-processor", lambda: self._component_healthy("dag_processor"), 180)
        self.wait("triggerer", lambda: self._component_healthy("triggerer"), 180)
        for pool, _ in POOLS:
            self.wait(f"worker-{pool}", lambda p=pool: b" ready." in self.new_log(f"worker-{p}"), 180)

    def _health(self) -> dict[str, object] | None:
        try:
            with urllib.request.urlopen(f"{self.api_url}/api/v2/monitor/health", timeout=2) as r:
                data = json.loads(r.read())
                return data if isinstance(data, dict) else None
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def _api_healthy(self) -> bool:
        return self._health() is not None

    def _component_healthy(self, component: str) -> bool:
        health = self._health() or {}
        entry = health.get(component)
        return isinstance(entry, dict) and entry.get("status") == "healthy"

    # --- whole stack ----------------------------------------------------------------------------

    SERVICES = ("redis", "policy-server", "api-server", "scheduler", "dag-processor", "triggerer",
                *(f"worker-{p}" for p, _ in POOLS))

    def up(self) -> None:
        t0 = time.monotonic()
        self.state.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        _say("postgres", f"127.0.0.1:{self.ports.pg}")
        self.start_postgres()
        _say("redis", f"127.0.0.1:{self.ports.redis}")
        self.start_redis()
        _say("policy-server", f"metrics/health on 127.0.0.1:{self.ports.metrics}")
        self.start_policy_server()
        _say("airflow", "db migrate")
        self.migrate()
        _say("airflow", f"api-server {self.api_url}, scheduler, dag-processor, triggerer, "
                        f"{len(POOLS)} celery workers")
        self.start_airflow()
        _say("stack", f"up in {time.monotonic() - t0:.0f}s; logs in {self.logs}")

    def down(self) -> None:
        for name in reversed(self.SERVICES):
            self.kill(name)
        self.stop_postgres()

    def start(self, service: str) -> None:
        starters: dict[str, Callable[[], None]] = {
            "postgres": self.start_postgres, "redis": self.start_redis,
            "policy-server": self.start_policy_server,
        }
        if service in starters:
            starters[service]()
        elif service in self.SERVICES:
            self.start_airflow()
        else:
            raise StackError(f"unknown service {service!r}; one of postgres, {', '.join(self.SERVICES)}")

    def status(self) -> dict[str, str]:
        out = {"postgres": "up" if self._pg_ready() else "down"}
        for name in self.SERVICES:
            pid = self.pid(name)
            out[name] = f"up (pid {pid})" if pid else "down"
        return out

    def env_exports(self) -> str:
        env = self.airflow_env()
        keys = sorted(k for k in env if k.startswith("AIRFLOW") )
        return "\n".join(f"export {k}={_shell_quote(env[k])}" for k in keys)


# --- helpers ----------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process (a stack started as root): it exists
        return True
    try:  # a zombie child of ours counts as dead
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _redis_quote(text: str) -> str:
    """An argument of a redis.conf line, in double quotes (a path with a space was two arguments)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is left (a zombie leader of ours aside: reaped)."""
    _alive(pgid)  # reaps the leader if it is our own child
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_time(pid: int) -> str | None:
    """The process's start time, in clock ticks since boot (``/proc/<pid>/stat`` field 22): with
    its pid, what tells it from a later process given the same number; None where unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _traversable_by(uid: int, gid: int, path: Path) -> bool:
    """Whether a process of ``uid``/``gid`` can enter every existing folder on the way to
    ``path`` (folders still to be made get the default, traversable mode)."""
    p = path.resolve()
    for d in [*reversed(p.parents), p]:
        if not d.exists():
            break
        st = d.stat()
        bit = 0o100 if st.st_uid == uid else 0o010 if st.st_gid == gid else 0o001
        if not st.st_mode & bit:
            return False
    return True


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


def _run(argv: list[str], what: str, env: dict[str, str] | None = None, log: Path | None = None) -> None:
    result = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, cwd=REPO)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise StackError(f"{what} failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(_read(path).decode(errors="replace").splitlines()[-lines:])


def _airflow_version() -> str:
    from importlib.metadata import version

    return version("apache-airflow") + "+" + version("airflow-drl-executor")


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"


def _say(what: str, detail: str) -> None:
    print(f"[stack] {what:<14} {detail}", flush=True)


def from_env() -> Stack:
    state = Path(os.environ.get("DRL_STACK_DIR", str(REPO / ".stack"))).resolve()
    catalogue = Path(os.environ.get("DRL_CATALOGUE", str(REPO / "policy" / "catalogues" / "demo.yaml")))
    return Stack(state, Ports.from_env(), catalogue.resolve())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="localstack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "status", "env", "start", "stop"])
    parser.add_argument("service", nargs="?")
    args = parser.parse_args(argv)
    stack = from_env()
    try:
        if args.command == "up":
            stack.up()
        elif args.command == "down":
            stack.down()
            print("[stack] down")
        elif args.command == "status":
            for name, state in stack.status().items():
                print(f"{name:<18} {state}")
        elif args.command == "env":
            print(stack.env_exports())
        elif args.command in ("start", "stop"):
            if not args.service:
                parser.error(f"{args.command} needs a SERVICE")
            if args.command == "stop":
                if args.service == "postgres":
                    stack.stop_postgres()
                elif args.service in stack.SERVICES:
                    stack.kill(args.service)
                else:  # (found by review: a typo stopped nothing, silently)
                    raise StackError(f"unknown service {args.service!r}; one of postgres, {', '.join(stack.SERVICES)}")
            else:
                stack.start(args.service)
    except StackError as exc:
        print(f"[stack] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
