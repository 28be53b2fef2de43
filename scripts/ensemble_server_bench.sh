#!/bin/bash
# p99 round trip of the server (200 tasks, 16 ready, 1 client): a reference checkpoint against a
# candidate, alternated 3 times; JSON to OUT (default runs/srv) as NAME-i.json.
#   scripts/ensemble_server_bench.sh [OUT] [REF_NAME=REF_DIR] [NAME=DIR]
# defaults: s41=docs/exp-ledger/checkpoints/s41 against e3=docs/exp-ledger/checkpoints/e3
cd "$(dirname "$0")/.."
OUT=${1:-runs/srv}
REF=${2:-s41=docs/exp-ledger/checkpoints/s41}
CAND=${3:-e3=docs/exp-ledger/checkpoints/e3}
set -eo pipefail
REG=$(mktemp -d)
trap 'rm -rf "$REG"' EXIT
for spec in "$REF" "$CAND"; do
  .venv/bin/python -c "from policy.registry import activate; activate('$REG/${spec%%=*}', '$PWD/${spec#*=}')"
done
mkdir -p "$OUT"
for i in 1 2 3; do for m in "${REF%%=*}" "${CAND%%=*}"; do
  .venv/bin/drl-policy --log-level WARNING bench --placer gnn --registry "$REG/$m" --device cpu --dag-sizes 200 --ready 16 --clients 1 --duration 5 --out "$OUT/$m-$i.json" 2>&1 | sed "s/^/$m $i /"
done; done
