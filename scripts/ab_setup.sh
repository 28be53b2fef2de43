# Sourced by the A/B scripts (scripts/*_ab.sh): the policy/ package of commit $OLD in $TMP/src
# (put it on PYTHONPATH for the "old" side), an empty folder $TMP/run to start the server from
# (python -m would import the policy/ of the working directory), a model registry $TMP/reg
# serving the packaged default checkpoint, and $OUT created. $TMP goes at exit.
set -eo pipefail
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
mkdir -p "$TMP/src" "$TMP/run" "$OUT"
git archive "$OLD" policy | tar -x -C "$TMP/src"
.venv/bin/python -c "from policy.registry import activate; activate('$TMP/reg', '$PWD/policy/checkpoints/default')"
