"""A real S3 server for the store's tests: moto in server mode (on loopback by default), with its request log."""

from __future__ import annotations

import contextlib
import logging
import re
import urllib.request

from moto.server import ThreadedMotoServer

REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (/\S*) HTTP')


class _Log(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        m = REQUEST.search(record.getMessage())
        if m:
            self.lines.append((m.group(1), m.group(2).split("?")[0]))


@contextlib.contextmanager
def moto_s3(bucket: str = "forkd", ip: str = "127.0.0.1"):
    """(endpoint URL, request log) of a fresh moto S3 server on ``ip`` holding ``bucket``; the log is
    a list of (method, path) of every request the server answered, in order."""
    server = ThreadedMotoServer(ip_address=ip, port=0, verbose=True)
    server.start()
    log = _Log()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(log)
    old_level = werkzeug.level
    werkzeug.setLevel(logging.INFO)
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")).read()
        yield endpoint, log.lines
    finally:
        werkzeug.removeHandler(log)
        werkzeug.setLevel(old_level)
        server.stop()


S3_ENV = {"AWS_ACCESS_KEY_ID": "forkd-test", "AWS_SECRET_ACCESS_KEY": "not-a-real-secret-5c1d",
          "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}
