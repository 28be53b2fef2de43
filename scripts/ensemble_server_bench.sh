#!/bin/bash
# p99 round trip of the server (200 tasks, 16 ready, 1 client), the packaged default s41 vs the
# e3 ensemble (docs/exp-ledger/checkpoints/e3), alternated 3 times; JSON to OUT (default runs/srv)
cd "$(dirname "$0")/.."
OUT=${1:-runs/srv}
set -eo pipefail
REG=$(mktemp -d)
trap 'rm -rf "$REG"' EXIT
mkdir -p "$REG/s41"   # an empty registry serves the packaged default (s41)
.venv/bin/python -c "from policy.registry import activate; activate('$REG/e3', '$PWD/docs/exp-ledger/checkpoints/e3')"
mkdir -p "$OUT"
for i in 1 2 3; do for m in s41 e3; do
  .venv/bin/drl-policy --log-level WARNING bench --placer gnn --registry "$REG/$m" --device cpu --dag-sizes 200 --ready 16 --clients 1 --duration 5 --out "$OUT/$m-$i.json" 2>&1 | sed "s/^/$m $i /"
done; done
