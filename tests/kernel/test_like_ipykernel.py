"""Where the forkd kernel must answer as ipykernel does: ``%forkd?`` (the magic's help in the pager),
an interrupt's traceback (the user's frames only), and a ``%forkd`` line's user expressions."""

from __future__ import annotations

import re

from jupyter_client.manager import start_new_kernel

from .cells import printed, run, run_interrupted

ANSI = re.compile(r"\x1b\[[0-9;]*m")
SLEEPER = "import time\nprint('sleeping', flush=True)\ndef wait():\n    time.sleep(60)\n\nwait()"


def frames(traceback: list[str]) -> list[str]:
    """The frames a traceback shows: ``line 6`` for the cell, ``line 4, in wait`` for a function."""
    text = ANSI.sub("", "\n".join(traceback))
    return [f"{where.split(',')[0] if where.startswith('File') else 'cell'}, line {line}{f', in {fn}' if fn else ''}"
            for where, line, fn in re.findall(r"^(Cell In\[\d+\]|File [^\n,]+), line (\d+)(?:, in (\w+))?", text, re.M)]


def interrupted(km, kc, again_every: float | None = None) -> dict:
    assert run(kc, "started = True").ok  # the kernel is up (the forkd kernel's sandbox made)
    cell = run_interrupted(km, kc, SLEEPER, printed("sleeping"), again_every=again_every)
    assert cell.content["status"] == "error" and cell.content["ename"] == "KeyboardInterrupt"
    return cell.content


def test_an_interrupt_shows_the_users_frames_only_as_ipykernel_does(kernel):
    km, kc = kernel
    forkd = interrupted(km, kc)
    plain_km, plain_kc = start_new_kernel(kernel_name="python3")
    try:
        # ipykernel is the reference: on a loaded host its interrupt can land between the print and
        # the sleep (or in its own output machinery), so its traceback is taken from the first of
        # three interrupts that caught the cell in its sleep; and one it missed altogether (the cell
        # slept on: CI's run of 1025646) is sent again, as a person would
        for _ in range(3):
            plain = interrupted(plain_km, plain_kc, again_every=5.0)
            if frames(plain["traceback"]) == ["cell, line 6", "cell, line 4, in wait"]:
                break
    finally:
        plain_kc.stop_channels()
        plain_km.shutdown_kernel(now=True)
    text = ANSI.sub("", "\n".join(forkd["traceback"]))
    assert "forkd_engine" not in text and "executor.py" not in text, text
    assert frames(forkd["traceback"]) == frames(plain["traceback"]) == ["cell, line 6", "cell, line 4, in wait"], text
    assert text.rstrip().endswith("KeyboardInterrupt:")


def test_forkd_help_shows_in_the_pager_as_a_magics_help_does(kernel):
    _, kc = kernel
    def page(code: str) -> str:
        cell = run(kc, code)
        assert cell.ok and not cell.of("error") and not cell.of("stream"), cell.text
        (payload,) = cell.content["payload"]
        assert payload["source"] == "page"
        return ANSI.sub("", payload["data"]["text/plain"])

    for code in ("%forkd?", "?%forkd"):
        text = page(code)
        assert text.startswith("Docstring:\nFork-on-write Python sandboxes from a notebook.")  # IPython's pinfo
        assert "\n%forkd branch [--tag TAG]" in text and "\n%%forkd run [--tag TAG]" in text
        assert "::" not in text
    # what ipykernel shows for it, with the magics loaded there
    plain_km, plain_kc = start_new_kernel(kernel_name="python3")
    try:
        assert run(plain_kc, "%load_ext forkd_magics").ok
        (plain,) = run(plain_kc, "%forkd?").content["payload"]
    finally:
        plain_kc.stop_channels()
        plain_km.shutdown_kernel(now=True)
    assert ANSI.sub("", plain["data"]["text/plain"]) == page("%forkd?")
    assert page("%forkd??").startswith("Source:\n")  # as IPython answers ?? for any magic
    # %forkd help prints the same text; Shift+Tab on a %forkd line inspects the magic, here
    helped = run(kc, "%forkd help")
    assert helped.ok and helped.text.startswith("Fork-on-write Python sandboxes from a notebook.\n")
    assert "\n%forkd fork [--tag TAG] [-n N]" in helped.text and "::" not in helped.text
    kc.inspect("%forkd branch --li", 18)
    reply = kc.get_shell_msg(timeout=30)["content"]
    assert reply["found"] and "Fork-on-write Python sandboxes" in reply["data"]["text/plain"]


def test_user_expressions_of_a_forkd_line_are_evaluated_where_it_ran(kernel):
    """What the lab panel reads a palette command's result through (ipykernel's user_expressions)."""
    _, kc = kernel
    cell = run(kc, "%forkd branch --live", user_expressions={"tag": "_.tag", "missing": "nope"})
    assert cell.ok
    tag = cell.content["user_expressions"]["tag"]
    assert tag["status"] == "ok" and tag["data"]["text/plain"].startswith("'branch-sb-")
    missing = cell.content["user_expressions"]["missing"]
    assert missing["status"] == "error" and missing["ename"] == "NameError"
    # in the sandbox, as before
    cell = run(kc, "x = 20", user_expressions={"twice": "x * 2"})
    assert cell.content["user_expressions"]["twice"]["data"]["text/plain"] == "40"
