"""Side-by-side display of one cell run in several sandboxes (``%%forkd run``)."""

from __future__ import annotations

import html

from forkd_server.client import Execution

_IMAGES = ("image/png", "image/jpeg", "image/gif")


def _bundle_html(data: dict) -> str:
    if "text/html" in data:
        return f'<div class="forkd-out-html">{data["text/html"]}</div>'
    for mime in _IMAGES:
        if mime in data:
            src = "".join(data[mime]) if isinstance(data[mime], list) else data[mime]
            return f'<img alt="{mime}" src="data:{mime};base64,{src.strip()}" style="max-width:100%">'
    if "image/svg+xml" in data:
        return f'<div>{data["image/svg+xml"]}</div>'
    return _pre(data.get("text/plain", ""))


def _pre(text: str, style: str = "") -> str:
    # JupyterLab's output <pre> has word-break: break-all; a column wraps between words instead
    return (f'<pre style="margin:0;white-space:pre-wrap;word-break:normal;overflow-wrap:anywhere;{style}">'
            f'{html.escape(text)}</pre>')


def _error_text(error: dict) -> str:
    return f"{error.get('ename', 'Error')}: {error.get('evalue', '')}"


class RunResults(dict):
    """``{sandbox id: Execution}`` from ``%%forkd run``; shows the outputs side by side.

    ``failed`` lists the sandboxes whose cell raised; an entry whose request itself failed holds
    an ``Execution`` whose error is ``ForkdError``.
    """

    running: set = frozenset()  # sandboxes still running the cell (while it is shown live)
    interrupted = False  # the user interrupted the run (a --timeout is each sandbox's own error)

    @property
    def failed(self) -> list[str]:
        return [sb for sb, ex in self.items() if ex.error]

    def _repr_html_(self) -> str:
        cols = []
        for sb, ex in self.items():
            parts = [f'<div style="font-weight:600;font-family:monospace;border-bottom:1px solid #d0d7de;'
                     f'margin-bottom:4px">{html.escape(sb)}</div>']
            if ex.stdout:
                parts.append(_pre(ex.stdout))
            for out in ex.results:
                parts.append(_bundle_html(out.get("data", {})))
            if ex.stderr:
                parts.append(_pre(ex.stderr, "background:#fff5f5"))
            if ex.error:
                parts.append(_pre(_error_text(ex.error), "color:#cf222e;font-weight:600"))
            if sb in self.running:
                parts.append('<div style="opacity:.6;font-style:italic">running…</div>')
            cols.append('<div style="min-width:0;border:1px solid #d0d7de;border-radius:4px;'
                        f'padding:4px 6px;overflow-x:auto">{"".join(parts)}</div>')
        # side by side, as many columns as fit (8 sandboxes wrap into rows on a narrow page)
        return ('<div class="forkd-run" style="display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));'
                f'gap:8px;align-items:start">{"".join(cols)}</div>')

    def _repr_pretty_(self, p, cycle) -> None:
        blocks = []
        for sb, ex in self.items():
            lines = [f"[{sb}]"]
            if ex.stdout:
                lines.append(ex.stdout.rstrip("\n"))
            for out in ex.results:
                lines.append(out.get("data", {}).get("text/plain", ""))
            if ex.stderr:
                lines.append(ex.stderr.rstrip("\n"))
            if ex.error:
                lines.append(_error_text(ex.error))
            blocks.append("\n".join(lines))
        p.text("\n\n".join(blocks))


def failed_execution(message: str) -> Execution:
    return Execution(error={"ename": "ForkdError", "evalue": message, "traceback": []})
