#!/usr/bin/env bash
# Installs the system services the stack and the tests need (redis-server, PostgreSQL, Chromium for
# the UI test) from Debian's packages when they are missing; when it cannot, says exactly what is
# missing and exits 1.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || missing+=(postgresql)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v runuser >/dev/null 2>&1 || missing+=(util-linux)
"${PYTHON:-python3}" -c "import ensurepip, venv" >/dev/null 2>&1 || missing+=(python3-venv)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "[deps] missing system packages: ${missing[*]}"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts the packaged services on their default ports; the stack runs its own instances.
  (service redis-server stop || true; service postgresql stop || true) >/dev/null 2>&1
  echo "[deps] installed: ${missing[*]}"
else
  echo "[deps] cannot install them here (need root and apt-get). Install: ${missing[*]}" >&2
  exit 1
fi
