"""The container deployment agrees with the code: queues, commands, files.

(No Docker engine runs on the development machines; these checks keep docker-compose.yaml honest.)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest
import yaml

from policy import server
from policy.catalogue import load_catalogue

REPO = Path(__file__).resolve().parents[1]
COMPOSE_TEXT = (REPO / "docker-compose.yaml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES: dict[str, dict] = COMPOSE["services"]


def test_one_worker_per_demo_pool() -> None:
    pools = set(load_catalogue(REPO / "policy/catalogues/demo.yaml").names)
    queues = set()
    for name, svc in COMPOSE["services"].items():
        cmd = svc.get("command", [])
        if cmd[:3] == ["airflow", "celery", "worker"]:
            queue = cmd[cmd.index("-q") + 1]
            queues.add(queue)
            assert svc["environment"]["DRL_WORKER_NAME"].startswith(f"{queue}@"), name
    assert queues == pools


def test_policy_server_command_parses() -> None:
    cmd = COMPOSE["services"]["policy-server"]["command"]
    assert cmd[0] == "serve"
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args([re.sub(r"\$\{[^}]*\}", "pw", a) for a in cmd[1:]])
    assert args.metrics_port == 9100


def test_images_build_from_files_in_the_repo() -> None:
    for svc in COMPOSE["services"].values():
        build = svc.get("build")
        if build:
            assert (REPO / build["dockerfile"]).is_file()
    executor = COMPOSE["x-airflow-env"]["AIRFLOW__CORE__EXECUTOR"]
    assert executor == "DRLExecutor:airflow_drl_executor.DRLExecutor"
    assert sys.version_info >= (3, 11)


def watched_dir(policy: dict) -> str:
    """The registry folder the policy server's command names."""
    return str(policy["command"][policy["command"].index("--registry") + 1])


def test_every_worker_can_run_the_nightly_retraining() -> None:
    """Any worker may run either task of ``drl_nightly_retrain`` (the policy places them): each
    reads the traces from the metadata database (``drl_traces``) and mounts, as DRL_REGISTRY_DIR,
    the volume the policy servers watch as their registry (replay files, candidates, active.json)."""
    policy = COMPOSE["services"]["policy-server"]
    registry = policy["command"][policy["command"].index("--registry") + 1]
    (watched,) = [v.split(":")[0] for v in policy["volumes"] if v.split(":")[1] == registry]
    database = COMPOSE["x-airflow-env"]["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].replace("+psycopg2", "", 1)
    workers = {name: svc for name, svc in COMPOSE["services"].items()
               if svc.get("command", [])[:3] == ["airflow", "celery", "worker"]}
    assert workers
    for name, svc in workers.items():
        env = svc["environment"]
        assert env["AIRFLOW_CONN_DRL_TRACES"] == database, name
        assert f"{watched}:{env['DRL_REGISTRY_DIR']}" in svc.get("volumes", []), name
        assert env["AIRFLOW__CORE__EXECUTOR"] == COMPOSE["x-airflow-env"]["AIRFLOW__CORE__EXECUTOR"], name
        # finetune runs drl-trainer (torch) on whichever worker was chosen
        assert svc["build"]["args"]["INSTALL_TRAINER"] == "1", name
    for svc in ("scheduler", "api-server"):
        assert "args" not in COMPOSE["services"][svc]["build"], f"{svc}: no torch on the scheduler's side"
    # both writers of the registry volume (the workers' uid 50000, the servers' 50001) share a group
    for dockerfile in ("docker/Dockerfile.airflow", "docker/Dockerfile.policy"):
        text = (REPO / dockerfile).read_text()
        assert "groupadd --gid 50100 drl" in text and "--groups drl" in text, dockerfile
        assert f"chgrp drl {watched_dir(policy)}" in text and "chmod 2775" in text, dockerfile


def test_a_replicated_service_publishes_a_host_port_per_replica() -> None:
    """was: policy-server, 2 replicas, published "9100:9100": the second replica cannot bind it"""
    for name, svc in COMPOSE["services"].items():
        replicas = int(svc.get("deploy", {}).get("replicas", 1))
        for port in svc.get("ports", []):
            host = str(port).rsplit(":", 1)[0].split(":")[-1]
            lo, _, hi = host.partition("-")
            width = int(hi or lo) - int(lo) + 1
            assert width >= replicas, f"{name}: {replicas} replicas, host ports {host!r}"


def test_every_long_running_service_has_a_healthcheck() -> None:
    """was: only postgres and redis had one: a policy server that could not use Redis (a wrong
    password) or a dead scheduler looked up"""
    for name, svc in COMPOSE["services"].items():
        if name == "airflow-init":
            continue  # runs once
        assert svc.get("healthcheck", {}).get("test"), name
    policy = COMPOSE["services"]["policy-server"]
    port = policy["command"][policy["command"].index("--metrics-port") + 1]
    assert f"127.0.0.1:{port}/health" in " ".join(policy["healthcheck"]["test"])


def test_the_build_context_leaves_out_the_local_state() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".venv", ".stack", ".stack-test", "runs"} <= set(ignored)


def test_every_airflow_container_shares_one_fernet_key() -> None:
    """was: none was set, so each container wrote its own airflow.cfg with a random key: a
    connection saved in the UI could not be read by the workers, nor after the next recreate"""
    from cryptography.fernet import Fernet

    airflow = {name: svc for name, svc in COMPOSE["services"].items()
               if svc.get("environment", {}).get("AIRFLOW__CORE__EXECUTOR")}
    assert {"scheduler", "api-server"} <= set(airflow) and len(airflow) >= 5
    keys = {svc["environment"]["AIRFLOW__CORE__FERNET_KEY"] for svc in airflow.values()}
    (key,) = keys
    default = key.split(":-", 1)[1].rstrip("}")  # ${AIRFLOW_FERNET_KEY:-...}
    Fernet(default.encode())  # a valid key


def test_the_schedulers_spool_outlives_its_container(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placements the metadata DB refused wait in the spool (airflow_drl_executor/spool.py) for
    the next scheduler: in the container's own filesystem a recreate would lose them."""
    from airflow_drl_executor.spool import default_dir

    dockerfile = (REPO / "docker" / "Dockerfile.airflow").read_text()
    monkeypatch.setenv("AIRFLOW_HOME", re.search(r"AIRFLOW_HOME=(\S+)", dockerfile).group(1))
    mounts = {m.split(":")[1]: m.split(":")[0] for m in COMPOSE["services"]["scheduler"].get("volumes", [])}
    assert mounts.get(str(default_dir())) in COMPOSE["volumes"], f"{default_dir()}: not on a named volume"
    assert str(default_dir()) in dockerfile, "made in the image, owned by airflow (a new volume takes its owner)"


def test_airflows_metrics_reach_the_statsd_exporter() -> None:
    """The executor's metrics (airflow_drl_executor/metrics.py) go where Airflow's go: every Airflow
    container sends StatsD to the exporter service, on the port it listens on."""
    svc = COMPOSE["services"]["statsd-exporter"]
    assert "127.0.0.1:9102:9102" in svc["ports"]  # on loopback (found by review: every interface)
    for name, airflow in COMPOSE["services"].items():
        env = airflow.get("environment", {})
        if env.get("AIRFLOW__CORE__EXECUTOR"):
            assert (env["AIRFLOW__METRICS__STATSD_ON"], env["AIRFLOW__METRICS__STATSD_HOST"],
                    env["AIRFLOW__METRICS__STATSD_PORT"]) == ("True", "statsd-exporter", "9125"), name


# --- found by review (2026-12-06) ---


#: ``${NAME:-default}`` where NAME names a secret
_SECRET_DEFAULT = re.compile(r"\$\{(?P<name>[A-Z_]*(?:PASSWORD|SECRET|FERNET|KEY)[A-Z_]*):-(?P<default>[^}]+)\}")


def _published_on_every_interface() -> dict[str, list[str]]:
    """Service -> its published ports that name no host address (Docker binds them to 0.0.0.0)."""
    out: dict[str, list[str]] = {}
    for name, svc in SERVICES.items():
        for port in svc.get("ports", []):
            spec = str(port["published"] if isinstance(port, dict) else port)
            host_ip = port.get("host_ip", "") if isinstance(port, dict) else ""
            parts = spec.split(":")
            if not host_ip and len(parts) == 3:
                host_ip = parts[0]
            if len(parts) >= 2 and host_ip not in ("127.0.0.1", "::1", "localhost"):
                out.setdefault(name, []).append(spec)
    return out


def test_no_secret_committed_in_the_compose_file_guards_a_port_published_on_every_interface() -> None:
    """`docker compose up -d --build` (the header's first command) publishes the api-server on
    0.0.0.0:8080 (and the metrics on 9100-9102), while the JWT secret that signs every UI/REST
    token (``change-me-three``), the API secret key, the Fernet key and the DB/Redis passwords
    default to values committed in this repository. Anyone who can reach the host's port 8080
    can mint an admin token with the public JWT secret, and connection passwords are encrypted
    with a public Fernet key. The header's "change the passwords before exposing anything" does
    not help: the file itself exposes the port. A deployer who forgot the .env sees a working
    stack, not an error.

    Fix: make the secrets required (``${AIRFLOW_JWT_SECRET:?set it in .env}``, likewise the API
    secret key, the Fernet key and the passwords; a ``make compose-env`` that writes a .env of
    generated values), or publish on loopback (``"127.0.0.1:8080:8080"``). The existing
    ``test_every_airflow_container_shares_one_fernet_key`` reads the default after ``:-`` and
    would need to follow."""
    defaults = sorted({m["name"] for m in _SECRET_DEFAULT.finditer(COMPOSE_TEXT)})
    exposed = _published_on_every_interface()
    assert not (defaults and exposed), (
        f"published on every interface: {exposed}; secrets with a default committed here: {defaults}")


def test_the_env_file_the_compose_header_asks_for_is_git_ignored() -> None:
    """The compose header says to put the passwords "in an .env file" (Compose reads ``.env`` from
    the project folder: the repository root), but ``.env`` is not in .gitignore: the next
    ``git add -A`` of a deployment checkout commits the Redis, PostgreSQL, JWT and Fernet
    secrets. Fix: add ``.env`` to .gitignore (and to .dockerignore, so it stays out of the build
    context)."""
    assert "an .env file" in COMPOSE_TEXT
    ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    assert ignored & {".env", "/.env", ".env*", "/.env*", "*.env"}, ".env is not git-ignored"


def test_airflow_containers_depend_on_the_statsd_exporter_they_send_to() -> None:
    """Every Airflow container sends StatsD to ``statsd-exporter`` (README, "Deploying": the
    executor's ``drl_executor.*`` metrics included), and none depends on that service. Airflow
    resolves the StatsD host once per process: when the name does not resolve at its first
    metric (the exporter not started yet or restarting: ``docker compose up -d scheduler``, an
    exporter that crashed), ``_get_backend`` logs one error and keeps a ``NoStatsLogger`` for
    the life of the process (airflow/_shared/observability/metrics/stats.py), so that scheduler
    sends no metric at all until it is restarted; a recreated exporter (new IP) is likewise
    never found again. Prometheus then shows the executor's placements and fallbacks flat, as
    if nothing was scheduled.

    Fix: ``depends_on: {statsd-exporter: {condition: service_healthy, restart: true}}`` on the
    Airflow services (x-airflow)."""
    missing = []
    for name, svc in SERVICES.items():
        env = svc.get("environment", {})
        host = env.get("AIRFLOW__METRICS__STATSD_HOST") if isinstance(env, dict) else None
        if name == "airflow-init" or host not in SERVICES or str(env.get("AIRFLOW__METRICS__STATSD_ON")) != "True":
            continue
        if host not in svc.get("depends_on", {}):
            missing.append(name)
    assert not missing, f"send StatsD to statsd-exporter without depending on it: {missing}"


def test_a_cuda_build_of_the_policy_image_is_given_a_gpu() -> None:
    """The compose header offers ``TORCH_INDEX_URL`` for "a CPU or a CUDA build of torch 2.13.0"
    and docker/Dockerfile.policy says the server runs "on a GPU" with a CUDA build and the NVIDIA
    runtime, but the ``policy-server`` service reserves no GPU (no ``deploy.resources.reservations
    .devices`` / ``gpus``), so a container of the CUDA build sees no device: ``--device auto``
    silently serves on the CPU (the heartbeat and /health say ``cpu``). Left unset, the build
    takes PyPI's default torch, on Linux x86_64 the CUDA build with its several GB of nvidia
    wheels, into an image that is never given a GPU (the Airflow image defaults to the CPU index).

    Fix: a GPU variant (a ``gpu`` profile or ``docker-compose.gpu.yaml`` override) that reserves
    ``{driver: nvidia, count: 1, capabilities: [gpu]}`` for policy-server, and default
    ``TORCH_INDEX_URL`` to the CPU index as Dockerfile.airflow does."""
    assert "CUDA" in COMPOSE_TEXT or "cu128" in COMPOSE_TEXT  # the header offers it
    files = sorted(REPO.glob("docker-compose*.y*ml")) + sorted(REPO.glob("compose*.y*ml"))
    reserved = []
    for path in files:
        svc = (yaml.safe_load(path.read_text()) or {}).get("services", {}).get("policy-server", {})
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if svc.get("gpus") or any("gpu" in (d.get("capabilities") or []) for d in devices):
            reserved.append(path.name)
    assert reserved, f"no compose file in {[p.name for p in files]} gives policy-server a GPU"


def test_the_local_stack_listens_on_loopback_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/localstack.py says "every service listens on 127.0.0.1 only" (README: the stack runs
    "on loopback", the integration stack "on free loopback ports"), but it starts the three Celery
    workers and the triggerer without ``--skip-serve-logs``: Airflow's log server binds ``[::]`` /
    ``0.0.0.0`` whatever the config (airflow/utils/serve_logs/core.py, ``host=""``), so four
    ports are open to the network; the triggerer's is the fixed default 8794
    (``trigger_log_server_port`` is never set), so a ``make test`` stack started while ``make
    demo`` runs cannot bind it. These servers serve nothing on one host: the api-server fetches
    served logs on ITS ``worker_log_server_port`` (8793, not the workers' 28793+i) and reads the
    finished tasks' files from the shared log folder.

    Fix: pass ``--skip-serve-logs`` to ``airflow celery worker`` and ``airflow triggerer`` in
    ``Stack.start_airflow`` (the per-worker log ports can then go)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import localstack
    finally:
        sys.path.remove(str(REPO / "scripts"))
    assert "every service listens on 127.0.0.1 only" in (localstack.__doc__ or "")
    stack = localstack.Stack(tmp_path, localstack.Ports(1, 2, 3, 4, 5), REPO / "policy/catalogues/demo.yaml")
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(stack, "spawn", lambda name, argv, env: spawned.setdefault(name, argv))
    monkeypatch.setattr(stack, "wait", lambda *a, **k: None)
    stack.start_airflow()
    serving = [name for name, argv in spawned.items()
               if (argv[1:2] == ["triggerer"] or argv[1:3] == ["celery", "worker"])
               and not {"--skip-serve-logs", "-s"} & set(argv)]
    assert not serving, f"start a log server on every interface: {serving}"


def test_the_policy_images_numba_cache_is_usable_by_the_user_it_runs_as() -> None:
    """docker/Dockerfile.policy compiles the GNN's step kernel at build time so that "numba
    caches it", but it does so as root, into the root-owned ``site-packages/policy/__pycache__``,
    and the server runs as ``policy``. numba uses an in-tree cache only where it can write
    (numba/core/caching.py: ``InTreeCacheLocator`` probes with a temporary file, then falls back
    to ``~/.cache/numba``), so every container start recompiles: about 6 s instead of 0.6 s on
    this machine (``NUMBA_CACHE_DIR=<empty dir> python -c "from policy import step_kernel;
    step_kernel.warm_up()"``, twice), on every replica start and restart.

    Fix: ``ENV NUMBA_CACHE_DIR=/var/cache/drl-numba`` made and owned by ``policy`` before the
    warm-up (or run the warm-up after ``USER policy``); numba's cache is also keyed by the CPU,
    so a build host other than the serving host recompiles anyway unless ``NUMBA_CPU_NAME=generic``
    is set at build and run time."""
    lines = (REPO / "docker" / "Dockerfile.policy").read_text().splitlines()
    warm = next(i for i, line in enumerate(lines) if "warm_up()" in line)
    user = next(i for i, line in enumerate(lines) if line.startswith("USER "))
    assert lines[user].split()[1] != "root"
    cache_dir_set = any(line.startswith(("ENV", "ARG")) and "NUMBA_CACHE_DIR" in line for line in lines[:warm])
    assert warm > user or cache_dir_set, (
        f"line {warm + 1} compiles as root into a cache {lines[user]!r} cannot use")


def test_redis_keeps_queued_task_messages_across_a_restart() -> None:
    """Celery's queued task messages and the policy's request stream live in Redis: without an
    append-only file on a volume, a restarted Redis container lost every queued task."""
    redis_svc = SERVICES["redis"]
    cmd = redis_svc["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    mounts = {m.split(":")[1]: m.split(":")[0] for m in redis_svc.get("volumes", [])}
    assert mounts.get("/data") in COMPOSE["volumes"], "the official image writes its files in /data"


def test_every_airflow_container_shares_the_task_logs() -> None:
    """The api-server reads a finished task's log from the file its worker wrote: every container
    running Airflow mounts one named volume at $AIRFLOW_HOME/logs (Airflow's base_log_folder), a
    folder the image makes for the airflow user (a new volume takes its owner)."""
    dockerfile = (REPO / "docker" / "Dockerfile.airflow").read_text()
    logs = re.search(r"AIRFLOW_HOME=(\S+)", dockerfile).group(1) + "/logs"
    assert logs in dockerfile
    airflow = {name: svc for name, svc in SERVICES.items()
               if name != "airflow-init" and svc.get("command", [""])[0] == "airflow"}
    assert {"api-server", "scheduler", "triggerer", "worker-gpu"} <= set(airflow)
    volumes = {name: {m.split(":")[1]: m.split(":")[0] for m in svc.get("volumes", [])}
               for name, svc in airflow.items()}
    named = {v.get(logs) for v in volumes.values()}
    assert len(named) == 1 and named.pop() in COMPOSE["volumes"], volumes


def test_airflows_limits_let_the_policy_see_what_the_pools_can_run() -> None:
    """Airflow's defaults hand the executor at most 16 tasks of a DAG run (held ones included) and
    32 in all; the compose file sets each limit, at least the catalogue's worker slots, as
    ``airflow drl-executor check`` asks (its ``limits`` line)."""
    from airflow_drl_executor.check import worker_slots
    from policy.catalogue import load_catalogue

    env = COMPOSE["x-airflow-env"]
    slots = worker_slots(load_catalogue(REPO / "policy/catalogues/demo.yaml"))
    for key in ("AIRFLOW__CORE__MAX_ACTIVE_TASKS_PER_DAG", "AIRFLOW__CORE__PARALLELISM",
                "AIRFLOW__CORE__DEFAULT_POOL_TASK_SLOT_COUNT"):
        assert int(env[key]) >= slots, key
