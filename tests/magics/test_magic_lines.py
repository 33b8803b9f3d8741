"""A first-time user's stumbles, each through a real IPython shell against a real ``forkd serve``:
magic lines that read like Python (comments, ``{expr}``, undefined names), bulk kill, failing
cells, errors in plain language, ``connect`` without a token on the line, tab completion."""

from __future__ import annotations

import getpass
import os
import signal
import socket
import time

import pytest
from IPython.core.completer import provisionalcompleter
from IPython.core.error import StdinNotImplementedError

from forkd_magics import _complete
from forkd_server.client import Sandbox

from ..conftest import completed
from .conftest import cell, magics


def ids_on(forkd) -> set[str]:
    return {b["id"] for b in forkd.controller().list_sandboxes()}


def test_pasted_lines_with_comments_and_expansions(ip, forkd):
    res, out = cell(ip, 'snap = %forkd snapshot -t cm --setup "x = 1; note = \'a # b\'"  # the {setup} runs once\n'
                        "kids = %forkd fork -t cm -n 3              # [Sandbox, ...]\n"
                        "n = 2")
    assert res.success, out.stderr
    assert len(ip.user_ns["kids"]) == 3 and ids_on(forkd) == {k.id for k in ip.user_ns["kids"]}
    kids = ip.user_ns["kids"]
    assert kids[0].eval("note") == "'a # b'"  # a # inside quotes is no comment

    res, out = cell(ip, "more = %forkd fork -t cm -n $n  # $name expands\n"
                        "%forkd exec {kids[1].id} -- echo a#b; echo c # the shell's own comment")
    assert res.success, out.stderr
    assert len(ip.user_ns["more"]) == 2
    assert res.result.stdout == "a#b\nc\n"

    res, out = cell(ip, "%forkd kill {kids[0].id} more # the first, and the two more")
    assert res.success and out.stdout == "killed 3 sandboxes\n"
    assert ids_on(forkd) == {kids[1].id, kids[2].id}


@pytest.mark.parametrize("line, name", [
    ("%forkd kill kids", "kids"),
    ("%forkd kill {kid.id}  # its expansion failed", "kid"),
    ("%forkd branch sandbox_i_never_made --live", "sandbox_i_never_made"),
    ("%forkd exec nothing_here -- ls", "nothing_here"),
    ("%forkd gather nokids -e 1 -o out", "nokids"),
    ("%%forkd run nokids\n1", "nokids"),
    ("%%forkd run --all --each \"lr=rates\"\n1", "rates"),
])
def test_an_undefined_name_is_a_name_error_and_nothing_happens(ip, forkd, line, name):
    ip.run_line_magic("forkd", "snapshot -t nm")
    alive = {k.id for k in ip.run_line_magic("forkd", "fork -t nm -n 2")}
    res, out = cell(ip, line)
    assert isinstance(res.error_in_exec, NameError), (out.stdout, out.stderr)
    shown = out.stdout + out.stderr
    assert f"NameError\x1b[0m: name '{name}' is not defined" in shown
    assert "not found" not in shown and "Traceback" not in shown and "HTTP" not in shown
    assert ids_on(forkd) == alive


def test_tags_and_ids_are_never_taken_for_names(ip, forkd):
    ip.user_ns["nm2"] = 3  # a variable that happens to share the tag: the tag still wins
    snap = ip.run_line_magic("forkd", "snapshot -t nm2")
    (kid,) = ip.run_line_magic("forkd", "fork -t nm2")
    assert kid.snapshot_tag == "nm2"
    ip.user_ns["snap"] = snap  # a Snapshot variable names its tag
    res, out = cell(ip, f"%forkd kill {kid.id}\n%forkd delete snap")
    assert res.success, out.stderr
    assert out.stdout == "killed 1 sandbox\ndeleted snapshot nm2\n"


def test_a_value_is_offered_to_a_sandbox_only_as_python_that_means_the_same_there():
    from forkd_magics._names import as_python
    from forkd_server.client import Snapshot

    kids = [Sandbox({"id": "sb-1-a"}, None), Sandbox({"id": "sb-1-b"}, None)]
    assert as_python(kids) == "['sb-1-a', 'sb-1-b']" and as_python(kids[0]) == "'sb-1-a'"
    assert as_python(Snapshot({"tag": "base"}, None)) == "'base'"
    assert as_python({"lr": 0.1, "n": [1, 2]}) == "{'lr': 0.1, 'n': [1, 2]}"
    assert as_python(object()) is None and as_python(float("nan")) is None  # no literal; nan != nan
    assert as_python(list(range(1000))) is None  # cut short it would be wrong Python


def test_a_fork_past_the_servers_limit_names_the_option_typed(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t big")
    (kid,) = ip.run_line_magic("forkd", "fork -t big")
    alive = ids_on(forkd)
    res, out = cell(ip, f"%forkd fork {kid.id} -n 100000")
    assert "forkd fork: -n must be at least 1 and at most 1000, got 100000" in out.stderr, out.stderr
    assert "count" not in out.stderr and not res.success
    assert ids_on(forkd) == alive


def test_kill_of_a_mixed_list_kills_the_live_ones_then_reports_the_rest(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t mx")
    kids = ip.run_line_magic("forkd", "fork -t mx -n 4")
    ip.user_ns["kids"] = kids
    kids[1].kill()  # dead before the bulk kill
    res, out = cell(ip, "%forkd kill kids")
    assert not res.success  # the cell says something went wrong...
    assert out.stdout == "killed 3 sandboxes\n"  # ...after killing every live one
    assert out.stderr.startswith("UsageError: forkd kill: could not kill 1 of 4:\n")
    assert f"{kids[1].id}: no such sandbox is running" in out.stderr
    assert ids_on(forkd) == set()
    # a sweep takes what is there and is not bothered by what went meanwhile
    more = ip.run_line_magic("forkd", "fork -t mx -n 2")
    res, out = cell(ip, "%forkd kill --tag mx")
    assert res.success and out.stdout == "killed 2 sandboxes\n" and not ids_on(forkd) & {m.id for m in more}


def test_a_cell_that_fails_in_one_sandbox_fails_after_showing_every_column(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t fl")
    ip.user_ns["kids"] = kids = ip.run_line_magic("forkd", "fork -t fl -n 3")
    res, _ = cell(ip, "%%forkd run kids --each \"d=[1, 2, 1]\"\n10 / d")
    assert res.success  # control: where no sandbox fails, the cell passes
    res, out = cell(ip, "%%forkd run kids --each \"d=[1, 0, 1]\"\nprint('dividing by', d)\n10 / d")
    assert not res.success
    assert "the cell failed in 1 of 3 sandboxes" in out.stderr and kids[1].id in out.stderr
    shown = out.outputs[-1].data["text/plain"]
    assert shown.count("dividing by") == 3 and shown.count("10.0") == 2 and "ZeroDivisionError" in shown
    html = out.outputs[-1].data["text/html"]
    assert "word-break:normal" in html  # columns wrap between words, not inside them (JupyterLab's pre breaks all)


def test_a_setup_that_raises_reads_as_the_users_traceback(ip, forkd):
    res, out = cell(ip, "%%forkd snapshot -t boom\nimport json\n\ndef load():\n    raise ValueError('no config here')\n\nload()")
    assert not res.success
    text = out.stderr
    assert text == ("UsageError: forkd snapshot: snapshot boom: your setup code raised ValueError: no config here "
                    "(setup line 4)\nnothing was created: fix the setup and create the snapshot again\n")
    (details,) = out.outputs  # collapsed under the error: the user's frames
    assert "  setup line 6, in &lt;module&gt;\n      setup line 4, in load\n" in details.data["text/html"]
    assert "HTTP" not in text and "500" not in text and "Traceback" not in text
    assert forkd.controller().list_snapshots() == []


def test_a_sandbox_that_does_not_answer_is_said_so_without_a_socket_path(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t st")
    (kid,) = ip.run_line_magic("forkd", "fork -t st")
    ip.user_ns["kid"] = kid
    os.kill(kid.info["pid"], signal.SIGSTOP)  # the sandbox hangs: its agent cannot answer
    try:
        res, out = cell(ip, "%forkd exec kid --timeout 1 -- true")
    finally:
        os.kill(kid.info["pid"], signal.SIGCONT)
    assert not res.success
    assert "the sandbox's agent did not answer within" in out.stderr
    assert "give it more time (--timeout), interrupt it, or kill it" in out.stderr
    assert ".sock" not in out.stderr and forkd.data_dir not in out.stderr and "HTTP" not in out.stderr


def test_a_run_stopped_by_its_timeout_says_so(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t tt")
    ip.user_ns["kid"] = ip.run_line_magic("forkd", "fork -t tt")
    res, out = cell(ip, "%%forkd run kid --timeout 1\nimport time\ntime.sleep(30)")
    assert not res.success and "KeyboardInterrupt: stopped after --timeout 1 s" in out.stderr


def test_connect_takes_the_token_from_the_environment_or_a_prompt_never_the_line(ip, forkd, monkeypatch):
    prompts = []

    def prompt(text: str = "") -> str:
        prompts.append(text)
        return forkd.token

    monkeypatch.setattr(getpass, "getpass", prompt)
    res, out = cell(ip, f"%forkd connect {forkd.url} --token {forkd.token}")
    assert not res.success and forkd.token not in out.stdout + out.stderr
    assert "the notebook (and its history) would keep the secret" in out.stderr and "FORKD_TOKEN" in out.stderr

    res, out = cell(ip, f"%forkd connect {forkd.url}")  # FORKD_TOKEN is set: no prompt
    assert res.success and prompts == [] and out.stdout.startswith(f"forkd: using {forkd.url}\n")

    monkeypatch.delenv("FORKD_TOKEN")
    monkeypatch.delenv("FORKD_URL")
    res, out = cell(ip, f"%forkd connect {forkd.url}\n%forkd ls")
    assert res.success, out.stderr
    assert prompts == [f"{forkd.url} needs a token; its token (not echoed): "]
    assert "0 snapshot(s)" in out.stdout

    monkeypatch.setattr(getpass, "getpass", lambda text="": "not-the-token-at-all")
    res, out = cell(ip, f"%forkd connect {forkd.url}")
    assert not res.success and "refused the token" in out.stderr

    def no_stdin(text=""):  # what ipykernel raises where the front end cannot prompt (nbconvert)
        raise StdinNotImplementedError("raw_input was called, but this frontend does not support input requests.")

    monkeypatch.setattr(getpass, "getpass", no_stdin)
    res, out = cell(ip, f"%forkd connect {forkd.url}")
    assert not res.success and "cannot ask for one: set FORKD_TOKEN" in out.stderr


def completions(ip, code: str) -> list[str]:
    """What Jupyter's completion request gets (ipykernel asks the shell's completer this way)."""
    with provisionalcompleter():
        return [c.text for c in ip.Completer.completions(code, len(code))]


def test_tab_completes_subcommands_flags_tags_ids_and_variables(ip, forkd):
    ip.run_line_magic("forkd", "snapshot -t tab-one")
    kids = ip.user_ns["kids"] = ip.run_line_magic("forkd", "fork -t tab-one -n 2")
    assert completions(ip, "%forkd ki") == ["kill"]
    assert set(completions(ip, "%forkd br")) == {"branch"}
    assert {"--no-wait", "--live", "--lossy"} <= set(completions(ip, "%forkd branch --"))
    assert completed(lambda: completions(ip, "%forkd fork -t tab-"), {"tab-one"}) == ["tab-one"]
    ids = {k.id for k in kids}
    assert set(completed(lambda: completions(ip, "x = %forkd kill "), ids)) >= {"kids", *ids}
    assert sorted(completed(lambda: completions(ip, "%forkd kill sb-"), ids)) == sorted(ids)
    assert completions(ip, "%%forkd run ki") == ["kids"]
    assert completed(lambda: completions(ip, "%forkd delete tab"), {"tab-one"}) == ["tab-one"]


def test_completion_does_not_wait_for_a_slow_server(ip, forkd, monkeypatch):
    with socket.socket() as silent:  # takes connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setenv("FORKD_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        ip.run_line_magic("reload_ext", "forkd_magics")
        ip.user_ns["kids"] = [Sandbox({"id": "sb-00000000-0001", "snapshot_tag": "t"})]
        started = time.monotonic()
        found = completions(ip, "%forkd kill ")
        waited = time.monotonic() - started
        assert found == ["kids"]  # what needs no server still completes
        assert waited < _complete.WAIT + 1.0, waited
        assert completions(ip, "%forkd sn") == ["snapshot"]
        assert magics(ip).completer.server_names() == ([], [])
