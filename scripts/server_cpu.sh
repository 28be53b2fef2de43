#!/usr/bin/env bash
# CPU seconds of the policy server, Redis and the bench clients during one `drl-policy bench` case
# (docs/server.md): starts a private redis-server and one GNN server on loopback, lets the server
# load and warm up, runs the case against them with --redis, and prints each process's CPU
# seconds over the case (from /proc/PID/stat) next to the bench's own line.
#
#   scripts/server_cpu.sh REGISTRY READY CLIENTS [SECONDS]
#
# REGISTRY: a model registry naming the checkpoint. Extra server settings come from the
# environment (DRL_POLICY_*), e.g. DRL_POLICY_GC_FREEZE_S=0.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
reg=${1:?usage: scripts/server_cpu.sh REGISTRY READY CLIENTS [SECONDS]}
ready=${2:?}; clients=${3:?}; secs=${4:-8}
py=${PYTHON:-$root/.venv/bin/python}
port=$("$py" -c "from policy.bench import free_port; print(free_port())")
url=redis://127.0.0.1:$port/0
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >/dev/null 2>&1 &
rpid=$!
"$py" -m policy.cli --log-level WARNING serve --redis "$url" --prefix cpu --placer gnn --registry "$reg" \
    --device cpu >/dev/null 2>&1 &
spid=$!
trap 'kill $spid $rpid 2>/dev/null; wait 2>/dev/null' EXIT
sleep 10  # torch, the model and the compiled steps load
cpu() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
r0=$(cpu $rpid); s0=$(cpu $spid)
/usr/bin/time -f "bench process cpu %U+%S s, wall %e s" "$py" -m policy.cli --log-level WARNING bench \
    --redis "$url" --prefix cpu --dag-sizes 200 --ready "$ready" --clients "$clients" --duration "$secs" \
    --out /dev/null 2>&1 | grep -v '^wrote'
echo "redis-server cpu $(echo "$(cpu $rpid) - $r0" | bc) s, policy server cpu $(echo "$(cpu $spid) - $s0" | bc) s"
