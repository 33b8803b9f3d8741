"""One snapshot's setup, host side: the bootstrap process and the cgroup leaves that hold everything
the setup starts, so it runs within a sandbox's limits and can be stopped as a whole.

The bootstrap joins the leaves before it reads its config (it waits on stdin), so the helper, the
template and whatever the setup code forks are all inside them. Stopping kills every process of the
leaves: the template is PID 1 of its pid namespace, so nothing of the setup survives it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

from ..base import EngineError
from ..cgroups import CgroupError, Cgroups, leaf_name


class Setup:
    def __init__(self, cgroups: Cgroups, tag: str, memory_mib: int, pids_max: int):
        self.cgroups, self.tag = cgroups, tag
        self.memory_mib, self.pids_max = memory_mib, pids_max
        self.boot: subprocess.Popen | None = None
        self.leaves: list[str] = []
        self.cancelled = False

    def start(self, cfg: dict, env: dict, pass_fds: tuple, log_path: str) -> None:
        """Start the bootstrap inside the limits, then hand it its config."""
        with open(log_path, "wb") as log:
            self.boot = subprocess.Popen([sys.executable, "-m", "forkd_engine.process.bootstrap"],
                                         stdin=subprocess.PIPE, stdout=log, stderr=log, env=env, pass_fds=pass_fds,
                                         start_new_session=True, cwd="/")
        try:
            self.leaves = self.cgroups.apply(leaf_name("setup", self.tag), self.boot.pid, self.memory_mib,
                                             self.pids_max)
        except (CgroupError, OSError) as exc:
            raise EngineError(f"snapshot {self.tag!r}: cannot limit its setup: {exc}") from exc
        if not self.cancelled:
            self.boot.stdin.write(json.dumps(cfg).encode())
        self.boot.stdin.close()

    def stop(self, wait: float = 0.0) -> None:
        """Kill the bootstrap and every process in the leaves (with ``wait``: until they are gone)."""
        if self.boot is not None:
            with contextlib.suppress(OSError):
                self.boot.kill()
        self.cgroups.kill_all(self.leaves, wait=wait)

    def end(self) -> list[str]:
        """Nothing of a failed, timed-out or cancelled setup stays (its leaves go once empty);
        returns the leaves still busy now."""
        self.stop(wait=10)
        if self.boot is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.boot.wait(timeout=10)
        return self.cgroups.remove(self.leaves)

    def limits_hit(self) -> str:
        """What of the limits stopped the setup, said for its error ("" when none did)."""
        hit = [h.message for h in self.cgroups.hits(self.leaves)]
        if not hit:
            return ""
        return (f" [stopped by its limits: {'; '.join(hit)}. A setup runs within a sandbox's limits: "
                f"{self.memory_mib} MiB of memory (memory_limit_mib asks for more), {self.pids_max} "
                f"processes and threads]")

    def done(self) -> list[str]:
        """The setup succeeded: the template only forks from now on, and each fork moves to its own
        leaves, so the limits are lifted; returns the leaves (the template stays in them)."""
        self.cgroups.unlimit(self.leaves)
        return self.leaves
