"""``forkd doctor``: what this host can run, one row per check, each with a fix hint.

Rows: ``{"check", "status": ok|warn|fail|info, "detail", "fix", "required"}``. ``required`` rows are
the process engine's needs; a failed one makes ``forkd doctor`` exit 1.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import shutil
import tempfile

KVM_GET_API_VERSION = 0xAE00
FICLONE = 0x40049409
NAMESPACES = ("user", "pid", "mnt", "net", "ipc", "uts", "cgroup")


def _row(check: str, status: str, detail: str, fix: str = "", required: bool = False) -> dict:
    return {"check": check, "status": status, "detail": detail, "fix": fix, "required": required}


def check_root() -> dict:
    if os.geteuid() == 0:
        return _row("privileges", "ok", "running as root", required=True)
    return _row("privileges", "fail", f"running as uid {os.geteuid()}; the process engine builds namespaces "
                "and mounts as root", "run `forkd serve` as root (or under sudo)", required=True)


def check_kvm() -> dict:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return _row("kvm", "warn", "/dev/kvm is absent: the VM engine falls back to TCG (slow)",
                    "enable virtualization in the BIOS / use a host with nested virtualization; `modprobe kvm_intel` "
                    "or `modprobe kvm_amd`")
    except PermissionError:
        return _row("kvm", "warn", "/dev/kvm exists but is not accessible", "add the user to the kvm group "
                    "or run as root")
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as exc:
        return _row("kvm", "warn", f"/dev/kvm does not answer KVM_GET_API_VERSION: {exc.strerror}",
                    "check `dmesg | grep -i kvm`")
    finally:
        os.close(fd)
    from forkd_engine.vm import kvm_status

    usable, why = kvm_status()  # the VM engine's own verdict: the one it acts on
    if usable:
        return _row("kvm", "ok", f"/dev/kvm usable (API version {version}): {why}")
    return _row("kvm", "warn", f"/dev/kvm answers (API version {version}) but the VM engine will not use it: "
                f"{why}", "VMs run under TCG here (correct, slower); for KVM use a host with vmx/svm")


def check_pvm() -> dict:
    if os.path.exists("/sys/module/kvm_pvm"):
        return _row("pvm", "warn", "this host's KVM is PVM (kvm_pvm loaded, no hardware virtualization): "
                    "stock guest kernels crash under it, so the VM engine uses TCG",
                    "a guest kernel built with CONFIG_PVM_GUEST would be needed for KVM here")
    return _row("pvm", "ok", "not a PVM host")


def check_qemu() -> dict:
    for name in ("qemu-system-x86_64", "qemu-system-aarch64"):
        path = shutil.which(name)
        if path:
            return _row("qemu", "ok", f"{name} at {path}")
    return _row("qemu", "warn", "no qemu-system binary: the VM engine is unavailable (the process engine works)",
                "apt-get install qemu-system-x86")


def check_packages() -> dict:
    from .host_packages import GROUPS, install_line, missing

    required, optional = missing("process"), missing("vm")
    if not required and not optional:
        names = ", ".join(pkg for g in ("process", "vm") for pkg, _, _ in GROUPS[g])
        return _row("debian packages", "ok", f"present: {names}", required=True)
    detail = "missing: " + "; ".join(f"{pkg} ({why})" for pkg, why in required + optional)
    if not required:
        detail += " (the process engine works without them)"
    return _row("debian packages", "fail" if required else "warn", detail,
                install_line(pkg for pkg, _ in required + optional), required=True)


def check_namespaces() -> dict:
    missing = [ns for ns in NAMESPACES if not os.path.exists(f"/proc/self/ns/{ns}")]
    detail = []
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read()) == 0:
                missing.append("user (max_user_namespaces=0)")
    except (OSError, ValueError):
        pass
    if missing:
        return _row("namespaces", "fail", f"missing: {', '.join(missing)}",
                    "use a kernel with CONFIG_NAMESPACES (user, pid, net, ipc, uts); "
                    "`sysctl user.max_user_namespaces=15000`", required=True)
    detail.append(", ".join(NAMESPACES))
    return _row("namespaces", "ok", "available: " + detail[0], required=True)


def check_cgroups() -> dict:
    path = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(path):
        with open(path) as f:
            controllers = f.read().split()
        status = "ok" if "memory" in controllers else "warn"
        return _row("cgroups", status, f"v2 unified; controllers: {' '.join(controllers) or '(none delegated)'}",
                    "" if status == "ok" else "enable the memory controller "
                    "(`echo +memory > /sys/fs/cgroup/cgroup.subtree_control`) for memory_limit_mib")
    v1 = sorted(d for d in os.listdir("/sys/fs/cgroup") if os.path.isdir(os.path.join("/sys/fs/cgroup", d))) \
        if os.path.isdir("/sys/fs/cgroup") else []
    if v1:
        status = "ok" if "memory" in v1 else "warn"
        return _row("cgroups", status, f"v1 hierarchies: {' '.join(v1)}",
                    "" if status == "ok" else "mount the memory controller for memory_limit_mib")
    return _row("cgroups", "warn", "no cgroup filesystem: memory_limit_mib cannot be enforced",
                "mount cgroup2 on /sys/fs/cgroup")


def cgroup_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[str, str, set[str]]]:
    """Each cgroup filesystem mounted: (mount point, "cgroup" or "cgroup2", its superblock options)."""
    mounts = []
    try:
        with open(mountinfo) as f:
            for line in f:
                fields, _, rest = line.partition(" - ")  # mount point 5th before it; type, source, options after
                after = rest.split()
                if len(after) >= 3 and after[0] in ("cgroup", "cgroup2"):
                    mounts.append((fields.split()[4], after[0], set(after[2].split(","))))
    except OSError:
        pass
    return mounts


def check_cgroup_moves(mountinfo: str = "/proc/self/mountinfo") -> dict:
    """Whether moving a process into a cgroup waits for an RCU grace period. Every spawned child
    and every new snapshot's template is moved into its leaves once; from Linux 6.0 each such move
    takes cgroup_threadgroup_rwsem for writing, which waits a grace period (5-17 ms measured on
    this project's hosts) unless the hierarchy favours dynamic changes (``favordynmods``)."""
    mounts = cgroup_mounts(mountinfo)
    if not mounts:
        return _row("cgroup moves", "info", "no cgroup filesystem mounted")
    if _kernel_version() < (6, 0):
        return _row("cgroup moves", "ok", f"Linux {os.uname().release} moves processes between cgroups "
                    "without waiting for an RCU grace period")
    if any("favordynmods" in options for _, _, options in mounts):
        return _row("cgroup moves", "ok", "favordynmods is on: a spawn's moves into its cgroups do not wait "
                    "for an RCU grace period")
    v2 = [point for point, fstype, _ in mounts if fstype == "cgroup2"]
    now = f"`mount -o remount,favordynmods {v2[0]}` (until the next boot); to keep it, " if v2 else ""
    return _row("cgroup moves", "info", "each spawn's and each new snapshot's move into its cgroups waits for an "
                "RCU grace period (5-17 ms; the kernel's default, which keeps fork and exit on their fast path)",
                f"for faster spawns and notebook forks: {now}boot with `cgroup_favordynmods=true` (Linux 6.7 or "
                "later; cgroup v1 hierarchies take it only at boot)")


def check_hugepages() -> dict:
    from forkd_engine.cgroups import locate
    from forkd_engine.process.reserve import describe

    pool = []
    for knob in ("nr_overcommit_hugepages", "nr_hugepages"):
        try:
            with open(f"/proc/sys/vm/{knob}") as f:
                pool.append(f"vm.{knob}={f.read().strip()}")
        except OSError:
            pass
    where = locate("hugetlb")
    if where is not None:
        return _row("huge pages", "ok", f"cgroup {where[0]} hugetlb at {where[1]}: each process sandbox's huge pages "
                    f"are capped at its memory limit, and its big arrays move into them while it idles "
                    f"({', '.join(pool) or 'no hugetlb pool'}; a zero surplus pool is raised when the engine starts); "
                    f"{describe()}")
    return _row("huge pages", "warn", "no hugetlb cgroup controller: huge pages could not be capped per sandbox, so "
                f"the process engine gives no sandbox any, refuses MAP_HUGETLB in them, and keeps the pool as found "
                f"({', '.join(pool) or 'none'}); a live branch right after a cell rewrote a big array pauses longer",
                "enable the controller: `echo +hugetlb > /sys/fs/cgroup/cgroup.subtree_control` (cgroup v2) or mount "
                "a cgroup v1 hugetlb hierarchy at /sys/fs/cgroup/hugetlb")


def check_userfaultfd() -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    nr = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
    if nr is None:
        return _row("userfaultfd", "info", f"unknown syscall number on {os.uname().machine}")
    fd = libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK)
    if fd >= 0:
        os.close(fd)
        return _row("userfaultfd", "ok", "userfaultfd(2) available (VM live branches)")
    err = ctypes.get_errno()
    return _row("userfaultfd", "warn", f"userfaultfd(2) failed: {os.strerror(err)}",
                "`sysctl vm.unprivileged_userfaultfd=1` or run as root; kernel needs CONFIG_USERFAULTFD")


def check_seccomp() -> dict:
    try:
        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        status = {}
    if "Seccomp" not in status:
        return _row("seccomp", "warn", "the kernel has no seccomp: sandboxes run without a syscall filter",
                    "use a kernel with CONFIG_SECCOMP_FILTER")
    mode = status["Seccomp"].strip()
    detail = "available" + (" (this process is already filtered)" if mode != "0" else "")
    if _kernel_version() < (5, 5):  # user notification that lets a call go on: the signal guard's
        return _row("seccomp", "fail", f"{detail}, but Linux {os.uname().release} has no seccomp user "
                    "notification with SECCOMP_USER_NOTIF_FLAG_CONTINUE, which guards a process sandbox's "
                    "branches from its signals: process-engine snapshots cannot be made",
                    "use Linux 5.5 or later, or the VM engine", required=True)
    return _row("seccomp", "ok", detail + "; user notification for the signal guard")


def _kernel_version() -> tuple[int, int]:
    numbers = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(numbers.group(1)), int(numbers.group(2))) if numbers else (0, 0)


def check_disk(data_dir: str) -> dict:
    probe = data_dir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    usage = shutil.disk_usage(probe)
    free_gib = usage.free / 2**30
    status = "ok" if free_gib >= 5 else "warn" if free_gib >= 1 else "fail"
    return _row("free disk", status, f"{free_gib:.1f} GiB free at {probe}",
                "" if status == "ok" else "free space or point --data-dir / FORKD_DATA_DIR elsewhere",
                required=status == "fail")


def check_reflink(data_dir: str) -> dict:
    probe = data_dir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    try:
        with tempfile.NamedTemporaryFile(dir=probe) as src, tempfile.NamedTemporaryFile(dir=probe) as dst:
            src.write(b"forkd" * 1024)
            src.flush()
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
    except OSError as exc:
        return _row("reflink", "info", f"no reflink copies in {probe} ({exc.strerror}): VM disk layers "
                    "use qcow2 overlays instead", "put the data dir on XFS (reflink=1) or btrfs for instant copies")
    return _row("reflink", "ok", f"{probe} supports reflink copies")


def check_server(url: str | None, token: str | None) -> dict:
    from .client import Controller, ControllerError, ServerUnreachable
    from .client._errors import BadServerURL

    try:
        ctl = Controller(url, token, timeout=2)
        ctl.healthz()
        version = ctl.version()
        return _row("server", "ok", f"{ctl.base_url} answers (api {version.get('api')}, version {version.get('version')})")
    except ServerUnreachable as exc:
        return _row("server", "info", f"no server answers at {exc.url}", "start one with `forkd serve`")
    except BadServerURL as exc:  # the rest of the host is still checked
        return _row("server", "warn", str(exc).split("; ")[0], "give --url (or FORKD_URL) as http://HOST:PORT")
    except ControllerError as exc:
        return _row("server", "warn", f"{exc.url}: {exc.what} (HTTP {exc.status})",
                    "set FORKD_TOKEN to the server's token" if exc.status == 401 else exc.hint)


def run_checks(data_dir: str, url: str | None = None, token: str | None = None) -> list[dict]:
    rows = [check_root(), check_packages(), check_namespaces(), check_cgroups(), check_cgroup_moves(), check_hugepages(), check_seccomp(), check_kvm(), check_pvm(),
            check_qemu(), check_userfaultfd(), check_disk(data_dir), check_reflink(data_dir)]
    rows.append(check_server(url, token))
    return rows
