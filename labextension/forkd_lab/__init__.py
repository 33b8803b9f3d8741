"""forkd for JupyterLab: the ``forkd-lab`` prebuilt extension (the lineage sidebar, commands, status bar).

The Python package only carries the built extension; everything it shows comes from the forkd
server extension's REST routes (``{base_url}forkd/v1/...``) and jupyter_server's event bus.
"""

try:
    from ._version import __version__
except ImportError:  # a checkout that was never built or installed
    __version__ = "dev"


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "forkd-lab"}]
