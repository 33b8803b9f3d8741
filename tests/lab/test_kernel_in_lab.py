"""The forkd kernel as a person uses it: "Python 3 (forkd)" from JupyterLab's launcher, then branch,
fork and checkout typed into cells (Debian's Chromium through Playwright)."""

from __future__ import annotations

from .test_panel import shot


def type_and_run(page, code: str) -> str:
    """Type into the active cell like a person (keyboard), Shift+Enter, and return what it shows."""
    outputs = page.locator(".jp-NotebookPanel .jp-OutputArea-output")
    before = outputs.count()
    page.locator(".jp-NotebookPanel .jp-Cell.jp-mod-active .cm-content").click()
    page.keyboard.type(code)
    index = page.locator(".jp-NotebookPanel .jp-Cell").evaluate_all(
        "cells => cells.findIndex(c => c.classList.contains('jp-mod-active'))")
    page.keyboard.press("Shift+Enter")
    # done when that cell's prompt shows its execution count ([n]:, not [*]: or [ ]:)
    page.wait_for_function(
        "i => /\\[\\d+\\]/.test(document.querySelectorAll('.jp-NotebookPanel .jp-InputPrompt')[i].textContent)",
        arg=index, timeout=120_000)
    return "\n".join(outputs.nth(i).text_content() for i in range(before, outputs.count()))


def test_launcher_opens_the_forkd_kernel_and_typed_cells_branch_fork_and_check_out(page, lab):
    ctl = lab.controller()
    page.evaluate("window.jupyterapp.commands.execute('launcher:create')")
    card = page.locator(".jp-LauncherCard[data-category='Notebook'][title='Python 3 (forkd)']")
    # JupyterLab opens a launcher of its own on an empty main area, at times a moment after the page
    # settled: there may be two, and a person clicks the card in whichever they see (CI's run of af06c40)
    card.first.click()
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=30_000)
    page.locator(".jp-NotebookPanel-toolbar .jp-KernelName", has_text="Python 3 (forkd)").wait_for(timeout=30_000)
    # as a person waits for the kernel indicator to say Idle before running the first cell
    page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayStatus === 'idle'",
                           timeout=60_000)

    assert type_and_run(page, "x = 21\nx") == "21"
    assert "status='ready'" in type_and_run(page, "%forkd branch --live")
    assert type_and_run(page, "kids = %forkd fork -n 2") == ""
    moved = type_and_run(page, "%forkd checkout kids[1]")
    assert "HEAD:" in moved and "→" in moved
    assert type_and_run(page, "x + 1") == "22"
    # the execution counter went on: the last cell is [5], not a fresh [1]
    prompts = page.locator(".jp-NotebookPanel .jp-InputPrompt").evaluate_all("ps => ps.map(p => p.textContent)")
    assert "[5]:" in prompts, prompts
    kernels = ctl.list_kernels()
    assert len(kernels) == 1 and kernels[0]["head"] in {s["id"] for s in ctl.list_sandboxes()}
    shot(page, "kernel-in-lab.png")
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
