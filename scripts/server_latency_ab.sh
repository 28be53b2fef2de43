#!/bin/bash
# The CPU goal case of issue #5 (200-task run, 16 ready, 1 client, 5 s) with the default
# checkpoint: the policy/ package of commit OLD against the working tree's, alternated three
# times through a private Redis; JSON to OUT as {old,new}-i.json.
#   scripts/server_latency_ab.sh OLD [OUT]
cd "$(dirname "$0")/.."
OLD=${1:?usage: scripts/server_latency_ab.sh OLD_COMMIT [OUT]}
OUT=${2:-runs/server-latency-ab}
source scripts/ab_setup.sh
for i in 1 2 3; do for v in old new; do
  if [ $v = old ]; then export PYTHONPATH=$TMP/src; else unset PYTHONPATH; fi
  (cd "$TMP/run" && "$OLDPWD/.venv/bin/drl-policy" --log-level WARNING bench --placer gnn --registry "$TMP/reg" \
      --device cpu --dag-sizes 200 --ready 16 --clients 1 --duration 5 --out "$OLDPWD/$OUT/$v-$i.json" > /dev/null)
  .venv/bin/python -c "import json; c = json.load(open('$OUT/$v-$i.json'))['cases'][0]; \
print('$v $i p50', c['p50_ms'], 'ms, p99', c['p99_ms'], 'ms,', c['decisions_per_s'], 'decisions/s')"
done; done
