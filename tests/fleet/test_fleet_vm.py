"""A VM snapshot moves to where there is room: two ``forkd serve`` hosts on the VM engine, each in a
network namespace of its own (tests/fleet/netns.py) with its own data dir, cgroup group and guest-image
cache, capped at two sandboxes; the router in the root namespace; the store they share moto's S3 on
a root-namespace address that each host reaches through its link. A snapshot created through the
router lands on one host (the holder), which has not pushed it; from then on no host has a guest
image (not even the one the snapshot names: as on a fleet of machines). A spawn of 3 places two
children on the holder and one on the other host, which pulls it (every chunk fetched once) after
the holder pushed it on demand, and restores it with no image (a restored child's RAM holds its
kernel). A live branch of that child stays on its host, and so does the branch's first child; with
that host full, the next child of the branch goes to the holder, which downloads only the chunks
of the branch it lacks.

A notebook's fork tree its host cannot hold spans both hosts: the forkd kernel on the VM engine
pointed at the router, and promote across hosts by a host's rules."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sqlite3
from collections import Counter

import pytest
from jupyter_client.manager import start_new_kernel

from forkd_engine.store import RemoteStore, fetch_manifest
from forkd_engine.vm.image import Image, build_image
from forkd_engine.vm.packages import build_packages_image
from forkd_server.client import Controller, ControllerError

from ..kernel.cells import run
from ..store.s3 import S3_ENV, moto_s3
from ..vm.conftest import requires_qemu
from .fleet import fleet
from .netns import NamespacedServer, available, service_address

pytestmark = [requires_qemu, pytest.mark.skipif(available() is not None, reason=str(available())), pytest.mark.slow]
STORE = "s3://forkd/fleet"


def _chunks(log: list[tuple[str, str]], method: str, since: int = 0) -> Counter:
    """How often each chunk (by its name) was asked of the store with ``method``, from ``log[since:]``."""
    return Counter(path.rsplit("/", 1)[1] for m, path in log[since:] if m == method and "/fleet/chunks/" in path)


def _objects(tag: str) -> set[str]:
    """The stored objects of the manifest the store holds under ``tag``."""
    return set(fetch_manifest(RemoteStore(STORE), tag=tag).chunks())


def _image_cache(path: str, image: Image) -> str:
    """A guest-image cache of its own at ``path`` holding ``image`` in files of its own (hard links
    where they can be): a host on it creates snapshots without building an image, and once it is
    ``_empty`` the paths those snapshots record lead nowhere, as on another machine."""
    mine = os.path.join(path, "images", image.key)
    os.makedirs(mine)
    own = {}
    for name in ("kernel", "initrd"):
        own[name] = os.path.join(mine, os.path.basename(getattr(image, name)))
        try:
            os.link(getattr(image, name), own[name])
        except OSError:  # another file system
            shutil.copyfile(getattr(image, name), own[name])
    with open(os.path.join(mine, "image.json"), "w") as f:
        json.dump(dataclasses.replace(image, dir=mine, **own).to_dict(), f)
    os.symlink(os.path.join(os.path.dirname(os.path.dirname(image.dir)), "debs"), os.path.join(path, "debs"))
    return path


def _empty(path: str) -> None:
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


@contextlib.contextmanager
def vm_fleet(cap: int = 2, caches: list[str] | None = None):
    """Two VM hosts, each in a network namespace of its own that the router (in the root namespace)
    reaches over its link, capped at ``cap`` sandboxes, sharing moto's S3 on a root-namespace address
    that each reaches over its link; ``caches``: each host's guest-image cache (else the run's).
    Yields (router, hosts, the store's request log)."""
    with service_address() as store_addr, moto_s3(ip=store_addr) as (endpoint, log):
        env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        os.environ.update(env)  # the hosts inherit it (fleet() passes os.environ), and _objects reads it
        try:
            host_args = ["--store", STORE, f"--ForkdApp.max_sandboxes={cap}"]
            server = functools.partial(NamespacedServer, reach=(store_addr,))
            host_env = [{"FORKD_VM_CACHE": cache} for cache in caches] if caches else None
            with fleet(2, host_args=[host_args, host_args], server=server, host_env=host_env) as (router, hosts):
                assert not any(h.url.startswith("http://127.") for h in hosts)
                yield router, hosts, log
        finally:
            for name in env:
                os.environ.pop(name, None)


def test_a_vm_snapshot_spills_over_by_push_and_pull(tmp_path):
    image = build_image(os.environ["FORKD_VM_CACHE"])  # the run's, built once, under that cache's lock
    caches = [_image_cache(str(tmp_path / f"cache{i}"), image) for i in range(2)]
    with vm_fleet(caches=caches) as (router, hosts, log):
        api = Controller(router.url, router.token, timeout=600)
        made = api.create_snapshot("vmbase", engine="vm", mem_size_mib=256, setup="x = 41")
        holder = next(h for h in hosts if h.url == made["host"])
        other = next(h for h in hosts if h is not holder)
        assert "vmbase" not in {s["tag"] for s in Controller(other.url, other.token).list_snapshots()}
        assert _chunks(log, "PUT") == Counter()  # not pushed yet
        # from here on no host has a guest image: not even the holder's, which the snapshot names
        for cache in caches:
            _empty(cache)

        # over the holder's cap: the rest goes to the other host, which pulls it
        before = len(log)
        kids = api.spawn_sandboxes("vmbase", 3)
        where = [k["host"] for k in kids]
        assert where.count(holder.url) == 2 and where.count(other.url) == 1
        assert Controller(other.url, other.token).snapshot_info("vmbase")["stored"]["remote"] is True
        base = _objects("vmbase")
        pushed, fetched = _chunks(log, "PUT", before), _chunks(log, "GET", before)
        assert set(pushed) == base and max(pushed.values()) == 1  # the holder pushed it on demand
        assert set(fetched) == base and max(fetched.values()) == 1  # each chunk fetched once
        assert [api.eval_code(k["id"], "x + 1")["result"] for k in kids] == ["42"] * 3
        assert [os.listdir(cache) for cache in caches] == [[], []]  # restored with no image: none built or fetched

        # a live branch on the other host stays there, and so does its first child
        moved = next(k["id"] for k in kids if k["host"] == other.url)
        api.run_code(moved, "x = 99")
        snap = api.branch_sandbox(moved, "vmbase-99", mode="live")
        assert snap["host"] == other.url
        api.wait_snapshot("vmbase-99", timeout=600)
        grandkid = api.spawn_sandboxes("vmbase-99")[0]
        assert grandkid["host"] == other.url
        assert api.eval_code(grandkid["id"], "x")["result"] == "99"
        assert [os.listdir(cache) for cache in caches] == [[], []]  # nor for a branch of a pulled snapshot

        # the other host is full (2 of 2): the next child goes to the holder, once it has room,
        # and the holder downloads only the branch's chunks that it lacks
        stay = next(k for k in kids if k["host"] == holder.url)
        api.kill_sandbox(next(k["id"] for k in kids if k["host"] == holder.url and k is not stay))
        before = len(log)
        last = api.spawn_sandboxes("vmbase-99")[0]
        assert last["host"] == holder.url
        assert api.eval_code(last["id"], "x")["result"] == "99"
        fetched = _chunks(log, "GET", before)
        branch = _objects("vmbase-99")
        assert set(fetched) == branch - base and max(fetched.values()) == 1
        assert 0 < len(fetched) < len(branch)  # the base's chunks came from the holder's own cache
        for sid in (stay["id"], moved, grandkid["id"], last["id"]):
            api.kill_sandbox(sid)


def _guest_built(packages: tuple[str, ...]) -> None:
    """The run's guest image and packages disk built here, in the root namespace: the hosts, in
    namespaces of their own, reach no package mirror, and take them from the run's cache."""
    build_image(os.environ["FORKD_VM_CACHE"])
    build_packages_image(os.environ["FORKD_VM_CACHE"], list(packages))


def test_a_vm_notebooks_fork_spans_hosts_and_keep_ends_it_on_each():
    """The forkd kernel on the VM engine pointed at the router, the notebook (HEAD) on a host with
    room for 1 more: a fork the fleet cannot hold is refused with nothing left; ``kids = %forkd fork
    -n 3`` lands one child there and two on the other host, one tree, each with the notebook's state
    (``%%forkd run kids``); ``%forkd keep`` of a child on the other host moves the notebook there,
    kills its sibling there and keeps the one on the first host that another notebook took over
    (with the tree's snapshot); once that one ends, promoting again releases the snapshot from both
    hosts and the store."""
    _guest_built(("python3-ipython",))  # the forkd kernel's guest shell (forkd_kernel/base.py)
    with vm_fleet() as (router, hosts, _log):
        env = {**os.environ, "FORKD_URL": router.url, "FORKD_TOKEN": router.token, "FORKD_KERNEL_ENGINE": "vm"}
        km, kc = start_new_kernel(kernel_name="forkd-python", startup_timeout=600, env=env)
        try:
            first = run(kc, "x = 7", timeout=900)
            assert first.ok, first.text  # the notebook's base snapshot and HEAD: 1 of a host's 2
            api = Controller(router.url, router.token, timeout=600)
            (home,) = {s["host"] for s in api.list_sandboxes()}
            before = {s["id"] for s in api.list_sandboxes()}, {s["tag"] for s in api.list_snapshots()}

            # more than the fleet holds (room for 1 + 2): refused, and nothing of the fork stays
            refused = run(kc, "%forkd fork -n 4", timeout=600)
            assert not refused.ok and "across hosts" in refused.text and "room for 3 of the 4" in refused.text, \
                refused.text
            assert ({s["id"] for s in api.list_sandboxes()}, {s["tag"] for s in api.list_snapshots()}) == before

            made = run(kc, "kids = %forkd fork -n 3", timeout=600)
            assert made.ok, made.text
            where = {s["id"]: s["host"] for s in api.list_sandboxes() if "fork_tree_id" in s["labels"]}  # one tree
            far = sorted(h.url for h in hosts if h.url != home)
            assert sorted(where.values()) == sorted([home, *far, *far]), where
            nodes = {n["id"]: n for n in api.tree()}  # %forkd tree and the panel name each child's host
            assert all(nodes[sid]["host"] == host for sid, host in where.items())
            with contextlib.closing(sqlite3.connect(router.db, timeout=30)) as db:  # both forks ended their rows
                assert db.execute("SELECT key FROM pins WHERE kind='pending_fork'").fetchall() == []
            ran = run(kc, "%%forkd run kids\nx + 1", timeout=300)
            assert ran.ok and [line.strip() for line in ran.result.splitlines()].count("8") == 3, ran.text
            (tree,) = {api.get_sandbox(sid)["labels"]["fork_tree_id"] for sid in where}
            assert RemoteStore(STORE).has(f"tags/{tree}")  # its host pushed it for the other to pull

            winner = next(sid for sid, host in where.items() if host != home)
            theirs = next(sid for sid, host in where.items() if host == home)
            api.update_sandbox(theirs, labels={"jupyter.notebook": "theirs.ipynb"})  # another notebook's now
            kept = run(kc, f"%forkd keep {winner}", timeout=300)
            assert kept.ok, kept.text
            assert (f"killed 1 sibling\n  kept sandbox {theirs}: it was taken over since the fork (now "
                    f"theirs.ipynb's)\n  kept snapshot {tree}: {theirs} was spawned from it") in kept.text, kept.text
            assert run(kc, "x").result == "7" and winner in run(kc, "%forkd head").text  # moved to the other host
            assert set(where) & {s["id"] for s in api.list_sandboxes()} == {winner, theirs}
            (lost,) = set(where) - {winner, theirs}
            with pytest.raises(ControllerError) as gone:  # says why, as a host's own promote's sibling does
                api.get_sandbox(lost)
            assert gone.value.status == 404 and (f"sandbox {lost} not found: it lost fork tree {tree} to {winner}, "
                                                 f"which was promoted") in str(gone.value), str(gone.value)
            assert all("fork_tree_id" not in api.get_sandbox(sid)["labels"] for sid in (winner, theirs))

            # once it ends, promoting the winner again (the tree named: no label names it now) releases it
            api.kill_sandbox(theirs)
            again = api.promote_sandbox(winner, tree)
            assert (again["killed"], again["released"], again["kept"]) == ([], [tree], []), again
            assert again["winner"]["host"] != home
            for host in hosts:  # the tree's snapshot is gone from both hosts and from the store
                assert tree not in {s["tag"] for s in Controller(host.url, host.token).list_snapshots()}
            assert not RemoteStore(STORE).has(f"tags/{tree}")
        finally:
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=False)
