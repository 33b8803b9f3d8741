"""Start a process-engine template: ``python -m forkd_engine.process.bootstrap`` (config on stdin).

1. As the host's root, in a private mount namespace, build the read-only sandbox root and pivot.
2. Fork a child that unshares user, mount, UTS, IPC, pid (and net) namespaces; map its root to an
   unprivileged host uid from outside, where we still hold the right to; it drops every host group.
3. That child forks the namespace's first process (PID 1), which forks the template and leaves
   PID 1 to forkd-init (inside.hand_pid1_to_init). The template mounts /proc, a private /tmp,
   installs the seccomp filter, runs the snapshot's setup and serves. Both helpers exit, so the
   template belongs to no server process and survives a server restart.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from .. import linux
from . import fanout, rootfs
from ..agent import inventory
from .inside import SandboxProcess, hand_pid1_to_init, report, send_listener
from .machine_id import own_machine_id


class SetupFailed(RuntimeError):
    """The snapshot's own setup (its commands, its code, its shell) failed: the request's fault."""

_PROC_FLAGS = linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC


def template_main(cfg: dict) -> None:
    """The snapshot's template: set up, run the user's setup, serve. Never returns."""
    report_fd, listen_fd = cfg["report_fd"], cfg["listen_fd"]
    try:
        guard = hand_pid1_to_init(guard=True)
        linux.mount("proc", "/proc", "proc", _PROC_FLAGS)
        linux.mount("tmpfs", "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"mode=1777,size={cfg['tmp_size_mib']}m")
        linux.mount("shm", "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"mode=1777,size={cfg['shm_size_mib']}m")
        linux.sethostname(cfg["tag"][:64])
        own_machine_id()  # the setup's code never sees the host's either
        if not cfg["host_network"]:
            linux.loopback_up()
        os.chdir("/tmp")
        os.environ.clear()
        os.environ.update(cfg["env"])
        send_listener(guard, linux.install_seccomp(deny_hugetlb=bool(cfg.get("deny_hugetlb")), guard=True))
        proc = SandboxProcess({"id": cfg["tag"], "role": "template", "lineage": [cfg["tag"]]},
                              {"host_network": cfg["host_network"], "tmp_size_mib": cfg["tmp_size_mib"],
                               "shm_size_mib": cfg["shm_size_mib"], "lossy": bool(cfg.get("lossy"))})
        rt = proc.runtime
        if cfg.get("shell") == "ipython":
            out = rt.handle({"action": "shell"})
            if out.get("error"):
                raise SetupFailed(f"IPython could not start: {out['error']}")
        for argv in cfg.get("setup_commands") or []:
            out = rt.handle({"action": "exec", "args": argv, "timeout": cfg["setup_timeout"]})
            if out.get("exit_code") != 0:
                detail = (out.get("stderr") or out.get("error") or "").strip()[-2000:]
                raise SetupFailed(f"setup command {argv!r} exited {out.get('exit_code')}: {detail}")
        if cfg.get("setup"):
            out = rt.handle({"action": "run_code", "code": cfg["setup"]})
            if out.get("error"):
                err = out["error"]
                tb = "".join(err.get("traceback", []))[-2000:] if isinstance(err, dict) else str(err)
                raise SetupFailed(f"setup code failed: {tb.strip()}")
        # Every sandbox is a fork of this process: what setup left running would not be in them.
        lost = inventory.lost({report_fd, listen_fd})
        if lost and not cfg.get("lossy"):
            report(report_fd, {"id": cfg["tag"], "ok": False, "lost": lost,
                               "error": "setup left running work that forks cannot carry"})
            os._exit(1)
        devnull = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
    except BaseException as exc:  # noqa: BLE001
        report(report_fd, {"id": cfg["tag"], "ok": False, "error": f"{type(exc).__name__}: {exc}",
                           "setup_failed": isinstance(exc, SetupFailed)})
        os._exit(1)
    proc.serve(listen_fd, report_fd, warnings=lost, after_setup=True)  # its ready report says what a lossy setup left


def main() -> int:
    cfg = json.load(sys.stdin)
    try:
        fanout.load(cfg["fanout"])  # from the host's files, which the sandbox root does not show
        proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)  # the host's, for the id maps
        rootfs.build_and_enter(cfg["root_dir"], hidden=cfg["hidden"], init=cfg["init"])
        ready_r, ready_w = os.pipe()
        maps_r, maps_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(ready_r)
                os.close(maps_w)
                flags = (linux.CLONE_NEWUSER | linux.CLONE_NEWNS | linux.CLONE_NEWUTS
                         | linux.CLONE_NEWIPC | linux.CLONE_NEWPID)
                if not cfg["host_network"]:
                    flags |= linux.CLONE_NEWNET
                linux.unshare(flags)
                os.write(ready_w, b"1")
                if os.read(maps_r, 1) != b"1":
                    os._exit(1)
                os.close(ready_w)
                os.close(maps_r)
                os.close(proc_fd)  # the template keeps no descriptor of ours: a fork would share it
                os.setgroups([])
                os.setresgid(0, 0, 0)
                os.setresuid(0, 0, 0)
                if os.fork() == 0:
                    template_main(cfg)
                os._exit(0)
            except BaseException as exc:  # noqa: BLE001
                report(cfg["report_fd"], {"id": cfg["tag"], "ok": False, "error": f"{type(exc).__name__}: {exc}"})
                os._exit(1)
        os.close(ready_w)
        os.close(maps_r)
        if os.read(ready_r, 1) == b"1":
            linux.write_id_maps(pid, cfg["uid"], cfg["gid"], proc_fd)
            os.write(maps_w, b"1")
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    except BaseException as exc:  # noqa: BLE001
        traceback.print_exc()
        report(cfg["report_fd"], {"id": cfg["tag"], "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1


if __name__ == "__main__":
    sys.exit(main())
