"""The panel's "Insert code" and the palette's notifications, used as a person would (Debian's
Chromium through Playwright): the inserted cell runs in a plain ipykernel notebook and in a forkd
kernel notebook of the same Lab, and the palette says what it did in sentences, not Python reprs."""

from __future__ import annotations

import re

from .test_panel import PANEL, row, set_theme, shot


def open_notebook(page, kernel: str) -> str:
    page.evaluate(f"window.jupyterapp.commands.execute('notebook:create-new', {{kernelName: '{kernel}'}})")
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=30_000)
    page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayStatus === 'idle'",
                           timeout=90_000)
    return page.evaluate("window.jupyterapp.shell.currentWidget.context.path")


def insert_and_run(page, node: str) -> tuple[str, str]:
    """Insert code for a node from the panel, run that cell as a person would (Shift+Enter), and
    return its source and what it showed, once its prompt has a number."""
    row(page, node).click()
    page.locator(f"{PANEL} button.forkd-insert").click()
    page.locator(f"{PANEL} .forkd-message", has_text=f"inserted a cell for {node}").wait_for(timeout=5_000)
    source = page.evaluate("window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.getSource()")
    index = page.evaluate("window.jupyterapp.shell.currentWidget.content.activeCellIndex")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-cell')")
    page.wait_for_function(
        "i => /\\[\\d+\\]/.test(document.querySelectorAll('.jp-NotebookPanel .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)", arg=index, timeout=120_000)
    outs = page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-OutputArea-output")
    return source, "\n".join(outs.all_text_contents())


def test_inserted_code_runs_in_an_ipykernel_notebook(page, lab):
    ctl = lab.controller()
    ctl.create_snapshot("ins-py", setup="x = 1")
    kid = ctl.spawn_sandboxes("ins-py", 1)[0]["id"]
    row(page, kid).wait_for(timeout=5_000)
    open_notebook(page, "python3")
    # the SDK finds the Jupyter server that started the kernel by itself: no URL, no token
    source, out = insert_and_run(page, "ins-py")
    assert source.startswith("from forkd_server.client import Snapshot") and "8889" not in source
    assert "Error" not in out and re.search(r"\[Sandbox\('sb-[0-9a-f]{8}-[0-9a-f]{4}', snapshot_tag='ins-py'\)\]", out), out
    assert len([b for b in ctl.list_sandboxes() if b["snapshot_tag"] == "ins-py"]) == 2
    source, out = insert_and_run(page, kid)
    assert f'Sandbox.connect("{kid}")' in source and out.strip() == "'2'", out
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


def test_inserted_code_runs_in_a_forkd_kernel_notebook(page, lab):
    """The notebook's cells run in its sandbox, which cannot reach the server: the inserted cell is
    %forkd lines, which run in the kernel, where the Lab server is known."""
    ctl = lab.controller()
    ctl.create_snapshot("ins-fk", setup="x = 1")
    kid = ctl.spawn_sandboxes("ins-fk", 1)[0]["id"]
    row(page, kid).wait_for(timeout=5_000)
    open_notebook(page, "forkd-python")
    source, out = insert_and_run(page, "ins-fk")
    assert source.splitlines()[-1] == "kids = %forkd fork -t ins-fk -n 1"
    assert "Error" not in out, out
    forked = [b for b in ctl.list_sandboxes() if b["snapshot_tag"] == "ins-fk"]
    assert len(forked) == 2
    source, out = insert_and_run(page, kid)
    assert source == f"%%forkd run {kid}\n1 + 1"
    assert "Error" not in out and kid in out and out.strip().endswith("2"), out
    shot(page, "lab-insert-code-forkd.png")
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")


def test_palette_notifications_are_sentences(page, lab):
    name = open_notebook(page, "forkd-python")
    page.evaluate("window.jupyterapp.commands.execute('forkd:branch-notebook')")
    # its toast, whatever it says (a failure's sentence says why in the assertion below); the
    # command waits for the kernel's %forkd line, which a loaded host may take a while to run
    toast = page.locator(".jp-toast-message", has_text=re.compile("branch", re.I)).first
    toast.wait_for(timeout=120_000)
    text = toast.text_content()
    assert re.fullmatch(rf"Branched {re.escape(name)} into snapshot branch-sb-[0-9a-f]{{8}}-[0-9a-f]{{4}}-0 "
                        r"\(the notebook paused \d+\.\d ms\)\.", text), text
    tag = text.split("into snapshot ")[1].split(" ")[0]
    assert lab.controller().snapshot_info(tag)["status"] in ("writing", "ready")

    page.evaluate("() => { window.jupyterapp.commands.execute('forkd:fork-notebook'); }")  # it waits on the dialog
    dialog = page.locator(".jp-Dialog")
    dialog.locator("input").fill("2")
    dialog.locator(".jp-mod-accept").click()
    toast = page.locator(".jp-toast-message", has_text=f"Forked {name}")
    toast.wait_for(timeout=60_000)
    text = toast.text_content()
    ids = re.findall(r"sb-[0-9a-f]{8}-[0-9a-f]{4}", text)
    assert text == f"Forked {name} into 2 sandboxes holding its state: {', '.join(ids)}.", text
    assert set(ids) <= {b["id"] for b in lab.controller().list_sandboxes()} and len(ids) == 2
    for t in page.locator(".jp-toast-message").all_text_contents():
        assert "Snapshot(" not in t and "Sandbox(" not in t and "[" not in t, t
    shot(page, "lab-palette-toast-light.png")
    set_theme(page, dark=True)

    # a failure is a sentence too: the kernel's UsageError without its class name
    page.evaluate("window.jupyterapp.commands.execute('forkd:checkout', {id: 'sb-00000000-0000'})")
    failed = page.locator(".jp-toast-message", has_text="Could not check out sb-00000000-0000")
    failed.wait_for(timeout=30_000)
    assert "UsageError" not in failed.text_content()
    assert failed.text_content().startswith("Could not check out sb-00000000-0000: forkd checkout: "), \
        failed.text_content()
    shot(page, "lab-palette-toast-dark.png")
    set_theme(page, dark=False)
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
