"""The guest image: Debian's cloud kernel and an initramfs holding busybox, Debian's python3.11
and the forkd guest agent, all taken from Debian's packages with ``apt-get download``.

``build_image(cache_dir)`` returns an :class:`Image` (paths to ``vmlinux`` and ``initrd.cpio``). The
result is cached under ``cache_dir/images/<key>``, where the key hashes every input: the .deb files
(their names carry the versions), this builder and the agent's sources. Changing any of them builds a
new image; an unchanged one is reused at once.

``build_packages_image(cache_dir, packages)`` makes the optional second disk: a read-only ext4 image
holding more Debian packages (e.g. ``python3-numpy``) and everything they depend on that the base
image lacks, cached under ``cache_dir/packages/<key>``. The guest's /init finds it by its virtio
serial and lays it under ``/`` with overlayfs.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
import time
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
PACKAGES_FILE = "packages.ext4"  # the packages disk, in its cache entry and in every snapshot using it
PY_DROP_DIRS = {"test", "idlelib", "tkinter", "ensurepip", "lib2to3", "pydoc_data", "dist-packages",
                "turtledemo"}
# _sqlite3 stays: IPython (the forkd kernel's shell in a VM) imports it even with its history off.
PY_DROP_EXT = re.compile(r"^(_test|_ctypes_test|_xxtestfuzz|xxlimited|_ssl|_hashlib|_curses|"
                         r"_tkinter|readline|_dbm|nis|ossaudiodev|_xxsubinterpreters)")
AGENT_MODULE = "forkd_engine.agent.serial"
BUILDER_VERSION = "2"


class ImageError(Exception):
    """The guest image could not be built; the message says which step failed."""


class PackageNotFound(ImageError):
    """A requested package name is malformed, unknown, virtual or not installable here."""


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


def _run(cmd: list[str], cwd: str | None = None, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, **kw)
    except FileNotFoundError as exc:
        raise ImageError(f"{cmd[0]} is not installed (scripts/setup.sh installs it)") from exc
    except subprocess.CalledProcessError as exc:
        err = (exc.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise ImageError(f"{' '.join(cmd)} failed: {err}") from exc


# --- downloading the .debs ---------------------------------------------------------------------

def _kernel_package() -> str:
    out = _run(["apt-cache", "depends", KERNEL_META]).stdout.decode()
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
        _run(["apt-get", "download", *missing], cwd=deb_dir)
    except ImageError:
        _run(["apt-get", "update", "-qq"])
        _run(["apt-get", "download", *missing], cwd=deb_dir)


def fetch_debs(cache_dir: str) -> dict[str, str]:
    """Download (once) the packages the image is made of; returns {package: deb path}."""
    deb_dir = os.path.join(cache_dir, "debs")
    os.makedirs(deb_dir, exist_ok=True)
    have_kernel = glob.glob(os.path.join(deb_dir, "linux-image-[0-9]*-cloud-amd64_*.deb"))
    try:
        kernel_pkg = _kernel_package() if not have_kernel else os.path.basename(have_kernel[0]).split("_")[0]
    except ImageError:
        _run(["apt-get", "update", "-qq"])
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


def build_image(cache_dir: str, *, log=None) -> Image:
    """Build (or reuse) the guest image under ``cache_dir``; returns its paths."""
    cache_dir = os.path.realpath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
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
            _run(["dpkg-deb", "-x", deb, root])
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
        _run([py, "-S", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash", pylib],
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
        applets = _run([busybox, "--list-full"]).stdout.decode().split()

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


# --- the packages image (an optional read-only ext4 disk) ----------------------------------------

PACKAGES_BUILDER_VERSION = "2"
PACKAGE_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+")  # Debian policy 5.6.1
MAX_PACKAGES = 64
# What the base image already holds. They are marked installed when resolving, so a packages image
# never carries a second interpreter or C library: the interpreter (the base has the binary, the
# standard library and /usr/bin/python3), the metapackages around it (symlinks and docs), and libc6
# (the base's glibc and loader; a second copy laid over them would mix two C libraries).
BASE_PROVIDES = (*PYTHON_PACKAGES, "python3.11", "python3", "python3-minimal", "libpython3-stdlib", "libc6")
STATUS_FIELDS = ("Package", "Version", "Architecture", "Multi-Arch", "Provides", "Essential")
APT_LISTS = "/var/lib/apt/lists"
# update-alternatives --install LINK NAME PATH PRIORITY [--slave LINK NAME PATH]...
ALT_INSTALL = re.compile(r"update-alternatives\s+(?:--\S+\s+)*?--install\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+)"
                         r"((?:\s+--slave\s+\S+\s+\S+\s+\S+)*)")


def validate_packages(packages) -> list[str]:
    """The Debian package names in ``packages``, sorted and unique; ImageError names a bad one."""
    if isinstance(packages, (str, bytes)) or not isinstance(packages, (list, tuple)):
        raise PackageNotFound('packages must be a list of Debian package names, e.g. ["python3-numpy"]')
    if len(packages) > MAX_PACKAGES:
        raise PackageNotFound(f"at most {MAX_PACKAGES} packages (their dependencies come along by themselves)")
    for name in packages:
        if not isinstance(name, str) or len(name) > 100 or not PACKAGE_NAME.fullmatch(name):
            raise PackageNotFound(f"{name!r} is not a Debian package name: lower-case letters, digits, '+', '-' "
                             "and '.', at least two characters, starting with a letter or a digit, no "
                             "version or architecture (find names with `apt-cache search WORD`)")
    return sorted(set(packages))


def _deb822(text: str) -> list[list[tuple[str, str]]]:
    """Records of an apt/dpkg control text as lists of (field, value), continuation lines kept."""
    records, fields = [], []
    for line in text.splitlines():
        if not line.strip():
            if fields:
                records.append(fields)
            fields = []
        elif line[0] in " \t" and fields:
            fields[-1] = (fields[-1][0], fields[-1][1] + "\n" + line)
        elif ":" in line:
            name, value = line.split(":", 1)
            fields.append((name, value.strip()))
    if fields:
        records.append(fields)
    return records


_status_memo: dict[str, str] = {}


def _base_status(path: str) -> None:
    """A dpkg status file in which exactly the base image's packages are installed (no dependencies
    listed, so apt sees nothing to repair). Remembered while apt's lists stay as they are."""
    lists = _lists_fingerprint()
    text = _status_memo.get(lists)
    if text is None:
        out = _run(["apt-cache", "show", "--no-all-versions", *BASE_PROVIDES]).stdout.decode()
        text = "".join("".join(f"{name}: {value}\n" for name, value in rec if name in STATUS_FIELDS)
                       + "Status: install ok installed\n\n" for rec in _deb822(out))
        _status_memo.clear()
        _status_memo[lists] = text
    with open(path, "w") as f:
        f.write(text)


def _lists_fingerprint() -> str:
    """Names, sizes and times of apt's package lists: changes whenever ``apt-get update`` changed them."""
    h = hashlib.sha256()
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(APT_LISTS)):
            st = os.stat(os.path.join(APT_LISTS, name))
            if stat.S_ISREG(st.st_mode) and name != "lock":
                h.update(f"{name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _lists_present() -> bool:
    with contextlib.suppress(OSError):
        return any("_Packages" in n for n in os.listdir(APT_LISTS))
    return False


def resolve_packages(packages: list[str]) -> list[tuple[str, str, str]]:
    """(name, version, architecture) of ``packages`` and every dependency the base image lacks, as
    apt's own solver picks them (no recommends, first alternative), on top of the base image's packages."""
    # Named base packages are there already (asked for anyway, apt would "upgrade" them: their status
    # entries carry no dependencies, so apt takes them for other builds of the same version).
    names = [n for n in validate_packages(packages) if n not in BASE_PROVIDES]
    if not names:
        return []
    if not _lists_present():
        _run(["apt-get", "update", "-qq"])
    with tempfile.TemporaryDirectory(prefix="forkd-apt-") as tmp:
        status = os.path.join(tmp, "status")
        _base_status(status)
        proc = subprocess.run(["apt-get", "-s", "-q", "-o", f"Dir::State::status={status}",
                               "-o", "APT::Install-Recommends=0", "-o", "APT::Install-Suggests=0",
                               "install", *names], capture_output=True, text=True, env=dict(os.environ, LC_ALL="C"))
    if proc.returncode != 0:
        out = proc.stdout + proc.stderr
        unknown = re.findall(r"Unable to locate package (\S+)", out)
        if unknown:
            raise PackageNotFound(f"unknown Debian package {unknown[0]!r}: apt has no package of that name on this "
                             "host (find names with `apt-cache search WORD`; run `apt-get update` if the "
                             "package lists are old)")
        m = re.search(r"Package (\S+) is a virtual package provided by:\n((?:  .*\n)+)", out)
        if m:
            providers = ", ".join(line.split()[0] for line in m.group(2).splitlines())
            raise PackageNotFound(f"{m.group(1)!r} is a virtual package; name one of the packages that provide it: "
                             f"{providers}")
        m = re.search(r"Package '?([^' ]+)'? has no installation candidate", out)
        if m:
            raise PackageNotFound(f"Debian package {m.group(1)!r} has no installable version on this host")
        raise ImageError(f"apt could not resolve {' '.join(names)}: {out.strip()[-1500:]}")
    found = []
    for m in re.finditer(r"^Inst (\S+) (?:\[[^\]]*\] )?\((\S+) .*\[([^\]]+)\]\)", proc.stdout, re.M):
        if m.group(1).split(":")[0] not in BASE_PROVIDES:  # never a second interpreter or C library
            found.append((m.group(1).split(":")[0], m.group(2), m.group(3)))
    return sorted(found)


def _deb_file(name: str, version: str, arch: str) -> str:
    return f"{name}_{version.replace(':', '%3a')}_{arch}.deb"  # as apt-get download names it


def _download_exact(deb_dir: str, pkgs: list[tuple[str, str, str]]) -> list[str]:
    missing = [p for p in pkgs if not os.path.exists(os.path.join(deb_dir, _deb_file(*p)))]
    if missing:
        with contextlib.suppress(OSError):
            os.chmod(deb_dir, 0o777)  # apt-get downloads as _apt
        args = [f"{n}={v}" for n, v, _a in missing]
        try:
            _run(["apt-get", "download", *args], cwd=deb_dir)
        except ImageError:
            _run(["apt-get", "update", "-qq"])
            _run(["apt-get", "download", *args], cwd=deb_dir)
    paths = [os.path.join(deb_dir, _deb_file(*p)) for p in pkgs]
    for p in paths:
        if not os.path.exists(p):
            raise ImageError(f"apt-get download left no {os.path.basename(p)} in {deb_dir}")
    return paths


def packages_key(deb_paths: list[str]) -> str:
    h = hashlib.sha256(f"packages-{PACKAGES_BUILDER_VERSION}\0".encode())
    for name in sorted(os.path.basename(p) for p in deb_paths):
        h.update(name.encode() + b"\0")
    return h.hexdigest()[:16]


def _alternatives(postinst: str) -> list[tuple[str, str, str, int, list[tuple[str, str]]]]:
    """The ``update-alternatives --install`` calls of a maintainer script:
    (link, name, path, priority, [(slave link, slave path)])."""
    out = []
    for m in ALT_INSTALL.finditer(postinst.replace("\\\n", " ")):
        link, name, path, prio, slaves = m.groups()
        if any(c in "".join((link, name, path, slaves)) for c in "$`'\""):
            continue  # computed in the script: not something to guess
        sl = re.findall(r"--slave\s+(\S+)\s+\S+\s+(\S+)", slaves)
        out.append((link, name, path, int(prio), sl))
    return out


def _apply_alternatives(tree: str, alts: list) -> None:
    """What ``update-alternatives`` would have done (``dpkg-deb -x`` runs no scripts): each link points
    at its highest-priority choice present in the tree, directly (relative, no /etc/alternatives)."""
    best: dict[str, tuple] = {}
    for alt in alts:
        link, name, path, prio, _sl = alt
        if os.path.lexists(tree + path) and (name not in best or prio > best[name][3]):
            best[name] = alt
    for link, _name, path, _prio, slaves in best.values():
        for lnk, target in [(link, path), *slaves]:
            dest = tree + lnk
            if os.path.lexists(dest) or not os.path.lexists(tree + target):
                continue
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.symlink(os.path.relpath(target, os.path.dirname(lnk)), dest)


def _compile_python(cache_dir: str, work: str, tree: str) -> None:
    """Byte-compile the tree's Python with the guest's interpreter (unchecked-hash pycs, paths as the
    guest sees them), so the guest never compiles an import."""
    dirs = [d for d in ("/usr/lib/python3", "/usr/lib/python3.11") if os.path.isdir(tree + d)]
    if not dirs:
        return
    pyroot = os.path.join(work, "python")
    debs = fetch_debs(cache_dir)
    for pkg in PYTHON_PACKAGES:
        _run(["dpkg-deb", "-x", debs[pkg], pyroot])
    env = dict(os.environ, PYTHONHOME=os.path.join(pyroot, "usr"))
    proc = subprocess.run([os.path.join(pyroot, "usr", "bin", "python3.11"), "-S", "-m", "compileall", "-q",
                           "-j", "0", "--invalidation-mode", "unchecked-hash", "-s", tree, "-p", "/",
                           *(tree + d for d in dirs)], capture_output=True, env=env)
    if proc.returncode not in (0, 1):  # 1: some file does not compile (the guest then compiles it itself)
        raise ImageError(f"byte-compiling the packages failed: {proc.stderr.decode(errors='replace')[-1500:]}")


def _make_ext4(tree: str, out: str) -> None:
    """A read-only ext4 image of ``tree``, sized to fit (no journal, no reserved blocks)."""
    blocks = inodes = 0
    for root, dirs, files in os.walk(tree):
        inodes += len(dirs) + len(files)
        blocks += len(dirs)
        for f in files:
            st = os.lstat(os.path.join(root, f))
            if stat.S_ISREG(st.st_mode) or (stat.S_ISLNK(st.st_mode) and st.st_size >= 60):
                blocks += -(-st.st_size // 4096)
    inodes += 64
    size = (blocks * 4096 * 21 // 20 + inodes * 256 + (8 << 20) + (1 << 20) - 1) >> 20 << 20
    for _attempt in range(3):
        with open(out, "wb") as f:
            f.truncate(size)
        try:
            _run(["mkfs.ext4", "-q", "-F", "-L", PACKAGES_SERIAL, "-b", "4096", "-m", "0", "-N", str(inodes),
                  "-O", "^has_journal,^resize_inode", "-E", "root_owner=0:0", "-d", tree, out])
            return
        except ImageError as exc:
            if "allocate" not in str(exc) and "No space" not in str(exc) and "full" not in str(exc):
                raise
            size = size * 3 // 2  # the estimate was short
    raise ImageError(f"mkfs.ext4 could not fit {tree} in {size >> 20} MiB")


def _remember(request: str, key: str | None) -> None:
    os.makedirs(os.path.dirname(request), exist_ok=True)
    tmp = f"{request}.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump({"key": key}, f)
    os.replace(tmp, request)


def _request_file(root: str, names: list[str]) -> str:
    """Where the answer for ``names`` is remembered while apt's package lists stay as they are (so an
    unchanged request skips apt's ~2 s of resolving)."""
    h = hashlib.sha256(f"{PACKAGES_BUILDER_VERSION}\0{' '.join(names)}\0{_lists_fingerprint()}".encode())
    return os.path.join(root, "requests", h.hexdigest()[:24] + ".json")


def build_packages_image(cache_dir: str, packages: list[str], *, log=None) -> str | None:
    """Build (or reuse) a read-only ext4 image holding ``packages`` and the dependencies the base image
    lacks; returns its path, or None when the base image already has them all."""
    say = log or (lambda msg: None)
    cache_dir = os.path.realpath(cache_dir)
    names = validate_packages(packages)
    root = os.path.join(cache_dir, "packages")
    request = _request_file(root, names)
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(request) as f:
            key = json.load(f)["key"]
        if key is None:
            return None
        if os.path.exists(os.path.join(root, key, "packages.json")):
            return os.path.join(root, key, PACKAGES_FILE)
    pkgs = resolve_packages(names)
    if not pkgs:
        _remember(request, None)
        return None
    deb_dir = os.path.join(cache_dir, "debs")
    os.makedirs(deb_dir, exist_ok=True)
    debs = _download_exact(deb_dir, pkgs)
    key = packages_key(debs)
    out_dir = os.path.join(root, key)
    image = os.path.join(out_dir, PACKAGES_FILE)
    if os.path.exists(os.path.join(out_dir, "packages.json")):
        _remember(request, key)
        return image
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".build-{key}-", dir=root)
    try:
        t0 = time.monotonic()
        tree = os.path.join(work, "tree")
        alts = []
        for deb in debs:
            say(f"unpacking {os.path.basename(deb)}")
            _run(["dpkg-deb", "-x", deb, tree])
            # Its postinst (if any): dpkg-deb -x runs no maintainer scripts, alternatives are made below.
            postinst = subprocess.run(["dpkg-deb", "--info", deb, "postinst"], capture_output=True)
            if postinst.returncode == 0:
                alts += _alternatives(postinst.stdout.decode(errors="replace"))
        _apply_alternatives(tree, alts)
        say("compiling Python modules")
        _compile_python(cache_dir, work, tree)
        stage = os.path.join(work, "out")
        os.makedirs(stage)
        say(f"writing {PACKAGES_FILE}")
        _make_ext4(tree, os.path.join(stage, PACKAGES_FILE))
        os.chmod(os.path.join(stage, PACKAGES_FILE), 0o444)
        with open(os.path.join(stage, "packages.json"), "w") as f:
            json.dump({"key": key, "requested": names, "debs": [os.path.basename(d) for d in debs],
                       "size": os.path.getsize(os.path.join(stage, PACKAGES_FILE)),
                       "build_s": round(time.monotonic() - t0, 2)}, f)
        try:
            os.rename(stage, out_dir)
        except OSError:
            if not os.path.exists(os.path.join(out_dir, "packages.json")):  # lost a race to an equal build
                raise
        _remember(request, key)
        return image
    finally:
        shutil.rmtree(work, ignore_errors=True)
