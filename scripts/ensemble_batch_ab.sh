#!/bin/bash
# Soak A/B of the policy server with the default checkpoint (an ensemble): the policy/ package of
# commit OLD against the working tree's, alternated twice, 40 s each at 1,000 requests/s offered,
# 200-task runs, 16 ready, 8 clients, a new run every 20 requests. JSON to OUT as {old,new}-i.json.
#   scripts/ensemble_batch_ab.sh OLD [OUT]
cd "$(dirname "$0")/.."
OLD=${1:?usage: scripts/ensemble_batch_ab.sh OLD_COMMIT [OUT]}
OUT=${2:-runs/ensemble-batch-ab}
source scripts/ab_setup.sh
for i in 1 2; do for v in new old; do
  if [ $v = old ]; then export PYTHONPATH=$TMP/src; else unset PYTHONPATH; fi
  (cd "$TMP/run" && "$OLDPWD/.venv/bin/drl-policy" --log-level WARNING bench --placer gnn --registry "$TMP/reg" --device cpu \
      --soak 40 --rate 1000 --dag-sizes 200 --ready 16 --clients 8 --new-run-every 20 --out "$OLDPWD/$OUT/$v-$i.json" \
      > /dev/null)
  .venv/bin/python -c "import json; s = json.load(open('$OUT/$v-$i.json'))['soak']; print('$v $i', s['achieved_rate'], \
'req/s', s['decisions_per_s'], 'decisions/s, p50', s['p50_ms'], 'ms, server p50', s['server_p50_ms'], 'ms')"
done; done
