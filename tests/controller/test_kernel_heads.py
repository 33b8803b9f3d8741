"""The forkd kernels' HEAD records (forkd_server/controller/kernels.py): a kernel its Jupyter server stopped
leaves its notebook's HEAD behind, and the notebook's next kernel is told it once."""

from __future__ import annotations

import os

from forkd_server.controller.kernels import KernelHeads
from forkd_server.controller.registry import Registry


def heads(short_dir) -> tuple[KernelHeads, Registry, list]:
    registry = Registry(os.path.join(short_dir, "r.sqlite3"))
    said: list = []
    return KernelHeads(registry, lambda *a, **kw: said.append((a, kw))), registry, said


def test_the_next_kernel_of_a_notebook_is_told_once_where_its_stopped_kernel_ran(short_dir):
    kernels, registry, said = heads(short_dir)
    try:
        kernels.set_head("k1", "sb-old", notebook="work/a.ipynb")
        kernels.set_head("k9", "sb-other", notebook="b.ipynb")
        kernels.leave("k1")
        assert [k["kernel_id"] for k in kernels.list()] == ["k9"]  # no HEAD of a kernel that is gone
        assert (("kernel", "gone"), {"kernel_id": "k1"}) in said
        assert "left" not in kernels.set_head("k2", "sb-x", notebook="b.ipynb")  # another notebook's
        first = kernels.set_head("k3", "sb-new", notebook="work/a.ipynb")
        assert first["left"]["head"] == "sb-old" and first["left"]["kernel_id"] == "k1", first
        assert "left" not in kernels.set_head("k3", "sb-newer", notebook="work/a.ipynb")  # said once
    finally:
        registry.close()


def test_what_a_stopped_kernel_leaves_outlives_the_server_and_is_never_its_own_head(short_dir):
    kernels, registry, _ = heads(short_dir)
    kernels.set_head("k1", "sb-old", notebook="a.ipynb")
    kernels.set_head("k2", "sb-plain")  # a kernel with no notebook leaves nothing to tell
    kernels.leave("k1")
    kernels.leave("k2")
    kernels.leave("k-never")  # forgot itself meanwhile: nothing to do
    registry.close()
    kernels, registry, _ = heads(short_dir)  # a server restart
    try:
        assert kernels.list() == []
        assert "left" not in kernels.set_head("k4", "sb-old", notebook="a.ipynb")  # it is HEAD again: nothing to say
        kernels.leave("k4")
        assert kernels.set_head("k5", "sb-fresh", notebook="a.ipynb")["left"]["head"] == "sb-old"
    finally:
        registry.close()
