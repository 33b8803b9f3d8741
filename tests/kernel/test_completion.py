"""Tab completion in the forkd kernel, as JupyterLab asks for it (``complete_request``): ``%forkd``
lines complete in the kernel with forkd_magics' completer (subcommands, flags, tags, ids, the names
``%forkd`` lines bound), other code in the notebook's sandbox."""

from __future__ import annotations

from forkd_server.client import Controller

from ..conftest import completed
from .cells import head_of, run


def complete(kc, code: str) -> dict:
    return kc.complete(code, cursor_pos=len(code), reply=True, timeout=30)["content"]


def matches(kc, code: str) -> list[str]:
    reply = complete(kc, code)
    assert reply["status"] == "ok", reply
    return reply["matches"]


def server_matches(kc, code: str, expected: set[str]) -> list[str]:
    """Completions that need the server's tags and ids (``completed``)."""
    return completed(lambda: matches(kc, code), expected)


def test_forkd_lines_complete_in_the_kernel_and_code_in_the_sandbox(kernel, forkd_server):
    _, kc = kernel
    ctl = Controller(forkd_server.url, forkd_server.token)
    assert run(kc, "only_in_the_sandbox = 1").ok
    assert run(kc, "%forkd branch -t tabbed").ok
    assert run(kc, "kids = %forkd fork -n 2").ok
    kid_ids = {s["id"] for s in ctl.list_sandboxes()} - {head_of(kc)}  # this module's server: only kids

    # subcommands and flags: no server needed
    assert matches(kc, "%forkd che") == ["checkout"]
    assert {"--live", "--lossy", "--no-wait"} <= set(matches(kc, "%forkd branch --"))
    assert matches(kc, "%%forkd run ki") == ["kids"]           # a name bound by a %forkd line
    # tags and sandbox ids from the server
    assert server_matches(kc, "%forkd fork -t tab", {"tabbed"}) == ["tabbed"]
    found = server_matches(kc, "%forkd checkout ", {"kids", "tabbed"})
    assert {"kids", "tabbed", head_of(kc)} <= set(found), found
    assert kid_ids and kid_ids <= set(server_matches(kc, "more = %forkd kill sb-", kid_ids))
    # no Python completions of the sandbox's names on a %forkd line
    assert matches(kc, "%forkd kill only_in") == []

    # other code completes in the sandbox: its names, not the kernel's
    assert "only_in_the_sandbox" in matches(kc, "only_in")
    assert "kids" not in matches(kc, "ki")
    assert "path" in matches(kc, "import os\nos.pa") or "os.path" in matches(kc, "import os\nos.pa")
    # the magic's own name, which the sandbox's shell does not have
    reply = complete(kc, "%fork")
    assert "%forkd" in reply["matches"] and reply["cursor_start"] == 0, reply
    assert "%%forkd" in matches(kc, "%%fo")
    assert "%%forkd" not in matches(kc, "x = 1\n%%fo")  # a cell magic only starts a cell
