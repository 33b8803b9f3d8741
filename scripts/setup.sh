#!/usr/bin/env bash
# Everything a fresh machine needs for forkd: Debian packages, then this project and its Python
# dependencies. Idempotent; safe to run again. Usage: scripts/setup.sh [demo|test]
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"

# Debian packages the engines and tests use (skipped when all are present already).
debs=(iproute2 qemu-system-x86 qemu-utils busybox-static lz4 e2fsprogs chromium chromium-driver openssl)
missing=()
for p in "${debs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "forkd setup: missing Debian packages: ${missing[*]} (run as root or install them)" >&2
  fi
fi

extras=demo
[ "$what" = test ] && extras=demo,test
python3 -m pip install -q --disable-pip-version-check -e ".[${extras}]" 2>&1 | grep -v -E "^WARNING: (Location|Running pip)" || true
python3 -c "import forkd_engine, forkd_server" 
