#!/usr/bin/env bash
# The held-out bench of docs/policy.md's ledger (Epigenomics traces, BWA and SoyKB recipes,
# GPU-affinity cluster, load 0.85, noise 0.3, 30 runs, the executor's hold bounds, --max-wait-s 60
# and its default --max-hold-s 300; before 2026-12-07 evening one 60 s bound): the seven
# baselines, then a checkpoint, for each seed pair given; JSON as scripts/ratio_table.py reads it.
#
#   scripts/heldout_bench.sh SCALE_IN OUT CHECKPOINT SEED [SEED ...]
#   scripts/heldout_bench.sh window docs/exp-ledger/scale-in/window docs/exp-ledger/checkpoints/e2 0 20
#   python scripts/ratio_table.py OUT/base e2=OUT/e2 --seeds 0 20
#
# BENCH_ARGS adds options to both benches, e.g. Airflow's default concurrency limits:
#   BENCH_ARGS="--max-active-tasks 16 --pool-slots 128 --parallelism 32" scripts/heldout_bench.sh ...
set -euo pipefail
[ $# -ge 4 ] || { sed -n '2,11p' "$0"; exit 2; }
rule=$1 out=$2 ckpt=$3
shift 3
cd "$(dirname "$0")/.."
W=../shared/workflows/wfinstances
EPI="$W/epigenomics-chameleon-hep-1seq-100k-001.json,$W/epigenomics-chameleon-hep-2seq-100k-001.json"
EPI="$EPI,$W/epigenomics-chameleon-ilmn-1seq-100k-001.json,$W/epigenomics-chameleon-ilmn-2seq-100k-001.json"
name=$(basename "$ckpt")
mkdir -p "$out"
for S in "$@"; do
  common=(--workflows "$EPI" --workflows wfcommons:bwa:200:3 --workflows wfcommons:soykb:200:3
          --pools policy/catalogues/gpu-affinity.yaml --load 0.85 --duration-noise 0.3 --dag-runs 30
          --seeds 2 --seed "$S" --max-wait-s 60 --scale-in "$rule" --jobs 2 ${BENCH_ARGS:-})
  .venv/bin/drl-trainer bench "${common[@]}" --policies srpt+eft,srpt+eftm,fifo+eft,rcp+eft,cost-aware,heft,min-min \
      --json "$out/base-$S.json"
  .venv/bin/drl-trainer bench "${common[@]}" --policies drl --checkpoint "$ckpt" --json "$out/$name-$S.json"
done
