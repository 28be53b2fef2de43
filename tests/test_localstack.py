"""The local stack's scripts (scripts/localstack.py, Makefile) on what an operator or a CI machine
meets: ``make demo`` / ``make down`` with a stack already up, stale pid files, a port held by
another program, a path with spaces, a reboot.

Every test runs the stack's code in isolation: a state folder under ``tmp_path``, harmless child
processes (``sleep``, ``tail``), fake PostgreSQL tools and fake servers on free loopback ports; no
PostgreSQL, Redis, Celery or Airflow is started, and the default ``.stack`` / ports are never used.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
try:
    import localstack
finally:
    sys.path.remove(str(REPO / "scripts"))

CATALOGUE = REPO / "policy" / "catalogues" / "demo.yaml"


# --- helpers -------------------------------------------------------------------------------------


def _stack(state: Path, api_port: int = 1) -> localstack.Stack:
    # ports nobody listens on (nothing here binds them): the default stack's ports stay untouched
    return localstack.Stack(state, localstack.Ports(pg=2, redis=3, api=api_port, metrics=4, worker_logs=5), CATALOGUE)


def _running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _until(cond: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def fake_postgres_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_postgres`` as root with a ``postgres`` user that is this test's own user (chown to
    ourselves works without privileges)."""
    monkeypatch.setattr(localstack, "_user_exists", lambda name: True)
    monkeypatch.setattr(localstack.pwd, "getpwnam",
                        lambda name: SimpleNamespace(pw_uid=os.getuid(), pw_gid=os.getgid(), pw_name=name))
    monkeypatch.setattr(localstack.os, "geteuid", lambda: 0)
    monkeypatch.setattr(localstack.Stack, "pg_bin", lambda self, tool: f"/fake/pg/bin/{tool}")


class _FakePg:
    """Fake ``_run`` / ``subprocess.run`` for the PostgreSQL tools: records every command."""

    def __init__(self, state_has_airflow_db: bool = True) -> None:
        self.commands: list[list[str]] = []
        self.has_db = state_has_airflow_db

    def run(self, argv: list[str], what: str, env: Any = None, log: Any = None) -> None:
        self.commands.append(list(argv))

    def subprocess_run(self, argv: list[str], *a: Any, **k: Any) -> subprocess.CompletedProcess[str]:
        self.commands.append(list(argv))
        if argv[0].endswith("pg_isready"):
            return subprocess.CompletedProcess(argv, 2, "", "")
        return subprocess.CompletedProcess(argv, 0, "1\n" if self.has_db else "", "")


@pytest.fixture
def health_server() -> Iterator[HTTPServer]:
    """Another program on the api-server's port: an Airflow api-server answering the health
    endpoint with every component healthy (e.g. a fresh heartbeat of a scheduler killed -9)."""
    body = json.dumps({c: {"status": "healthy"} for c in ("metadatabase", "scheduler", "dag_processor",
                                                           "triggerer")}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# --- process bookkeeping -------------------------------------------------------------------------


def test_down_stops_the_process_group_of_a_service_whose_leader_was_killed(tmp_path: Path) -> None:
    """A service whose main process died (``kill -9``, the OOM killer) leaves its children running:
    a Celery worker's pool processes and the tasks they run, uvicorn's workers. ``make down`` then
    prints ``[stack] down`` but those processes keep running (holding ports, running tasks,
    writing to the database) and, their pid file now removed, nothing will ever stop them.

    Cause: ``Stack.kill`` asks ``Stack.pid``, which is None once the LEADER is dead, and then only
    removes the pid file; the group (the service was started in a session of its own, pgid = the
    recorded pid) is never signalled. Expected: ``kill`` signals the whole recorded process group
    whatever the leader's state (and waits for the group, not only its leader)."""
    stack = _stack(tmp_path / "state")
    child_file = tmp_path / "child.pid"
    stack.spawn("worker-gpu", ["bash", "-c", f"sleep 300 & echo $! > '{child_file}'; wait"], dict(os.environ))
    leader = int((stack.pids / "worker-gpu.pid").read_text().split()[0])
    try:
        _until(lambda: child_file.exists() and child_file.read_text().strip() != "")
        child = int(child_file.read_text())
        os.kill(leader, signal.SIGKILL)
        _until(lambda: stack.pid("worker-gpu") is None)  # the leader is gone (reaped)
        assert _running(child)

        stack.kill("worker-gpu", timeout=2.0)

        time.sleep(0.2)
        assert not _running(child), "make down left the killed worker's child process running"
    finally:
        _kill_group(leader)


def test_down_kills_group_members_that_outlive_their_leader_on_sigterm(tmp_path: Path) -> None:
    """``make down`` sends SIGTERM to a service's group and waits only for the group LEADER: a
    child that outlives it (a task process that ignores or handles SIGTERM, a pool process still
    finishing) is never sent SIGKILL, so after ``make down`` says ``[stack] down`` that process
    still runs, its pid file gone.

    Cause: ``Stack.kill`` loops on ``_alive(pid)`` of the leader and sends SIGKILL to the group only
    if the leader is still alive. Expected: after the timeout, every process left in the group is
    killed (e.g. wait until ``os.killpg(pgid, 0)`` raises ProcessLookupError, else SIGKILL)."""
    stack = _stack(tmp_path / "state")
    child_file = tmp_path / "child.pid"
    script = f"(trap '' TERM; exec sleep 300) & echo $! > '{child_file}'; sleep 300"
    stack.spawn("worker-gpu", ["bash", "-c", script], dict(os.environ))
    leader = int((stack.pids / "worker-gpu.pid").read_text().split()[0])
    try:
        _until(lambda: child_file.exists() and child_file.read_text().strip() != "")
        child = int(child_file.read_text())

        stack.kill("worker-gpu", timeout=2.0)

        time.sleep(0.2)
        assert not _running(leader)
        assert not _running(child), "make down left a process of the worker's group running"
    finally:
        _kill_group(leader)


def test_down_leaves_alone_a_program_that_reused_a_stale_pid(tmp_path: Path) -> None:
    """After a reboot (or a ``kill -9`` of the whole stack) the pid files stay in ``.stack/pids``
    and their numbers get reused by other programs. ``make down`` (or ``make clean``) then sends
    SIGTERM/SIGKILL to the process GROUP of whatever program now has that pid (``killpg``: a
    daemon or a shell session and all its children); ``make demo`` likewise skips starting that
    service ("already running") and then fails its health wait.

    Cause: ``Stack.pid`` trusts any live process with the recorded number (``_alive`` is
    ``os.kill(pid, 0)``). Expected: the pid file identifies the process it started (e.g. its start
    time from ``/proc/<pid>/stat`` recorded next to the pid, or a check of its command line), and a
    process that is not the service's is treated as a stale file: not killed."""
    stack = _stack(tmp_path / "state")
    stack.spawn("scheduler", ["sleep", "300"], dict(os.environ))
    pid_file = stack.pids / "scheduler.pid"
    old = int(pid_file.read_text().split()[0])
    os.killpg(old, signal.SIGKILL)
    _until(lambda: stack.pid("scheduler") is None)
    # another program, a session leader of its own, now has the number the file records
    other = subprocess.Popen(["tail", "-f", "/dev/null"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        pid_file.write_text(pid_file.read_text().replace(str(old), str(other.pid)))

        stack.kill("scheduler", timeout=2.0)

        assert _running(other.pid), "make down killed an unrelated program whose pid the stale file named"
    finally:
        _kill_group(other.pid)
        try:
            other.wait(timeout=5)
        except ChildProcessError:
            pass


def test_status_of_a_service_run_by_another_user_is_not_a_traceback(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``make status`` (or ``make down``) by a non-root user, with a stack started as root (or a
    stale pid file whose number now belongs to a daemon of another user), ends in a Python
    traceback: ``PermissionError: [Errno 1] Operation not permitted``.

    Cause: ``_alive`` (scripts/localstack.py) catches only ProcessLookupError around
    ``os.kill(pid, 0)``; the kernel answers EPERM for a live process of another user. Expected: EPERM
    means the process exists: ``status`` says ``up (pid N)`` (or at worst a clear error), no traceback.
    (The test makes ``os.kill(pid, 0)`` answer EPERM for the service's pid, as the kernel does for
    a non-root caller and a root-owned process.)"""
    stack = _stack(tmp_path / "state")
    stack.spawn("redis", ["sleep", "300"], dict(os.environ))
    pid = int((stack.pids / "redis.pid").read_text().split()[0])
    real_kill = os.kill

    def kill(p: int, sig: int) -> None:
        if p == pid and sig == 0:
            raise PermissionError(1, "Operation not permitted")
        real_kill(p, sig)

    try:
        monkeypatch.setattr(localstack.Stack, "_pg_ready", lambda self: False)
        monkeypatch.setattr(localstack.os, "kill", kill)
        try:
            status = stack.status()
        except PermissionError as exc:
            pytest.fail(f"make status as a non-root user: traceback {exc!r}")
        assert status["redis"].startswith("up")
    finally:
        monkeypatch.undo()
        _kill_group(pid)


def test_stop_of_an_unknown_service_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """``python scripts/localstack.py stop policy_server`` (a typo: the service is
    ``policy-server``) exits 0 and prints nothing: the operator believes the policy server stopped
    while it still runs. ``start`` refuses an unknown name with the list of services.

    Cause: ``main`` (scripts/localstack.py) calls ``stack.kill(args.service)`` for any name, and
    ``kill`` only removes a pid file that does not exist. Expected: ``stop`` checks the name like
    ``start`` does (postgres or one of ``Stack.SERVICES``) and exits 1 naming the valid ones."""
    stack = _stack(tmp_path / "state")
    monkeypatch.setattr(localstack, "from_env", lambda: stack)
    rc = localstack.main(["stop", "policy_server"])
    assert rc != 0, f"stop of an unknown service exited {rc}: {capsys.readouterr()}"


# --- health waits ---------------------------------------------------------------------------------


def test_wait_fails_when_the_service_exited_though_its_port_answers_healthy(
        tmp_path: Path, health_server: HTTPServer) -> None:
    """``make demo`` right after a scheduler was killed -9 (or with the api port held by another
    Airflow): the new scheduler exits at start (a config error), yet the stack says up, because
    the health endpoint still reports the OLD scheduler's heartbeat as healthy (Airflow counts a
    heartbeat of the last 30 s). The demo then waits 300 s for runs nobody schedules.

    Cause: ``Stack.wait`` returns as soon as ``check()`` is true and looks at the service's own
    process only when the check fails. Expected: a service whose process has exited is an error
    ("scheduler exited at start; see ...log") whatever its port answers."""
    stack = _stack(tmp_path / "state", api_port=health_server.server_address[1])
    stack.spawn("scheduler", ["sh", "-c", "echo 'AirflowConfigException: bad option'; exit 1"], dict(os.environ))
    _until(lambda: stack.pid("scheduler") is None)  # it has exited (pid file still there)
    assert (stack.pids / "scheduler.pid").exists()

    with pytest.raises(localstack.StackError):
        stack.wait("scheduler", lambda: stack._component_healthy("scheduler"), 3)


def test_a_worker_is_not_ready_because_of_an_earlier_runs_log_line(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every service log is opened in append mode and kept across runs, and a Celery worker is
    taken for ready when its log contains `` ready.``. On the second ``make demo`` (after ``make
    down``, a reboot or a crash) the previous run's line is still there: the stack says up at once
    while the new workers are still starting (or never start), and the demo's tasks wait in the
    queue or the run fails.

    Cause: ``Stack.start_airflow`` waits with ``b" ready." in _read(self.logs / f"worker-{p}.log")``
    over the whole file (``Stack.spawn`` opens the log with ``"ab"``). Expected: only what the new
    process wrote counts (remember the log's size at spawn and read from there, or start a fresh
    log per run, rotating the old one)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "airflow"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")  # starts, never becomes ready
    fake.chmod(0o755)
    monkeypatch.setattr(localstack, "VENV_BIN", bin_dir)
    stack = _stack(tmp_path / "state")
    stack.logs.mkdir(parents=True)
    for pool, _ in localstack.POOLS:  # what the previous run's workers wrote
        (stack.logs / f"worker-{pool}.log").write_text(f"[tasks]\n\ncelery@{pool}@host ready.\nwarm shutdown\n")
    monkeypatch.setattr(localstack.Stack, "_api_healthy", lambda self: True)
    monkeypatch.setattr(localstack.Stack, "_component_healthy", lambda self, component: True)
    real_wait = localstack.Stack.wait
    monkeypatch.setattr(localstack.Stack, "wait",
                        lambda self, name, check, timeout: real_wait(self, name, check, min(timeout, 2.0)))
    monkeypatch.setattr(localstack.Stack, "stop_postgres", lambda self: None)
    try:
        with pytest.raises(localstack.StackError):
            stack.start_airflow()
    finally:
        stack.down()


def test_policy_server_wait_ignores_a_stale_heartbeat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_policy_alive`` says "the server has written a FRESH heartbeat", but takes any heartbeat.
    With Redis still up and the policy server killed -9 (its heartbeat stays in the hash until a
    live replica prunes it), ``make demo`` starts a new server and takes it for alive at once, even
    when it dies at start: every placement then goes to the fallback.

    Cause: ``Stack._policy_alive`` returns ``bool(hgetall(heartbeat))``. Expected: only a heartbeat
    younger than a few seconds on Redis's clock counts (``policy.transport.heartbeat_age`` with
    ``TIME``), or one written after the server was spawned."""
    import redis

    now = time.time()
    beats = {b"policy-old@host": json.dumps({"ts": now - 3600, "version": "default@3"}).encode()}

    class FakeRedis:
        def hgetall(self, key: Any) -> dict[bytes, bytes]:
            return dict(beats)

        def hget(self, key: Any, field: Any) -> bytes | None:
            return beats.get(field if isinstance(field, bytes) else str(field).encode())

        def time(self) -> tuple[int, int]:
            return int(now), int((now % 1) * 1e6)

        def ping(self) -> bool:
            return True

    monkeypatch.setattr(redis.Redis, "from_url", classmethod(lambda cls, *a, **k: FakeRedis()))
    stack = _stack(tmp_path / "state")
    assert not stack._policy_alive(), "an hour-old heartbeat was taken for a live policy server"


# --- PostgreSQL and Redis configuration --------------------------------------------------------------


def test_pg_ctl_options_survive_a_state_path_with_spaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         fake_postgres_user: None) -> None:
    """A checkout at ``/srv/My Projects/airflow-drl-executor``: ``make demo`` fails at
    ``pg_ctl start`` (postgres: ``invalid argument: "Projects/.../pgrun"``), because pg_ctl runs
    ``postgres <-o options>`` through ``/bin/sh -c`` unquoted (pg_ctl.c start_postmaster).

    Cause: ``Stack.start_postgres`` builds ``opts = f"-p {port} -k {run_dir} ..."`` without quoting
    ``run_dir``. Expected: ``-k`` gets the whole folder (``shlex.quote(str(run_dir))``)."""
    state = tmp_path / "My Projects" / ".stack"
    stack = _stack(state)
    (state / "pgdata").mkdir(parents=True)
    (state / "pgdata" / "PG_VERSION").write_text("17\n")
    pg = _FakePg()
    monkeypatch.setattr(localstack, "_run", pg.run)
    monkeypatch.setattr(localstack.subprocess, "run", pg.subprocess_run)

    stack.start_postgres()

    pg_ctl = next(c for c in pg.commands if "pg_ctl" in " ".join(c) and "start" in c)
    opts = shlex.split(pg_ctl[pg_ctl.index("-o") + 1])  # what /bin/sh -c makes of it
    assert opts[opts.index("-k") + 1] == str(stack.pg_home / "pgrun"), f"postgres gets {opts}"


def test_redis_conf_survives_a_state_path_with_spaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout at ``/srv/My Projects/airflow-drl-executor``: redis-server refuses its config
    (``*** FATAL CONFIG FILE ERROR ... dir /srv/My Projects/...: wrong number of arguments``)
    and ``make demo`` stops with "redis exited at start".

    Cause: ``Stack.start_redis`` writes ``dir {self.state / 'redis'}`` unquoted; redis splits a
    config line on spaces unless the argument is in double quotes. Expected: the path is quoted
    (``dir "..."``, escaping ``"`` and ``\\``)."""
    state = tmp_path / "My Projects" / ".stack"
    stack = _stack(state)
    monkeypatch.setattr(localstack.shutil, "which", lambda name: "/usr/bin/redis-server")
    monkeypatch.setattr(localstack.Stack, "spawn", lambda self, name, argv, env: None)
    monkeypatch.setattr(localstack.Stack, "wait", lambda self, name, check, timeout: None)

    stack.start_redis()

    lines = (state / "redis" / "redis.conf").read_text().splitlines()
    dir_line = next(line for line in lines if line.startswith("dir "))
    assert shlex.split(dir_line) == ["dir", str(state / "redis")], f"redis reads {shlex.split(dir_line)}"


def test_initdb_password_file_is_private_and_removed_when_initdb_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_postgres_user: None) -> None:
    """The PostgreSQL password is handed to initdb in ``<state>/pgrun/pwfile``, written with the
    default umask (0644, in a 0755 folder): every local user can read it while initdb runs, and
    when initdb fails (a locale it refuses, a full disk, a port conflict at the next step) the
    file stays there, world-readable, for good; the ``secrets/`` folder is 0700 for this reason.

    Cause: ``Stack.start_postgres`` does ``pwfile.write_text(...)`` then ``_run(initdb)`` and
    ``pwfile.unlink()`` only after a success. Expected: the file is created 0600 (``os.open`` with
    mode 0o600, or a 0700 folder) and removed in a ``finally``."""
    old_umask = os.umask(0o022)
    try:
        stack = _stack(tmp_path / "state")
        modes: list[int] = []

        def run(argv: list[str], what: str, env: Any = None, log: Any = None) -> None:
            if what == "initdb":
                pwfile = Path(argv[argv.index("--pwfile") + 1])
                modes.append(pwfile.stat().st_mode & 0o777)
                raise localstack.StackError("initdb failed (1):\ninitdb: error: invalid locale settings")

        monkeypatch.setattr(localstack, "_run", run)
        with pytest.raises(localstack.StackError):
            stack.start_postgres()
    finally:
        os.umask(old_umask)
    pwfile = stack.pg_home / "pgrun" / "pwfile"
    assert modes and not modes[0] & 0o077, f"the password file was readable by others during initdb: {oct(modes[0])}"
    assert not pwfile.exists(), "the password file stays on disk after initdb failed"


def test_a_fresh_database_cluster_is_migrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              fake_postgres_user: None) -> None:
    """A checkout in a folder the ``postgres`` user cannot enter (root's home, 0700: the usual
    case as root) keeps PostgreSQL's cluster under the system temp folder (``pg_home``), which
    Debian empties at boot (/tmp is a tmpfs on Debian 13). After a reboot ``make demo`` runs initdb
    and createdb afresh, then skips ``airflow db migrate`` because ``.stack/migrated`` still names
    this Airflow version: every Airflow service starts on an empty database and fails (``relation
    "dag" does not exist``), and the stack waits 180 s before saying the api-server is unhealthy.

    Cause: ``Stack.migrate`` trusts the ``<state>/migrated`` marker, which lives apart from the
    database it describes and survives a new cluster. Expected: a new cluster (initdb) or a new
    ``airflow`` database (createdb) is migrated (drop the marker when initdb/createdb runs, or keep
    it inside the cluster's folder)."""
    version = "3.3.2+0.1.0"
    monkeypatch.setattr(localstack, "_airflow_version", lambda: version)
    state = tmp_path / "root-home" / ".stack"
    stack = _stack(state)
    boot_tmp = tmp_path / "tmp"  # the system's temp folder, emptied by the reboot
    boot_tmp.mkdir()
    home = boot_tmp / "drl-pg-0123456789ab"
    monkeypatch.setattr(localstack.Stack, "pg_home", property(lambda self: home))
    # what the previous boot's `make demo` left in the state folder
    state.mkdir(parents=True)
    (state / "pg_home").write_text(f"{home}\n")
    (state / "migrated").write_text(version)
    stack.secret("postgres")

    pg = _FakePg(state_has_airflow_db=False)
    monkeypatch.setattr(localstack, "_run", pg.run)
    monkeypatch.setattr(localstack.subprocess, "run", pg.subprocess_run)
    stack.start_postgres()
    assert any("initdb" in " ".join(c) for c in pg.commands)  # a new, empty cluster

    stack.migrate()

    assert any(c[1:3] == ["db", "migrate"] for c in pg.commands), \
        "airflow db migrate skipped on a database cluster created just now"


def test_down_reports_a_postgres_that_did_not_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``make down`` prints ``[stack] down`` and exits 0 when ``pg_ctl stop`` failed (a shutdown
    that timed out after 60 s, runuser refused for a non-root user): PostgreSQL still runs on its
    port, with nothing said; ``make clean`` then deletes its data folder under it.

    Cause: ``Stack.stop_postgres`` runs pg_ctl with ``check=False`` and ignores its status and
    output. Expected: a failed stop whose server still answers is an error (``StackError`` naming
    pg_ctl's message: exit 1), while a stale ``postmaster.pid`` of a dead server stays fine."""
    stack = _stack(tmp_path / "state")
    (stack.state / "pgdata").mkdir(parents=True)
    (stack.state / "pgdata" / "postmaster.pid").write_text("4242\n")
    monkeypatch.setattr(localstack, "_user_exists", lambda name: False)  # pg_home = the state folder
    monkeypatch.setattr(localstack.Stack, "pg_bin", lambda self, tool: f"/fake/pg/bin/{tool}")

    def run(argv: list[str], *a: Any, **k: Any) -> subprocess.CompletedProcess[str]:
        if any(x.endswith("pg_isready") for x in argv):
            return subprocess.CompletedProcess(argv, 0, "127.0.0.1:2 - accepting connections\n", "")
        if any(x.endswith("pg_ctl") for x in argv):
            return subprocess.CompletedProcess(argv, 1, "waiting for server to shut down....... failed\n",
                                               "pg_ctl: server does not shut down\n")
        raise AssertionError(f"unexpected command {argv}")

    monkeypatch.setattr(localstack.subprocess, "run", run)
    monkeypatch.setattr(localstack, "from_env", lambda: stack)

    rc = localstack.main(["down"])

    out = capsys.readouterr()
    assert rc != 0, f"make down exited 0 with PostgreSQL still running: {out.out!r} {out.err!r}"


# --- Makefile --------------------------------------------------------------------------------------


def test_make_clean_stops_the_test_stack_before_deleting_it() -> None:
    """After an interrupted ``make test`` (Ctrl-C while the harness starts the stack, a CI job
    killed at its time limit), the test stack's PostgreSQL, Redis, Celery workers and Airflow keep
    running from ``.stack-test``. ``make clean`` then stops only ``.stack`` and deletes
    ``.stack-test`` with its pid files: those processes run on (ports, CPU, a scheduler running
    tasks) and no command of the project can find them any more.

    Cause: the Makefile's ``clean: down`` stops the demo stack only before ``rm -rf .stack
    .stack-test``. Expected: ``clean`` also runs ``localstack.py down`` with
    ``DRL_STACK_DIR=.stack-test`` before removing it."""
    out = subprocess.run(["make", "-n", "clean"], cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    lines = out.stdout.splitlines()
    rm = next(i for i, line in enumerate(lines) if line.startswith("rm ") and ".stack-test" in line)
    assert any(".stack-test" in line and "down" in line for line in lines[:rm]), \
        f"make clean removes .stack-test without stopping it: {lines}"

