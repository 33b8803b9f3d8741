"""Each process sandbox's own /etc/machine-id.

The sandbox root binds the host's /etc read-only, so every sandbox would read the host's machine
id: code that keys on it (telemetry ids, license checks, D-Bus, "one per machine" caches) would take
all sandboxes, and the host, for one machine. A VM child gets its own at restore; here a new one is
laid over the host's in the mount namespace of the template or sandbox, right after it was made.

It is done as systemd does on a read-only /etc: the id is written to /run/machine-id (/run being a
small tmpfs of its own, read-only once written) and that file is bound over /etc/machine-id. No
unmount is needed, which the sandbox's seccomp filter forbids: a branch's children each lay their
own over the one they inherited.
"""

from __future__ import annotations

import os
import uuid

from .. import linux

PATH = "/etc/machine-id"
RUN = "/run"
_FLAGS = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC


def own_machine_id() -> str | None:
    """Give this mount namespace a machine id of its own (systemd's format: 32 hex digits and a
    newline); returns it, or None where the host has no /etc/machine-id to cover (the read-only
    /etc cannot gain one)."""
    if not os.path.isfile(PATH):
        return None
    machine_id = uuid.uuid4().hex
    linux.mount("forkd-run", RUN, "tmpfs", _FLAGS, "size=4k,mode=755")
    staged = os.path.join(RUN, "machine-id")
    with open(staged, "w") as f:
        f.write(machine_id + "\n")
    os.chmod(staged, 0o444)
    linux.mount(None, RUN, None, linux.MS_REMOUNT | linux.MS_RDONLY | _FLAGS)
    linux.mount(staged, PATH, None, linux.MS_BIND)
    return machine_id
