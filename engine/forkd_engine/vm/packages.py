"""The packages disk: an optional read-only ext4 image holding more Debian packages (e.g.
``python3-numpy``) and everything they depend on that the base image lacks, resolved with apt's own
solver over the base image's packages, cached under ``cache_dir/packages/<key>``.

``build_packages_image(cache_dir, packages)`` returns its path (None when the base image has them
all); ``validate_packages`` is the name check the server runs before any engine is asked.

Its own room because it is a second, independent builder: apt resolution, maintainer-script
alternatives, byte-compiling and ``mkfs.ext4``, with its own cache key, while the guest image
(``image.py``) only provides the interpreter the packages are compiled with and the /init that
mounts the disk.
"""

from __future__ import annotations

import contextlib
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

from .image import PACKAGES_SERIAL, PYTHON_PACKAGES, ImageError, cache_lock, fetch_debs, run

PACKAGES_FILE = "packages.ext4"  # the packages disk, in its cache entry and in every snapshot using it
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


class PackageNotFound(ImageError):
    """A requested package name is malformed, unknown, virtual or not installable here."""


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
        out = run(["apt-cache", "show", "--no-all-versions", *BASE_PROVIDES]).stdout.decode()
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
        run(["apt-get", "update", "-qq"])
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
            run(["apt-get", "download", *args], cwd=deb_dir)
        except ImageError:
            run(["apt-get", "update", "-qq"])
            run(["apt-get", "download", *args], cwd=deb_dir)
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
        run(["dpkg-deb", "-x", debs[pkg], pyroot])
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
            run(["mkfs.ext4", "-q", "-F", "-L", PACKAGES_SERIAL, "-b", "4096", "-m", "0", "-N", str(inodes),
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
    found = _remembered(root, request)
    if found is not False:
        return found
    os.makedirs(cache_dir, exist_ok=True)
    with cache_lock(cache_dir):
        found = _remembered(root, request)  # built meanwhile by another engine sharing the cache
        return _build_packages_image(cache_dir, root, request, names, say) if found is False else found


def _remembered(root: str, request: str) -> str | None | bool:
    """The image remembered for ``request`` (None: the base image has every package), else False."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        with open(request) as f:
            key = json.load(f)["key"]
        if key is None:
            return None
        if os.path.exists(os.path.join(root, key, "packages.json")):
            return os.path.join(root, key, PACKAGES_FILE)
    return False


def _build_packages_image(cache_dir: str, root: str, request: str, names: list[str], say) -> str | None:
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
            run(["dpkg-deb", "-x", deb, tree])
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
