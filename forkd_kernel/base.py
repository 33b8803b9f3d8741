"""The base snapshot a forkd notebook starts from, and the memory limit of the notebook's sandboxes.

The base is made once per settings (engine, setup, packages, this package's version) and shared by
every kernel with the same ones: its tag is ``forkd-kernel-<engine>-<hash of the settings>``. In a
JupyterHub user's server (``$JUPYTERHUB_USER``) the user is one of the settings: forkd as a Hub
service shows each user only what they made, so each has a base of their own. With
engine ``auto`` it is made on the process engine, unless its setup leaves running work a process
fork cannot carry; then on the VM engine, which carries it, and the first cell says why.
"""

from __future__ import annotations

import hashlib
import os

from forkd_server.client import ControllerError

from . import __version__

__all__ = ["BASE_SETUP", "BaseSnapshot"]

# Warms what every cell would load: the shell (created by the snapshot's shell option), jedi.
BASE_SETUP = "import os, sys, time, random\n"


class BaseSnapshot:
    """Which snapshot a notebook forks from, making it on first use."""

    def __init__(self, controller, *, engine: str, setup: str, packages: list[str], tag: str = ""):
        self.controller = controller
        self.engine, self.setup, self.packages, self.named = engine, setup, list(packages), tag
        # "auto" starts on the process engine; ensure() moves to vm if the setup needs it
        self.resolved_engine = "process" if engine == "auto" else engine
        self.notice: str | None = None  # what the first cell says about the choice of engine
        self._refused = ""                # why the last attempt to make it failed

    def packages_for(self, engine: str) -> list[str]:
        if engine == "vm" and "python3-ipython" not in self.packages:
            return [*self.packages, "python3-ipython"]  # the guest's shell
        return list(self.packages)

    @property
    def tag(self) -> str:
        if self.named:
            return self.named
        engine = self.resolved_engine
        recipe = "\n".join([engine, self.setup, ",".join(sorted(self.packages_for(engine))), __version__])
        user = os.environ.get("JUPYTERHUB_USER")
        if user:  # under JupyterHub each user owns what they make, and sees no one else's base
            recipe += "\nuser:" + user
        return f"forkd-kernel-{engine}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"

    def ensure(self, memory_limit_mib: int | None = None) -> str:
        """The base's tag, once it is ready: made here (its setup within ``memory_limit_mib``, the
        notebook's) if it does not exist yet, waited for if another kernel is making it."""
        for _attempt in range(3):
            tag = self.tag
            try:
                info = self.controller.snapshot_info(tag)
            except ControllerError as exc:
                if exc.status != 404 or self.named:
                    raise
                if self._create(tag, memory_limit_mib):
                    return tag
                continue
            if info.get("status") == "writing":
                info = self.controller.wait_snapshot(tag, timeout=900)
            if info.get("status") == "ready":
                return tag
            raise RuntimeError(f"the notebook's base snapshot {tag} is {info.get('status')}: {info.get('warning', '')}\n"
                               f"delete it with %forkd delete {tag} and restart the kernel to make it again")
        raise RuntimeError(f"the notebook's base snapshot {self.tag} could not be made: {self._refused}")

    def _create(self, tag: str, memory_limit_mib: int | None) -> bool:
        """Make the base; False when it is to be looked up again (another kernel is making it, or
        it moved to the VM engine)."""
        engine = self.resolved_engine
        try:
            # The setup is the notebook's own first code: it runs within the notebook's memory limit.
            self.controller.create_snapshot(tag, setup=BASE_SETUP + self.setup, engine=engine,
                                            packages=self.packages_for(engine) or None, shell="ipython",
                                            memory_limit_mib=memory_limit_mib)
            return True
        except ControllerError as exc:
            if exc.lost and self.engine == "auto" and engine == "process":
                # The setup leaves running work (threads, servers) a process fork would drop:
                # the VM engine carries it. Said under the first cell.
                self.resolved_engine = "vm"
                self.notice = ("forkd: this notebook runs on the VM engine: its setup leaves running "
                               "what a process fork cannot carry (" + "; ".join(exc.lost) + ").\n")
                return False
            if exc.lost:
                raise RuntimeError(exc.message) from None
            if exc.status not in (400, 409):  # 400/409: another kernel made it, or is making it, right now
                raise
            self._refused = exc.message
            return False
