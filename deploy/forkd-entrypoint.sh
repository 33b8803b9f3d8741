#!/bin/sh
# The host container's entrypoint: make the container's cgroup able to hold sandboxes' cgroups,
# then run the command (forkd serve).
#
# Under cgroup v2 with a cgroup namespace of its own (containerd and CRI-O on a v2 node), the
# container's processes sit in the root of what it sees, /sys/fs/cgroup, and v2 hands the memory
# and pids controllers to child groups only from a group holding no process. So the processes move
# into a child group (init) first, and the controllers are handed down; forkd's engines then make
# their groups (forkd/..., forkd-vm/...) beside it, inside the container's own group, so every
# sandbox counts against this pod and /healthz's memory_free sees the pod's limit.
# Elsewhere (cgroup v1, or the node's whole hierarchy visible) there is nothing to do.
set -eu
root=/sys/fs/cgroup
if [ -f "$root/cgroup.controllers" ] && grep -qx "0::/" /proc/self/cgroup && [ -w "$root" ]; then
  mkdir -p "$root/init"
  while read -r pid; do
    echo "$pid" > "$root/init/cgroup.procs" 2>/dev/null || true  # a process that has exited meanwhile
  done < "$root/cgroup.procs"
  for controller in $(cat "$root/cgroup.controllers"); do
    echo "+$controller" > "$root/cgroup.subtree_control" 2>/dev/null \
      || echo "forkd-entrypoint: could not hand the $controller controller to child groups" >&2
  done
fi
exec "$@"
