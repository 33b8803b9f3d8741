"""The lineage behind a router names the host of each node: the widget (``%forkd tree``) carries
``host`` (and a snapshot's ``hosts``) into its tree, its static picture names the host of each
node once the tree spans more than one, and ``%forkd ls`` has a host column then; one host needs
no name."""

from __future__ import annotations

from IPython.lib.pretty import pretty

from forkd_magics._magics import ForkdMagics
from forkd_magics._static import host_label, static_svg
from forkd_magics._widget import LineageWidget
from forkd_server.client import Controller

from .fleet import fleet


def test_the_widget_names_each_node_host_when_the_tree_spans_hosts():
    with fleet(2) as (router, hosts):
        direct = [Controller(h.url, h.token, timeout=120) for h in hosts]
        for i, ctl in enumerate(direct):
            ctl.create_snapshot(f"side{i}", setup=f"me = {i}")
        api = Controller(router.url, router.token, timeout=120)
        kids = [api.spawn_sandboxes(f"side{i}", 1)[0] for i in (0, 1)]

        w = LineageWidget(api, live=False)
        try:
            tree = w.tree
            for i, h in enumerate(hosts):
                assert tree[f"side{i}"]["host"] == h.url and tree[f"side{i}"]["hosts"] == [h.url]
                assert tree[kids[i]["id"]]["host"] == h.url
            svg = static_svg(tree)
            assert "2 snapshot(s), 2 sandbox(es) on 2 hosts" in svg
            for i, h in enumerate(hosts):
                assert svg.count(f"· on {host_label(h.url)}<") + svg.count(f"· on {host_label(h.url)} ") == 2, svg
        finally:
            w.close()

        # %forkd ls: a host column, since there are two hosts to tell apart
        listing = ForkdMagics(controller=api).forkd("ls")
        text = pretty(listing)
        assert "HOST" in text and "<th>host</th>" in listing._repr_html_()
        for i, h in enumerate(hosts):
            line = next(x for x in text.splitlines() if x.startswith(kids[i]["id"]))
            assert line.endswith(host_label(h.url)), line
        alone_ls = ForkdMagics(controller=direct[0]).forkd("ls")
        assert "HOST" not in pretty(alone_ls) and "host" not in alone_ls._repr_html_()

        # one server's tree (a host asked directly) has no host to name
        alone = LineageWidget(direct[0], live=False)
        try:
            assert all("host" not in n for n in alone.tree.values())
            assert "· on " not in static_svg(alone.tree) and "hosts" not in static_svg(alone.tree)
        finally:
            alone.close()
