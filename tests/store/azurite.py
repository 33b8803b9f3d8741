"""A real Azure Blob Storage server for the store's az:// tests: Azurite, Azure's own emulator (npm,
in tests/store: scripts/setup.sh test installs it), in memory on a loopback port of its own.

obstore reaches it the way it reaches any emulator: ``AZURE_STORAGE_USE_EMULATOR=true`` and
``AZURITE_BLOB_STORAGE_URL`` (the emulator's well-known account ``devstoreaccount1`` and its
published key, which is no secret)."""

from __future__ import annotations

import base64
import contextlib
import email.utils
import hashlib
import hmac
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from ..serving import free_port

BIN = os.path.join(os.path.dirname(__file__), "node_modules", ".bin", "azurite-blob")
ACCOUNT = "devstoreaccount1"
# the key every Azurite and Azure storage emulator accepts, published in Azure's documentation
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
MISSING = None if os.path.exists(BIN) else "Azurite is not installed: scripts/setup.sh test (npm ci --prefix tests/store)"


def _create_container(url: str, container: str) -> None:
    """PUT a container, signed with the account's shared key (obstore makes no containers)."""
    date = email.utils.formatdate(usegmt=True)
    headers = {"x-ms-date": date, "x-ms-version": "2021-08-06"}
    canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
    resource = f"/{ACCOUNT}/{ACCOUNT}/{container}\nrestype:container"
    to_sign = "PUT\n" + "\n" * 11 + canonical + resource
    mac = hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()
    headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(mac).decode()}"
    req = urllib.request.Request(f"{url}/{ACCOUNT}/{container}?restype=container", method="PUT", headers=headers)
    urllib.request.urlopen(req, timeout=30).read()


@contextlib.contextmanager
def azurite(container: str = "forkd"):
    """The emulator's blob URL, with ``container`` made; on exit it stops and its files go."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = tempfile.mkdtemp(prefix="fkaz")  # its output; the blobs it keeps in memory
    log = open(os.path.join(workdir, "azurite.log"), "w")
    proc = subprocess.Popen([BIN, "--inMemoryPersistence", "--blobHost", "127.0.0.1", "--blobPort", str(port),
                             "--skipApiVersionCheck", "--disableProductStyleUrl"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        deadline = time.monotonic() + 60
        while True:  # it answers (any HTTP status) once it listens
            assert proc.poll() is None, f"azurite exited {proc.returncode}: {open(log.name).read()[-2000:]}"
            try:
                urllib.request.urlopen(url, timeout=5)
                break
            except urllib.error.HTTPError:
                break
            except OSError:
                assert time.monotonic() < deadline, "azurite did not listen within 60 s"
                time.sleep(0.1)
        _create_container(url, container)
        yield url
    finally:
        # killed: it keeps everything in memory, and on SIGTERM it waits for its clients' kept-alive
        # connections to close
        proc.kill()
        proc.wait()
        log.close()
        shutil.rmtree(workdir, ignore_errors=True)


def emulator_env(url: str) -> dict[str, str]:
    """The variables by which obstore (in this process or a server's) reaches the emulator at ``url``."""
    return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": url}
