"""The guest image: Debian's cloud kernel and an initramfs holding busybox, Debian's python3.11
and the forkd guest agent, all taken from Debian's packages with ``apt-get download``.

``build_image(cache_dir)`` returns an :class:`Image` (paths to ``vmlinux`` and ``initrd.cpio``). The
result is cached under ``cache_dir/images/<key>``, where the key hashes every input: the .deb files
(their names carry the versions), this builder and the agent's sources. Changing any of them builds a
new image; an unchanged one is reused at once.

The optional second disk of more Debian packages is built by ``packages.py``; the guest's /init
(here) finds it by its virtio serial and lays it under ``/`` with overlayfs.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass

KERNEL_META = "linux-image-cloud-amd64"
PYTHON_PACKAGES = ("python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib")
BUSYBOX_PACKAGE = "busybox-static"
LZ4_MAGIC = b"\x02\x21\x4c\x18"  # LZ4 legacy frame
# Modules the guest needs (virtio over MMIO, the agent's serial port, disks, the entropy device).
GUEST_MODULES = ("virtio_mmio", "virtio_console", "virtio_blk", "virtio-rng")
# Loaded by /init only when a packages disk is attached.
PACKAGES_MODULES = ("overlay",)
# virtio-blk serials the engine gives its disks; /init tells them apart by these, not by vdX order.
DATA_SERIAL = "forkd-data"
PACKAGES_SERIAL = "forkd-pkgs"
PY_DROP_DIRS = {"test", "idlelib", "tkinter", "ensurepip", "lib2to3", "pydoc_data", "dist-packages",
                "turtledemo"}
# _sqlite3 stays: IPython (the forkd kernel's shell in a VM) imports it even with its history off.
PY_DROP_EXT = re.compile(r"^(_test|_ctypes_test|_xxtestfuzz|xxlimited|_ssl|_hashlib|_curses|"
                         r"_tkinter|readline|_dbm|nis|ossaudiodev|_xxsubinterpreters)")
AGENT_MODULE = "forkd_engine.agent.serial"
BUILDER_VERSION = "2"


class ImageError(Exception):
    """The guest image could not be built; the message says which step failed."""


@dataclass
class Image:
    key: str
    dir: str
    kernel: str
    initrd: str
    kernel_version: str

    def to_dict(self) -> dict:
        return {"key": self.key, "dir": self.dir, "kernel": self.kernel, "initrd": self.initrd,
                "kernel_version": self.kernel_version}


def run(cmd: list[str], cwd: str | None = None, **kw) -> subprocess.CompletedProcess:
    """Run a build step; ImageError says which and why it failed."""
    try:
        return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, **kw)
    except FileNotFoundError as exc:
        raise ImageError(f"{cmd[0]} is not installed (scripts/setup.sh installs it)") from exc
    except subprocess.CalledProcessError as exc:
        err = (exc.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise ImageError(f"{' '.join(cmd)} failed: {err}") from exc


# --- downloading the .debs ---------------------------------------------------------------------

def _kernel_package() -> str:
    out = run(["apt-cache", "depends", KERNEL_META]).stdout.decode()
    for line in out.splitlines():
        m = re.match(r"\s*Depends:\s*(linux-image-\d\S*)", line)
        if m:
            return m.group(1)
    raise ImageError(f"apt-cache does not know which kernel {KERNEL_META} depends on; run apt-get update")


def _download(deb_dir: str, packages: list[str]) -> None:
    missing = [p for p in packages if not glob.glob(os.path.join(deb_dir, f"{p}_*.deb"))]
    if not missing:
        return
    # apt-get drops privileges to _apt for downloads; let it write here.
    with contextlib.suppress(OSError):
        os.chmod(deb_dir, 0o777)
    try:
        run(["apt-get", "download", *missing], cwd=deb_dir)
    except ImageError:
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "download", *missing], cwd=deb_dir)


def fetch_debs(cache_dir: str) -> dict[str, str]:
    """Download (once) the packages the image is made of; returns {package: deb path}."""
    deb_dir = os.path.join(cache_dir, "debs")
    os.makedirs(deb_dir, exist_ok=True)
    have_kernel = glob.glob(os.path.join(deb_dir, "linux-image-[0-9]*-cloud-amd64_*.deb"))
    try:
        kernel_pkg = _kernel_package() if not have_kernel else os.path.basename(have_kernel[0]).split("_")[0]
    except ImageError:
        run(["apt-get", "update", "-qq"])
        kernel_pkg = _kernel_package()
    packages = [kernel_pkg, *PYTHON_PACKAGES, BUSYBOX_PACKAGE]
    _download(deb_dir, packages)
    out = {}
    for p in packages:
        found = sorted(glob.glob(os.path.join(deb_dir, f"{p}_*.deb")))
        if not found:
            raise ImageError(f"apt-get download {p} left no .deb in {deb_dir}")
        out[p] = found[-1]
    return out


# --- pieces ------------------------------------------------------------------------------------

def extract_vmlinux(vmlinuz: str, out: str) -> None:
    """Debian's bzImage carries an LZ4 (legacy frame) payload; QEMU boots the ELF inside (PVH)."""
    with open(vmlinuz, "rb") as f:
        data = f.read()
    pos = data.find(LZ4_MAGIC)
    while pos >= 0:
        proc = subprocess.run(["lz4", "-dc"], input=data[pos:], capture_output=True)
        if proc.stdout[:4] == b"\x7fELF":
            with open(out, "wb") as f:
                f.write(proc.stdout)
            return
        pos = data.find(LZ4_MAGIC, pos + 1)
    raise ImageError(f"no LZ4 payload that decompresses to an ELF kernel in {vmlinuz} (is lz4 installed?)")


def _module_order(moddir: str, wanted: tuple[str, ...]) -> list[str]:
    """Paths of ``wanted`` modules and their dependencies, dependencies first (from .modinfo)."""
    paths = {}
    for root, _dirs, files in os.walk(moddir):
        for f in files:
            if f.endswith(".ko"):
                paths[f[:-3].replace("-", "_")] = os.path.join(root, f)
    order: list[str] = []

    def visit(name: str, stack: tuple = ()) -> None:
        key = name.replace("-", "_")
        if key in order or key in stack:
            return
        if key not in paths:
            return  # built into the kernel
        with open(paths[key], "rb") as f:
            m = re.search(rb"depends=([\w,-]*)\x00", f.read())
        for dep in (m.group(1).decode().split(",") if m and m.group(1) else []):
            visit(dep, stack + (key,))
        order.append(key)

    for w in wanted:
        visit(w)
    return [paths[k] for k in order]


def _ldd(paths: list[str]) -> set[str]:
    libs: set[str] = set()
    for p in paths:
        proc = subprocess.run(["ldd", p], capture_output=True, text=True)
        for line in proc.stdout.splitlines():
            m = re.search(r"(/\S+) \(0x", line)
            if m and os.path.exists(m.group(1)):
                libs.add(m.group(1))
    return libs


INIT = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmp /tmp
mount -t tmpfs shm /dev/shm
for m in {modules}; do insmod "$m" || echo "forkd init: insmod $m failed"; done
ip link set lo up 2>/dev/null
pkgs=
for b in /sys/block/vd*; do
  [ -e "$b/serial" ] || continue
  case "$(cat "$b/serial")" in
    {data_serial}) mkdir -p /data && mount -t ext4 "/dev/${{b##*/}}" /data || echo "forkd init: mount /data failed";;
    {pkgs_serial}) pkgs="/dev/${{b##*/}}";;
  esac
done
hostname forkd
export PATH=/usr/local/bin:/usr/bin:/bin:/sbin HOME=/root LANG=C.UTF-8 PYTHONHOME=/usr PYTHONPATH=/opt/forkd
export PYTHONDONTWRITEBYTECODE=1 FORKD_SANDBOX=1
if [ -n "$pkgs" ]; then
  # The packages disk (read-only ext4): each of its top-level directories goes under the initramfs's
  # own as an overlayfs lower layer, writable through a tmpfs upper layer.
  r=/run/forkd-pkgs
  mkdir -p $r/ro $r/rw
  if ! mount -t ext4 -o ro,noload "$pkgs" $r/ro; then
    echo "forkd init: mount of the packages disk $pkgs failed"
  elif for m in {pkgs_modules}; do insmod "$m"; done; grep -qw overlay /proc/filesystems &&
       mount -t tmpfs -o mode=0755 pkgs $r/rw; then
    for d in $r/ro/*; do
      n=${{d##*/}}
      case "$n" in lost+found|proc|sys|dev|run|tmp|data) continue;; esac
      [ -d "$d" ] && [ ! -L "$d" ] || continue
      mkdir -p "/$n" "$r/rw/$n/u" "$r/rw/$n/w"
      mount -t overlay "pkgs-$n" -o "lowerdir=$d:/$n,upperdir=$r/rw/$n/u,workdir=$r/rw/$n/w" "/$n" ||
        echo "forkd init: overlay of /$n failed"
    done
    export PYTHONPATH=$PYTHONPATH:/usr/lib/python3/dist-packages
  else
    # No overlayfs: use the disk where it is mounted.
    echo "forkd init: no overlayfs, packages stay under $r/ro"
    a=/usr/lib/x86_64-linux-gnu
    export PATH=$PATH:$r/ro/usr/bin:$r/ro/bin PYTHONPATH=$PYTHONPATH:$r/ro/usr/lib/python3/dist-packages
    export LD_LIBRARY_PATH=$r/ro$a:$r/ro/lib/x86_64-linux-gnu:$r/ro$a/blas:$r/ro$a/lapack
  fi
fi
# /etc/machine-id bound over itself, as a process sandbox's is: it cannot be removed or renamed
# over, so the agent writes each child's id into the one file it keeps open (serial.RestoreFiles).
: >> /etc/machine-id && mount -o bind /etc/machine-id /etc/machine-id ||
  echo "forkd init: bind mount of /etc/machine-id failed"
cd /root
exec /usr/bin/python3.11 -S -u -m {agent}
"""


# --- cpio (newc) -------------------------------------------------------------------------------

class Cpio:
    def __init__(self, f):
        self.f = f
        self.ino = 1000

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0),
               mtime: int = 0) -> None:
        self.ino += 1
        name_b = name.lstrip("/").encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, mtime, len(data), 0, 0, rdev[0], rdev[1], len(name_b), 0]
        hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.f.write(hdr + name_b)
        self.f.write(b"\0" * ((-len(hdr) - len(name_b)) % 4))
        self.f.write(data)
        self.f.write(b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        self._entry(name, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644, mtime: int = 0) -> None:
        self._entry(name, stat.S_IFREG | mode, data, mtime=mtime)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def chardev(self, name: str, major: int, minor: int) -> None:
        self._entry(name, stat.S_IFCHR | 0o600, rdev=(major, minor))

    def close(self) -> None:
        self._entry("TRAILER!!!", 0)


def _add_tree(cpio: Cpio, src: str, dest: str, seen: set[str]) -> None:
    """Add ``src`` (a directory) as ``dest``, keeping symlinks, file modes and mtimes."""
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in PY_DROP_DIRS and not d.startswith("config-3"))
        rel = os.path.relpath(root, src)
        target_root = dest if rel == "." else os.path.join(dest, rel)
        _add_dirs(cpio, target_root, seen)
        for fname in sorted(files):
            if fname.endswith(".so") and PY_DROP_EXT.match(fname):
                continue
            p = os.path.join(root, fname)
            t = os.path.join(target_root, fname)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                cpio.symlink(t, os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    cpio.file(t, f.read(), st.st_mode & 0o777, int(st.st_mtime))
            seen.add(t)


def _add_dirs(cpio: Cpio, path: str, seen: set[str]) -> None:
    parts = path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        if d not in seen:
            cpio.dir(d)
            seen.add(d)


def _agent_sources() -> dict[str, bytes]:
    agent_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agent")
    out = {}
    for name in sorted(os.listdir(agent_dir)):
        if name.endswith(".py"):
            with open(os.path.join(agent_dir, name), "rb") as f:
                out[name] = f.read()
    return out


def image_key(debs: dict[str, str]) -> str:
    h = hashlib.sha256()
    h.update(BUILDER_VERSION.encode())
    with open(os.path.abspath(__file__), "rb") as f:
        h.update(f.read())
    for name, data in _agent_sources().items():
        h.update(name.encode() + b"\0" + data)
    for pkg in sorted(debs):
        h.update(os.path.basename(debs[pkg]).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def cache_lock(cache_dir: str):
    """Held while building into ``cache_dir``: engines sharing one cache (several servers or test
    runs, $FORKD_VM_CACHE) wait for the build under way and reuse it instead of repeating it."""
    fd = os.open(os.path.join(cache_dir, ".build.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_image(cache_dir: str, *, log=None) -> Image:
    """Build (or reuse) the guest image under ``cache_dir``; returns its paths."""
    cache_dir = os.path.realpath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    with cache_lock(cache_dir):
        return _build_image(cache_dir, log)


def _build_image(cache_dir: str, log) -> Image:
    debs = fetch_debs(cache_dir)
    key = image_key(debs)
    out_dir = os.path.join(cache_dir, "images", key)
    manifest = os.path.join(out_dir, "image.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            return Image(**json.load(f))
    say = log or (lambda msg: None)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".build-{key}-", dir=os.path.dirname(out_dir))
    try:
        root = os.path.join(work, "x")
        for pkg, deb in debs.items():
            say(f"unpacking {os.path.basename(deb)}")
            run(["dpkg-deb", "-x", deb, root])
        vmlinuz = glob.glob(os.path.join(root, "boot", "vmlinuz-*"))
        if not vmlinuz:
            raise ImageError("the kernel package holds no /boot/vmlinuz-*")
        kver = os.path.basename(vmlinuz[0])[len("vmlinuz-"):]
        stage = os.path.join(work, "out")
        os.makedirs(stage)
        say("extracting vmlinux")
        extract_vmlinux(vmlinuz[0], os.path.join(stage, "vmlinux"))
        py = os.path.join(root, "usr", "bin", "python3.11")
        pylib = os.path.join(root, "usr", "lib", "python3.11")
        for d in PY_DROP_DIRS | {"site-packages"}:
            shutil.rmtree(os.path.join(pylib, d), ignore_errors=True)
        say("compiling the standard library")
        # Byte-compile with the guest's own interpreter, so the guest never compiles at boot.
        env = dict(os.environ, PYTHONHOME=os.path.join(root, "usr"))
        run([py, "-S", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash", pylib],
            env=env)
        dynload = [os.path.join(pylib, "lib-dynload", f) for f in os.listdir(os.path.join(pylib, "lib-dynload"))
                   if not PY_DROP_EXT.match(f)]
        libs = _ldd([py, *dynload])
        modules = _module_order(os.path.join(root, "lib", "modules", kver), GUEST_MODULES)
        if not any(m.endswith("virtio_console.ko") for m in modules):
            raise ImageError(f"kernel {kver} has no virtio_console module")
        pkgs_modules = [m for m in _module_order(os.path.join(root, "lib", "modules", kver), PACKAGES_MODULES)
                        if m not in modules]
        busybox = os.path.join(root, "bin", "busybox")
        applets = run([busybox, "--list-full"]).stdout.decode().split()

        say("writing initrd.cpio")
        seen: set[str] = set()
        with open(os.path.join(stage, "initrd.cpio"), "wb") as f:
            cpio = Cpio(f)
            for d in ("/bin", "/sbin", "/usr/bin", "/usr/sbin", "/usr/lib", "/lib", "/lib64", "/proc", "/sys",
                      "/dev", "/tmp", "/root", "/etc", "/run", "/var", "/var/tmp", "/opt/forkd/forkd_engine/agent",
                      "/lib/modules"):
                _add_dirs(cpio, d, seen)
            cpio.chardev("/dev/console", 5, 1)
            cpio.chardev("/dev/null", 1, 3)
            with open(busybox, "rb") as b:
                cpio.file("/bin/busybox", b.read(), 0o755)
            seen.add("/bin/busybox")
            for applet in applets:
                path = "/" + applet.lstrip("/")
                if path not in seen and os.path.dirname(path) in seen:
                    cpio.symlink(path, "/bin/busybox")
                    seen.add(path)
            with open(py, "rb") as b:
                cpio.file("/usr/bin/python3.11", b.read(), 0o755)
            for alias in ("/usr/bin/python3", "/usr/bin/python"):
                cpio.symlink(alias, "python3.11")
            _add_tree(cpio, pylib, "/usr/lib/python3.11", seen)
            for lib in sorted(libs):
                _add_dirs(cpio, os.path.dirname(lib), seen)
                if lib not in seen:
                    with open(lib, "rb") as b:
                        cpio.file(lib, b.read(), 0o755)
                    seen.add(lib)
            mod_paths = []
            for m in modules + pkgs_modules:
                dest = "/lib/modules/" + os.path.basename(m)
                with open(m, "rb") as b:
                    cpio.file(dest, b.read())
                mod_paths.append(dest)
            pkgs_mod_paths, mod_paths = mod_paths[len(modules):], mod_paths[:len(modules)]
            cpio.file("/opt/forkd/forkd_engine/__init__.py", b'"""forkd guest agent (stub package)."""\n')
            for name, data in _agent_sources().items():
                cpio.file(f"/opt/forkd/forkd_engine/agent/{name}", data)
            cpio.file("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
            cpio.file("/etc/group", b"root:x:0:\n")
            cpio.file("/etc/hostname", b"forkd\n")
            init = INIT.format(modules=" ".join(mod_paths), agent=AGENT_MODULE, data_serial=DATA_SERIAL,
                               pkgs_serial=PACKAGES_SERIAL, pkgs_modules=" ".join(pkgs_mod_paths))
            cpio.file("/init", init.encode(), 0o755)
            cpio.close()
        info = Image(key=key, dir=out_dir, kernel=os.path.join(out_dir, "vmlinux"),
                     initrd=os.path.join(out_dir, "initrd.cpio"), kernel_version=kver)
        with open(os.path.join(stage, "image.json"), "w") as f:
            json.dump(info.to_dict(), f)
        try:
            os.rename(stage, out_dir)
        except OSError:
            if not os.path.exists(manifest):  # not a concurrent build that won the race
                raise
        return info
    finally:
        shutil.rmtree(work, ignore_errors=True)
