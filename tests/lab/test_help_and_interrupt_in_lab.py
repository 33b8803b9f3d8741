"""A forkd kernel notebook in JupyterLab, as a person uses it (Debian's Chromium through Playwright):
``%forkd?`` shows the magic's help as plain text where ipykernel shows a magic's, and an interrupted
cell's traceback is the user's own code, stopped at their line."""

from __future__ import annotations

from .test_insert_and_toasts import open_notebook
from .test_panel import set_theme, shot


def run_typed(page, code: str, *, then=None) -> str:
    """Put ``code`` in the active cell, run it (Shift+Enter), optionally do ``then()`` while it runs,
    and return what its output area shows once its prompt has a number."""
    index = page.evaluate("window.jupyterapp.shell.currentWidget.content.activeCellIndex")
    page.evaluate(f"window.jupyterapp.shell.currentWidget.content.activeCell.model.sharedModel.setSource({code!r})")
    page.locator(".jp-NotebookPanel .jp-Cell.jp-mod-active .cm-content").click()
    page.keyboard.press("Shift+Enter")
    if then is not None:
        then()
    page.wait_for_function(
        "i => /\\[\\d+\\]/.test(document.querySelectorAll('.jp-NotebookPanel .jp-Cell')[i]"
        ".querySelector('.jp-InputPrompt').textContent)", arg=index, timeout=120_000)
    return page.locator(".jp-NotebookPanel .jp-Cell").nth(index).locator(".jp-OutputArea").text_content()


def test_help_and_an_interrupt_in_a_forkd_notebook(page, lab):
    open_notebook(page, "forkd-python")
    text = run_typed(page, "%forkd?")
    assert "Object `%forkd` not found" not in text
    assert "Docstring:" in text and "Fork-on-write Python sandboxes from a notebook." in text
    assert "%forkd branch [--tag TAG] [--diff] [--live] [--no-wait] [--lossy] [sandbox]" in text
    assert "::" not in text
    page.locator(".jp-NotebookPanel .jp-Cell").first.locator(".jp-OutputArea").scroll_into_view_if_needed()
    shot(page, "lab-forkd-help-light.png")

    def interrupt_once_running():
        page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayStatus === 'busy'")
        page.wait_for_timeout(1500)  # the cell is inside time.sleep by then; interrupting earlier is fine too
        page.evaluate("window.jupyterapp.commands.execute('notebook:interrupt-kernel')")

    text = run_typed(page, "import time\n\ndef wait():\n    time.sleep(60)\n\nwait()", then=interrupt_once_running)
    assert "KeyboardInterrupt" in text and "----> 4     time.sleep(60)" in text, text
    assert "executor.py" not in text and "forkd_engine" not in text and "_on_sigint" not in text, text
    set_theme(page, dark=True)
    shot(page, "lab-forkd-interrupt-dark.png")
    set_theme(page, dark=False)
    page.evaluate("window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
