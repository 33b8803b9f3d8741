"""A long server error in a notebook: two lines (what happened, what to do) and its details shown
collapsed under them. The error is the server's own (built by its endings and error classes, as the
REST layer sends it); the controller that answers with it stands in for a server whose sandbox died."""

from __future__ import annotations

import time

import pytest
from IPython.core.interactiveshell import InteractiveShell

from forkd_engine import LimitHit
from forkd_magics._magics import ForkdMagics
from forkd_server.controller import endings
from forkd_server.client import Controller, ControllerError
from forkd_server.errors import Gone

from .conftest import cell

URL = "http://127.0.0.1:9"


def died_of_its_huge_page_cap() -> ControllerError:
    """The 410 a spawn's caller gets from the server when the sandbox died of its huge-page cap."""
    hit = LimitHit("huge_pages", 64, 3, "the huge-page cap (64 MiB of 2MB pages, as much as the memory limit) "
                                        "refused 2MB pages (a process faulting one gets SIGBUS, an mmap of them ENOMEM)")
    ended = endings.died({"snapshot_tag": "py", "memory_limit_mib": 64}, [hit])
    gone = Gone(f"sandbox sb-1 ended during this run_code: {ended['reason']}", hint=ended["hint"],
                details=ended["details"], ended={"at": time.time(), "reason": ended["reason"], "limit": "huge_pages"})
    return ControllerError(gone.status, {"error": gone.message, **gone.fields}, f"{URL}/v1/sandboxes")


class DyingServer(Controller):
    def spawn_sandboxes(self, *args, **kwargs):
        raise died_of_its_huge_page_cap()


@pytest.fixture
def dying(monkeypatch):
    shell = InteractiveShell.instance()
    shell.register_magics(ForkdMagics(shell, controller=DyingServer(URL, "t" * 32)))
    yield shell
    shell.magics_manager.magics["line"].pop("forkd", None)
    shell.magics_manager.magics["cell"].pop("forkd", None)


def test_a_long_error_is_two_lines_with_its_details_collapsed_under_them(dying):
    res, out = cell(dying, "%forkd fork -t py -n 2")
    assert not res.success
    what, hint = out.stderr.splitlines()  # two lines, no more, and no traceback
    assert what == ("UsageError: forkd fork: sandbox sb-1 ended during this run_code: it died of its huge-page cap "
                    "(64 MiB, as much as its memory limit)")
    # what to do, with the same in the notebook's own words
    assert hint == ("to go on, start a sandbox of py with a larger memory_limit_mib, e.g. 128: "
                    "%forkd fork --tag py --memory-limit-mib 128")
    (shown,) = out.outputs  # the details: one display, after the error
    html = shown.data["text/html"]
    assert html.startswith('<details class="forkd-error-details"><summary') and "<details open" not in html
    for fact in ("SIGBUS", "spawn_sandboxes(&#x27;py&#x27;, memory_limit_mib=128)", "--memory-limit-mib 128",
                 "POST /v1/sandboxes", f"410 from {URL}/v1/sandboxes"):
        assert fact in html, fact  # every fact the old paragraph held is still there
    assert "SIGBUS" in shown.data["text/plain"] and "%forkd fork --tag py --memory-limit-mib 128" in shown.data["text/plain"]


def test_details_of_a_magic_run_from_code_do_not_land_under_the_next_cell(dying):
    with pytest.raises(Exception, match="huge-page cap") as raised:
        dying.run_line_magic("forkd", "fork -t py")  # outside a cell: the caller has the details
    assert raised.value.details["limit"] == "huge_pages" and raised.value.details["limit_mib"] == 64
    res, out = cell(dying, "1 + 1")
    assert res.success and out.outputs == [] and out.stderr == ""


@pytest.mark.parametrize("body, said", [
    ({"error": "snapshot py already exists; DELETE first"},
     "snapshot py already exists\nchoose another tag, or delete that snapshot first: %forkd delete py"),
    ({"error": "snapshot py2 not found"},
     "snapshot py2 not found\ncheck the name: %forkd ls lists this notebook's snapshots (--everyone: the server's)"),
    ({"error": "sandbox sb-1 not found on any host of the fleet"},
     "sandbox sb-1 not found on any host of the fleet\ncheck the name: %forkd ls lists this notebook's sandboxes "
     "(--everyone: the server's)"),
])
def test_forkds_bare_words_get_what_to_do_in_the_notebooks(body, said):
    """forkd's wire keeps these messages word for word, without a hint; the notebook says what to do."""
    from forkd_magics._errors import explain
    status = 400 if "exists" in body["error"] else 404
    assert explain(ControllerError(status, body, f"{URL}/v1/x"), URL) == said
