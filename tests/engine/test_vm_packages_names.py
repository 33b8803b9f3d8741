"""The packages image's pure parts: package names, alternatives, resolving with apt (no QEMU)."""

from __future__ import annotations

import shutil

import pytest

from forkd_engine.vm.image import ImageError
from forkd_engine.vm.packages import (BASE_PROVIDES, _alternatives, _apply_alternatives, _deb822, resolve_packages,
                                      validate_packages)


@pytest.mark.parametrize("names, expected", [
    (["python3-numpy"], ["python3-numpy"]),
    (["python3-scipy", "python3-numpy", "python3-numpy"], ["python3-numpy", "python3-scipy"]),
    (["libstdc++6", "g++-12", "libc6.1", "r-base"], ["g++-12", "libc6.1", "libstdc++6", "r-base"]),
    ([], []),
])
def test_valid_names_sorted_and_unique(names, expected):
    assert validate_packages(names) == expected


@pytest.mark.parametrize("bad", ["Numpy", "numpy!", "a", "-numpy", ".numpy", "python3-numpy=1:1.24",
                                 "python3-numpy:amd64", "numpy/bookworm", "num py", "python3-numpy\n", "",
                                 "x" * 101, 7, None])
def test_invalid_names_are_refused_with_the_rule(bad):
    with pytest.raises(ImageError, match="not a Debian package name") as info:
        validate_packages(["python3-numpy", bad])
    assert repr(bad) in str(info.value) and "apt-cache search" in str(info.value)


@pytest.mark.parametrize("bad", ["python3-numpy", b"numpy", {"python3-numpy": 1}, None])
def test_packages_must_be_a_list(bad):
    with pytest.raises(ImageError, match="must be a list"):
        validate_packages(bad)


def test_too_many_packages():
    with pytest.raises(ImageError, match="at most"):
        validate_packages([f"pkg{i}" for i in range(65)])


LIBBLAS3_POSTINST = """#!/bin/sh

set -e

update-alternatives --install /usr/lib/x86_64-linux-gnu/libblas.so.3 \\
                    libblas.so.3-x86_64-linux-gnu /usr/lib/x86_64-linux-gnu/blas/libblas.so.3 10

update-alternatives --quiet --install /usr/bin/ed ed /usr/bin/ed.real 20 \\
    --slave /usr/share/man/man1/ed.1.gz ed.1.gz /usr/share/man/man1/ed.real.1.gz
update-alternatives --install /usr/bin/x x "$X" 5
exit 0
"""


def test_alternatives_from_a_postinst(tmp_path):
    alts = _alternatives(LIBBLAS3_POSTINST)
    assert alts == [
        ("/usr/lib/x86_64-linux-gnu/libblas.so.3", "libblas.so.3-x86_64-linux-gnu",
         "/usr/lib/x86_64-linux-gnu/blas/libblas.so.3", 10, []),
        ("/usr/bin/ed", "ed", "/usr/bin/ed.real", 20,
         [("/usr/share/man/man1/ed.1.gz", "/usr/share/man/man1/ed.real.1.gz")]),
    ]  # the third is computed by the script ("$X"): not guessed
    tree = tmp_path / "tree"
    (tree / "usr/lib/x86_64-linux-gnu/blas").mkdir(parents=True)
    (tree / "usr/lib/x86_64-linux-gnu/blas/libblas.so.3").write_bytes(b"ELF")
    low = ("/usr/lib/x86_64-linux-gnu/libblas.so.3", "libblas.so.3-x86_64-linux-gnu",
           "/usr/lib/x86_64-linux-gnu/other/libblas.so.3", 99, [])  # higher priority, but not in the tree
    _apply_alternatives(str(tree), alts + [low])
    link = tree / "usr/lib/x86_64-linux-gnu/libblas.so.3"
    assert link.is_symlink() and str(link.readlink()) == "blas/libblas.so.3" and link.read_bytes() == b"ELF"
    assert not (tree / "usr/bin/ed").exists()  # its target is not in the tree


def test_deb822_keeps_continuation_lines():
    recs = _deb822("Package: a\nProvides: x,\n y\n\nPackage: b\nVersion: 1\n")
    assert recs == [[("Package", "a"), ("Provides", "x,\n y")], [("Package", "b"), ("Version", "1")]]


@pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt")
def test_resolve_numpy_adds_only_what_the_base_lacks():
    try:
        found = resolve_packages(["python3-numpy"])
    except ImageError as exc:
        pytest.skip(f"apt cannot resolve here: {exc}")
    names = {n for n, _v, _a in found}
    assert {"python3-numpy", "libblas3", "liblapack3", "libgfortran5"} <= names
    assert not names & set(BASE_PROVIDES)          # no second interpreter or libc
    assert not names & {"libopenblas0-pthread", "libatlas3-base", "dpkg"}  # one BLAS, no metapackage deps
    assert resolve_packages(["python3", "libc6"]) == []
    with pytest.raises(ImageError, match="unknown Debian package 'no-such-package-forkd'.*apt-cache search"):
        resolve_packages(["no-such-package-forkd"])
    with pytest.raises(ImageError, match="virtual package.*libblas3"):
        resolve_packages(["libblas.so.3"])
