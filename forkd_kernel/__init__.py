"""The forkd kernel ("Python 3 (forkd)"): a notebook whose namespace lives in a forkd sandbox, so
``%forkd branch --live``, ``kids = %forkd fork -n 5`` and ``%forkd checkout`` act on the notebook
itself. ``python -m forkd_kernel -f CONNECTION_FILE`` starts it; the kernelspec ``forkd-python`` is
installed with the package."""

__version__ = "0.1.0"
