"""CPU time of groups of processes, for benches: each group a cgroup (v1 ``cpuacct``, else v2) that
a process joins before it starts what it runs, so everything it forks later counts to it too, even
a process that was reparented or has ended (a template, a sandbox). Needs root; without it (or
cgroups) ``CpuGroups.make`` returns None and the bench leaves its CPU figures out.

Beside them, how busy the machine's CPUs were (``/proc/stat``): with other work on the machine, a
group's wall time is its CPU time over the share of the CPUs it wins.
"""

from __future__ import annotations

import os
import time

V1 = "/sys/fs/cgroup/cpuacct"
V2 = "/sys/fs/cgroup"


class CpuGroups:
    def __init__(self, base: str, v1: bool):
        self.base, self.v1, self.groups = base, v1, {}

    @classmethod
    def make(cls, name: str) -> CpuGroups | None:
        v1 = os.path.exists(os.path.join(V1, "cpuacct.usage"))
        if not v1 and not os.path.exists(os.path.join(V2, "cgroup.controllers")):
            return None
        base = os.path.join(V1 if v1 else V2, f"{name}-{os.getpid()}")
        try:
            os.makedirs(base)
        except OSError:
            return None
        return cls(base, v1)

    def join(self, group: str, pid: int) -> None:
        """Move process ``pid`` (all its threads) into ``group``; what it forks from now on follows."""
        path = os.path.join(self.base, group)
        os.makedirs(path, exist_ok=True)
        self.groups[group] = path
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def usage(self) -> dict[str, float]:
        """CPU seconds of each group so far, and ``machine_busy``: of the whole machine's CPUs."""
        out = {}
        for group, path in self.groups.items():
            if self.v1:
                with open(os.path.join(path, "cpuacct.usage")) as f:
                    out[group] = int(f.read()) / 1e9
            else:
                with open(os.path.join(path, "cpu.stat")) as f:
                    out[group] = int(dict(line.split() for line in f)["usage_usec"]) / 1e6
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        out["machine_busy"] = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        return out

    def remove(self, timeout: float = 30.0) -> None:
        """Remove the groups once their processes have ended (sandboxes end a moment after their kill)."""
        deadline = time.monotonic() + timeout
        for path in [*self.groups.values(), self.base]:
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        print(f"cpu_groups: {path} still has processes; left in place", flush=True)
                        break
                    time.sleep(0.1)


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}

