#!/usr/bin/env bash
# GPU figures of the policy server's batched GNN path (issue 5), by one command that runs unchanged
# on a GPU host (and on a CPU-only one, where the device column says cpu).
#
#   scripts/gpu-bench.sh OUT_DIR [SECONDS_PER_CASE]    measure; writes into OUT_DIR:
#       env.txt                     GPU, Python, torch, CUDA, cores
#       model-ready16.json, model-ready64.json, model-ready64-torch.json
#                                   in-process GNNPlacer.place / place_many on the device, no Redis
#                                   (python -m policy.bench_model; rows_per_s, device and backend
#                                   columns; -torch: every batch's decoding steps on the device)
#       server-replicas1.json, server-replicas8.json, server-goal.json
#                                   drl-policy bench through a private redis-server, as the
#                                   executor drives it (cases[]: p50_ms, p99_ms, decisions_per_s,
#                                   device); skipped, and said so in log.txt, without Redis
#       log.txt                     everything printed
#   scripts/gpu-bench.sh --prepare                     run HERE, not on the GPU host: copies
#       redis-server (with its libraries) and the redis Python package into .gpu-bench/ (git-ignored
#       through .git/info/exclude), for a device run that names .gpu-bench in `carry`.
#
# Needs python3 with torch, torch-geometric, numpy, pyyaml, safetensors and prometheus-client (the
# H200 image has them). The server bench also needs redis-server and the redis package, which the
# H200 image did not have (2026-11): --prepare brings both. The Python is $PYTHON or python3.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
carried="$root/.gpu-bench"

if [ "${1:-}" = "--prepare" ]; then
    exe=$(command -v redis-server) || { echo "no redis-server here to copy" >&2; exit 2; }
    py=${PYTHON:-$root/.venv/bin/python}
    rm -rf "$carried" && mkdir -p "$carried/redis/lib" "$carried/site"
    cp "$exe" "$carried/redis/redis-server.bin"
    # its shared libraries, except the C/C++ runtime the GPU host has in a newer version
    ldd "$exe" | awk '/=> \// {print $3}' | grep -v -E '/lib(c|m|stdc\+\+|gcc_s)\.so' |
        xargs -r -I{} cp -L {} "$carried/redis/lib/"
    printf '#!/bin/sh\nd=$(dirname "$0")\nLD_LIBRARY_PATH="$d/lib" exec "$d/redis-server.bin" "$@"\n' \
        > "$carried/redis/redis-server"
    chmod +x "$carried/redis/redis-server"
    pkg=$("$py" -c 'import os, redis; print(os.path.dirname(redis.__file__))') || exit 2
    cp -r "$pkg" "$carried/site/redis"
    grep -qx '/.gpu-bench/' .git/info/exclude 2>/dev/null || echo '/.gpu-bench/' >> .git/info/exclude
    "$carried/redis/redis-server" --version && du -sh "$carried"
    echo "now: run(command='scripts/gpu-bench.sh \$OUT', carry=['.gpu-bench'])"
    exit 0
fi

out=${1:?usage: scripts/gpu-bench.sh OUT_DIR [SECONDS_PER_CASE] | --prepare}
secs=${2:-5}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d "$carried/site" ]; then
    export PYTHONPATH="$PYTHONPATH:$carried/site"
fi
if ! command -v redis-server >/dev/null && [ -x "$carried/redis/redis-server" ]; then
    export PATH="$carried/redis:$PATH"
fi
log="$out/log.txt"
: > "$log"

{
    date -u
    nvidia-smi -L 2>&1 || echo "no nvidia-smi"
    echo "cores: $(nproc)"
    "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")'
    echo "redis-server: $(command -v redis-server || echo missing)"
    git -C "$root" log --oneline -1 2>/dev/null
} > "$out/env.txt" 2>&1
cat "$out/env.txt" >> "$log"

# 1. The model alone on the device: place() per request and place_many() over 1-256 requests,
#    the decoding steps where policy.batch_decoder puts them by batch size (auto), and once more
#    with every batch's steps on the device (torch), which shows where the two cross.
for ready in 16 64; do
    echo "== python -m policy.bench_model --device auto --tasks 200 1000 --ready $ready --batch 1 8 64 256" >> "$log"
    "$py" -m policy.bench_model --checkpoint policy/checkpoints/default --device auto --tasks 200 1000 \
        --ready "$ready" --batch 1 8 64 256 --repeat 50 --threads 1 2>&1 | tee -a "$log" |
        tail -1 > "$out/model-ready$ready.json"
done
echo "== python -m policy.bench_model --device auto --tasks 200 --ready 64 --batch 8 64 256 --backend torch" >> "$log"
"$py" -m policy.bench_model --checkpoint policy/checkpoints/default --device auto --tasks 200 --ready 64 \
    --batch 8 64 256 --repeat 50 --threads 1 --backend torch 2>&1 | tee -a "$log" |
    tail -1 > "$out/model-ready64-torch.json"

# 2. The server through a real Redis, as the executor drives it (private redis-server + servers).
if command -v redis-server >/dev/null && "$py" -c 'import redis' 2>/dev/null; then
    reg=$(mktemp -d)  # an empty registry is seeded with the packaged default checkpoint
    bench=("$py" -m policy.cli --log-level=WARNING bench --placer gnn --registry "$reg" --device auto
           --duration "$secs")
    # one server process; eight sharing the GPU and the consumer group
    for spec in "1 8,32" "8 8,16,32"; do
        set -- $spec
        echo "== bench --replicas $1 --client-procs 4 --dag-sizes 200,1000 --ready 16,64 --clients $2" >> "$log"
        "${bench[@]}" --replicas "$1" --client-procs 4 --dag-sizes 200,1000 --ready 16,64 \
            --clients "$2" --out "$out/server-replicas$1.json" 2>&1 | tee -a "$log"
    done
    echo "== bench (the 1-client goal case) --dag-sizes 200 --ready 16 --clients 1" >> "$log"
    "${bench[@]}" --dag-sizes 200 --ready 16 --clients 1 --out "$out/server-goal.json" 2>&1 | tee -a "$log"
else
    echo "server bench skipped: no redis-server or no Python redis package (see --prepare)" | tee -a "$log"
fi
echo "done: $(ls "$out")" | tee -a "$log"
