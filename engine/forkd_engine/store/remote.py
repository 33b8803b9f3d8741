"""A store in object storage, through ``obstore``: one code path for S3 and S3-compatible servers,
Google Cloud Storage, Azure Blob Storage, a local folder (``file://``) and memory (``memory://``).

Layout under the URL's prefix (plain content-addressed objects, nothing else):

- ``chunks/<hex[:2]>/<hex>``: a chunk, zstd-compressed, named by the sha256 of its content;
- ``manifests/<hex>``: a manifest's canonical JSON, named by its own sha256 (the snapshot's digest);
- ``tags/<tag>``: the text ``sha256:<hex>`` of the manifest last pushed under that tag.

Chunks and manifests are written with ``put(mode="create")``: an object that exists is never
rewritten. Every failure becomes a ``StoreError`` naming the store by its URL and the operation;
credentials never appear in a message.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
from urllib.parse import urlsplit

import obstore
from obstore import exceptions as obx
from obstore import store as obs

from .errors import NotInStore, StoreError

SCHEMES = ("s3", "gs", "az", "abfs", "file", "memory")
RETRIES = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=20),
           "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                       "max_backoff": datetime.timedelta(seconds=2), "base": 2}}
CONNECT_TIMEOUT = 5.0    # s to open a connection to the store
REQUEST_TIMEOUT = 120.0  # s a request (one chunk, manifest or tag) has to finish: forkd serve --store-timeout
# What a store says when it has no room: a folder's file system (ENOSPC, EDQUOT), an S3-compatible
# server (MinIO, Ceph), HTTP 507
FULL = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122", "XMinioStorageFull",
        "QuotaExceeded", "Insufficient Storage")
# Where each cloud's store takes its settings and credentials from (said when they are missing or refused)
SETTINGS = {
    "s3": "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "gs": "GOOGLE_SERVICE_ACCOUNT (a service account's JSON file) or GOOGLE_APPLICATION_CREDENTIALS",
    "az": "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY (or AZURE_STORAGE_SAS_TOKEN)",
}
SETTINGS["abfs"] = SETTINGS["az"]
# Variables holding a gs:// or az:// store's secrets: masked in every message, as the S3 secret is
SECRET_VARIABLES = ("GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_BEARER_TOKEN", "AZURE_STORAGE_ACCOUNT_KEY",
                    "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_MASTER_KEY", "AZURE_STORAGE_SAS_KEY",
                    "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_TOKEN", "AZURE_CLIENT_SECRET")


def s3_options_from_env(env=os.environ) -> dict:
    """S3 settings from the standard variables (AWS_ENDPOINT_URL, AWS_REGION or
    AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ALLOW_HTTP)."""
    opts = {"endpoint": env.get("AWS_ENDPOINT_URL") or env.get("AWS_ENDPOINT_URL_S3"),
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
            "access_key_id": env.get("AWS_ACCESS_KEY_ID"),
            "secret_access_key": env.get("AWS_SECRET_ACCESS_KEY"),
            "token": env.get("AWS_SESSION_TOKEN")}
    opts = {k: v for k, v in opts.items() if v}
    if (env.get("AWS_ALLOW_HTTP") or "").lower() in ("1", "true", "yes"):
        opts["allow_http"] = True
    return opts


def check_url(url: str) -> None:
    """Refuse, before anything is opened, a store URL that names no store: an unknown scheme,
    credentials in it, a cloud store without its bucket, a file:// store without an absolute path
    (``file://srv/x`` would be read as the path ``/x`` on the host ``srv``)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise StoreError(f"store {url!r}: unknown scheme {parts.scheme!r}; use s3://bucket/prefix, gs://bucket/prefix, "
                         f"az://container/prefix, file:///path or memory://")
    if parts.username or parts.password:
        raise StoreError("a store URL carries no credentials: give them in AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY (or the cloud's own variables)")
    if parts.scheme in ("s3", "gs", "az", "abfs") and not parts.hostname:
        raise StoreError(f"store {url!r} names no bucket: use {parts.scheme}://BUCKET/prefix")
    if parts.scheme == "file" and (parts.netloc or not parts.path.startswith("/")):
        raise StoreError(f"store {url!r}: a file store takes an absolute path after three slashes, e.g. "
                         f"file:///srv/forkd-store")


class RemoteStore:
    """One store URL. ``options`` (S3: endpoint, region, access_key_id, secret_access_key, token,
    allow_http) override what the environment says. ``timeout``: seconds each request has to finish
    (``REQUEST_TIMEOUT`` by default), for every kind of store that is reached over the network."""

    def __init__(self, url: str, timeout: float | None = None, **options):
        check_url(url)
        try:
            self.timeout = REQUEST_TIMEOUT if timeout is None else float(timeout)
        except (TypeError, ValueError):
            self.timeout = math.nan
        if not 0 < self.timeout < math.inf:
            raise StoreError(f"store {url}: a request timeout of {timeout!r}: give a number of seconds above 0")
        parts = urlsplit(url)
        self.url = url.rstrip("/")
        self._secrets = [v for k, v in options.items() if v and k in ("secret_access_key", "token")]
        self.store = self._open(parts, options)

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r})"

    def _client(self) -> dict:
        return {"connect_timeout": datetime.timedelta(seconds=CONNECT_TIMEOUT),
                "timeout": datetime.timedelta(seconds=self.timeout)}

    def _open(self, parts, options: dict):
        try:
            if parts.scheme == "s3":
                opts = {**s3_options_from_env(), **{k: v for k, v in options.items() if v is not None}}
                self._secrets = [opts[k] for k in ("secret_access_key", "token") if opts.get(k)]
                client = self._client()
                if opts.pop("allow_http", False):
                    client["allow_http"] = True
                return obs.S3Store(parts.netloc, prefix=parts.path.strip("/") or None,
                                   virtual_hosted_style_request=False, client_options=client,
                                   retry_config=RETRIES, **opts)
            if parts.scheme == "file":
                return obs.LocalStore(parts.path, mkdir=True)
            if parts.scheme == "memory":
                return obs.MemoryStore()
            given = sorted(k for k, v in options.items() if v is not None)
            if given:  # the endpoint and region flags are S3's
                raise StoreError(f"store {self.url}: {', '.join(given)} (--store-{given[0]}) is a setting of s3:// "
                                 f"stores; a {parts.scheme}:// store takes its settings from {SETTINGS[parts.scheme]}")
            self._secrets = [os.environ[k] for k in SECRET_VARIABLES if os.environ.get(k)]
            return obs.from_url(self.url, client_options=self._client(), retry_config=RETRIES)
        except StoreError:
            raise
        except Exception as exc:
            hint = f"; set {SETTINGS[parts.scheme]}" if parts.scheme in SETTINGS else ""
            raise StoreError(f"store {self.url}: cannot open it: {self._clean(exc).rstrip('.')}{hint}") from None

    # --- errors ----------------------------------------------------------------------------------

    def _clean(self, exc: BaseException) -> str:
        """The first line of an obstore error, without credentials, Rust debug output or the XML
        body; the store's own error code and message, when it sent them, said plainly."""
        full = str(exc).split("\n\nDebug source:")[0].strip()
        text = full.splitlines()[0].split(": <?xml")[0] if full else type(exc).__name__
        code, message = re.search(r"<Code>([^<]*)</Code>", full), re.search(r"<Message>([^<]*)</Message>", full)
        if code:  # Azure's message goes on with its request id and time on lines of their own
            text += f": {code.group(1)}" + (f": {message.group(1).splitlines()[0]}" if message else "")
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text[:500]

    def _why(self, exc: BaseException) -> str | None:
        """What a person can act on, for the failures a store gives no clear words for: it is full,
        or it did not answer in time (obstore says only "error sending request")."""
        full = str(exc)
        if any(sign in full for sign in FULL):
            return ("the store is full; free space in it (or raise its quota), or use another store "
                    "(forkd serve --store)")
        if "kind: Timeout" in full:
            if "Connect" in full.split("kind: Timeout", 1)[1]:
                return f"no connection within {CONNECT_TIMEOUT:g} s; check that the store is up and reachable from this host"
            return (f"the store did not answer within {self.timeout:g} s (the request timeout); check that it is up, "
                    f"or give it longer (forkd serve --store-timeout SECONDS, c.ForkdApp.store_timeout)")
        return None

    def _settings(self) -> str:
        return SETTINGS.get(urlsplit(self.url).scheme, "the store's own variables")

    @contextlib.contextmanager
    def _op(self, what: str, missing_ok: bool = False):
        try:
            yield
        except (FileNotFoundError, obx.NotFoundError) as exc:
            raise NotInStore(f"store {self.url}: {what}: not found ({self._clean(exc)})") from None
        except (obx.PermissionDeniedError, obx.UnauthenticatedError, PermissionError) as exc:
            raise StoreError(f"store {self.url}: {what}: access denied ({self._clean(exc)}); check the "
                             f"credentials ({self._settings()}) and the bucket's policy") from None
        except (obx.BaseError, OSError) as exc:
            why = self._why(exc)
            raise StoreError(f"store {self.url}: {what} failed: " + (f"{why} ({self._clean(exc)})" if why else
                                                                     self._clean(exc))) from None

    # --- objects ---------------------------------------------------------------------------------

    @staticmethod
    def chunk_path(hexd: str) -> str:
        return f"chunks/{hexd[:2]}/{hexd}"

    def _put_new(self, path: str, data: bytes) -> bool:
        """Write ``path`` unless it exists; True if this call wrote it."""
        with self._op(f"writing {path}"):
            try:
                obstore.put(self.store, path, data, mode="create")
            except obx.AlreadyExistsError:
                return False
            except obx.PreconditionError:
                return False
        return True

    def _get(self, path: str) -> bytes:
        with self._op(f"reading {path}"):
            return bytes(obstore.get(self.store, path).bytes())

    def has(self, path: str) -> bool:
        try:
            with self._op(f"looking up {path}"):
                obstore.head(self.store, path)
            return True
        except NotInStore:
            return False

    def has_chunk(self, hexd: str) -> bool:
        return self.has(self.chunk_path(hexd))

    def put_chunk(self, hexd: str, blob: bytes) -> bool:
        return self._put_new(self.chunk_path(hexd), blob)

    def get_chunk(self, hexd: str) -> bytes:
        return self._get(self.chunk_path(hexd))

    def put_manifest(self, hexd: str, data: bytes) -> bool:
        return self._put_new(f"manifests/{hexd}", data)

    def get_manifest(self, hexd: str) -> bytes:
        return self._get(f"manifests/{hexd}")

    def put_tag(self, tag: str, digest: str) -> None:
        with self._op(f"writing tags/{tag}"):
            obstore.put(self.store, f"tags/{tag}", digest.encode())

    def get_tag(self, tag: str) -> str:
        try:
            return self._get(f"tags/{tag}").decode().strip()
        except NotInStore:
            raise NotInStore(f"store {self.url} has no snapshot tagged {tag!r}") from None

    def list(self, prefix: str) -> list[dict]:
        with self._op(f"listing {prefix}"):
            return [m for batch in obstore.list(self.store, prefix=prefix) for m in batch]

    def delete(self, path: str) -> None:
        with self._op(f"deleting {path}"):
            obstore.delete(self.store, path)
