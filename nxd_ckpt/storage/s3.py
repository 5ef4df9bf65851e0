"""S3 (and S3-compatible) storage through boto3 and its transfer manager; boto3 is imported lazily.

``S3Storage`` here: the client, each operation's retries and its failure in plain words (``StorageError``), reads,
writes, listing and deletion. Its write stream is ``s3_upload.StreamingUpload``; what a boto failure is (its code,
whether to retry) is ``s3_errors``.

Why boto3 and not ``s3torchconnector``: its public package imports torch (storage must not), its CRT client
is a private module documented as unstable, it has no batched DeleteObjects (retention would cost one request
per file), and it has no connect/read timeout, so an endpoint that accepts connections but never answers hangs
a save indefinitely. See docs/s3.md.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, TypeVar, cast

from nxd_ckpt import knobs
from nxd_ckpt.errors import StorageError
from nxd_ckpt.storage.base import Storage, check_relative_path
from nxd_ckpt.storage.s3_errors import (
    CREDENTIAL_CODES,
    NOT_FOUND_CODES,
    RETRYABLE_CODES,
    causes,
    error_code,
    is_boto_error,
    is_retryable,
)
from nxd_ckpt.storage.s3_upload import StreamingUpload

logger = logging.getLogger("nxd_ckpt")

T = TypeVar("T")

ENDPOINT_ENV = "NXD_CKPT_S3_ENDPOINT_URL"
MIB = 1 << 20

_session_lock = threading.Lock()
_sessions: dict[tuple[int, str | None], Any] = {}


def _crt_installed() -> bool:
    """Whether boto3 can use the AWS Common Runtime (``awscrt``, the ``s3-crt`` extra)."""
    try:
        import awscrt.s3  # noqa: F401
    except ImportError:
        return False
    return True


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ``("bucket", "some/prefix")``."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an S3 URL: {url!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise ValueError(f"S3 URL {url!r} has no bucket name (expected s3://bucket/prefix)")
    if prefix:
        check_relative_path(prefix)
    return bucket, prefix


def _shared_session(profile_name: str | None) -> Any:
    """One boto3 session per process and profile: creating clients from it is cheap and thread-safe here."""
    import boto3

    key = (os.getpid(), profile_name)
    with _session_lock:
        if key not in _sessions:
            _sessions[key] = boto3.session.Session(profile_name=profile_name)
        return _sessions[key]


class S3Storage(Storage):
    """A checkpoint directory at ``s3://bucket/prefix`` (AWS S3 or any S3-compatible endpoint).

    Atomic commit on S3: there is no rename, but every object appears whole or not at all when its PUT (or
    CompleteMultipartUpload) returns, and readers never see a partial object. ``open_write`` therefore uploads
    from memory, part by part as the file is written, and makes the object visible only when the block exits
    without error; a failed upload is aborted and leaves nothing. A checkpoint tag is committed by rank 0
    writing ``<tag>/done`` after every rank's uploads returned, so ``done`` is the last object of a tag and its
    presence is the commit; S3's read-after-write consistency makes it visible to every reader at once.

    Credentials come from the standard AWS chain (environment, shared config/credentials files, SSO, instance
    or container role). The endpoint is, in order: ``endpoint_url``, ``$NXD_CKPT_S3_ENDPOINT_URL``, then
    boto3's own (``$AWS_ENDPOINT_URL_S3``, ``$AWS_ENDPOINT_URL``, ``endpoint_url`` in the AWS config file).

    Retries are bounded so bad endpoints fail promptly: botocore's retry mode (``standard`` unless
    ``$AWS_RETRY_MODE`` says otherwise, ``max_attempts`` tries) handles each request, and on top of it this
    class retries throttling (SlowDown, 503), RequestTimeout, 5xx and connections reset mid-stream with
    exponential backoff and full jitter, at most ``retries`` times and within ``retry_deadline_s``. Endpoints
    that refuse connections or do not answer are not retried beyond botocore's attempts.

    Args:
        url: ``s3://bucket`` or ``s3://bucket/prefix``.
        endpoint_url: an S3-compatible endpoint such as ``http://127.0.0.1:9000``.
        region_name: the bucket's region (default: the AWS chain's, else boto3's default).
        session: a ``boto3.session.Session`` to take credentials from (default: a shared per-process one).
        part_size: multipart chunk size and threshold, in bytes (default ``NXD_CKPT_S3_PART_SIZE``, 16 MiB).
        max_concurrency: parallel part uploads/downloads per file (default ``NXD_CKPT_S3_MAX_CONCURRENCY``, 10).
        spool_bytes: how much of a large file being read is kept in memory before spilling to disk (writes
            never spill: they upload from memory, part by part).
        max_attempts: botocore attempts per request (default ``$AWS_MAX_ATTEMPTS`` or 4).
        retries: extra attempts of a whole operation on throttling/transient errors.
        retry_deadline_s: no retry is started after this many seconds of one operation.
        connect_timeout: seconds to wait for a TCP connection.
        read_timeout: seconds to wait for data on an open connection.
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        session: Any = None,
        part_size: int | None = None,
        max_concurrency: int | None = None,
        spool_bytes: int = 256 * MIB,
        max_attempts: int | None = None,
        retries: int = 4,
        retry_deadline_s: float = 120.0,
        connect_timeout: float = 5.0,
        read_timeout: float = 20.0,
    ) -> None:
        self.bucket, self.prefix = parse_s3_url(url)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.endpoint_url = endpoint_url or knobs.s3_endpoint_url()
        self.region_name = region_name
        self.part_size = int(part_size if part_size is not None else knobs.s3_part_size())
        self.max_concurrency = int(max_concurrency if max_concurrency is not None else knobs.s3_max_concurrency())
        self.spool_bytes = int(spool_bytes)
        self.max_attempts = int(max_attempts or os.environ.get("AWS_MAX_ATTEMPTS") or 4)
        self.retries = int(retries)
        self.retry_deadline_s = float(retry_deadline_s)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._session = session
        self._client_obj: Any = None
        self._client_lock = threading.Lock()
        if self.part_size < 5 * MIB:
            raise ValueError(f"part_size must be at least 5 MiB (S3's minimum part size), got {part_size}")

    # ----------------------------------------------------------------- client and error plumbing
    @property
    def _client(self) -> Any:
        """The boto3 S3 client, created on first use (thread-safe; boto3 clients are safe to share)."""
        if self._client_obj is None:
            with self._client_lock:
                if self._client_obj is None:
                    self._client_obj = self._make_client()
        return self._client_obj

    def _make_client(self) -> Any:
        try:
            from botocore.config import Config
        except ImportError as e:
            raise StorageError(
                f"checkpoint location {self.url} needs boto3: pip install 'nxd-ckpt[s3]' (or boto3)"
            ) from e
        config = Config(
            retries={"mode": os.environ.get("AWS_RETRY_MODE", "standard"), "total_max_attempts": self.max_attempts},
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            max_pool_connections=max(10, self.max_concurrency + 4),
            user_agent_extra="nxd-ckpt",
        )
        session = self._session or _shared_session(None)
        return session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region_name, config=config)

    def transfer_client(self) -> str:
        """Which transfer manager moves files of ``part_size`` and more: ``crt`` (the AWS Common Runtime, far
        faster on large instances) or ``classic`` (boto3's threads, with this class's timeouts and retries).
        ``NXD_CKPT_S3_TRANSFER_CLIENT=auto`` picks crt when ``awscrt`` is installed and the endpoint is AWS's
        own: boto3 gives the CRT no custom endpoint, so it is never used with MinIO, a proxy or a loopback
        server."""
        choice = knobs.s3_transfer_client()
        if choice == "classic":
            return "classic"
        aws_endpoint = "amazonaws.com" in str(self._client.meta.endpoint_url)
        if choice == "auto":
            return "crt" if aws_endpoint and _crt_installed() else "classic"
        if not _crt_installed():
            raise StorageError(
                "NXD_CKPT_S3_TRANSFER_CLIENT=crt needs the AWS Common Runtime: pip install 'nxd-ckpt[s3-crt]' "
                "(awscrt), or set it to auto"
            )
        if not aws_endpoint:
            raise StorageError(
                f"NXD_CKPT_S3_TRANSFER_CLIENT=crt cannot reach the custom endpoint {self._client.meta.endpoint_url}: "
                "boto3's CRT transfer manager talks to AWS's own endpoints only; set it to auto or classic"
            )
        return "crt"

    def _transfer_config(self) -> Any:
        from boto3.s3.transfer import TransferConfig

        settings: dict[str, Any] = {
            "multipart_threshold": self.part_size,
            "multipart_chunksize": self.part_size,
            "max_concurrency": self.max_concurrency,
        }
        client = self.transfer_client()
        if client == "crt":  # the CRT accepts no other setting (use_threads etc.)
            return TransferConfig(**settings, preferred_transfer_client="crt")
        settings["use_threads"] = True
        try:  # our retry/timeout settings apply to the classic client, not to the CRT one boto3 may pick
            return TransferConfig(**settings, preferred_transfer_client="classic")
        except TypeError:  # boto3 older than the CRT option: classic is the only client
            return TransferConfig(**settings)

    def _key(self, path: str) -> str:
        check_relative_path(path)
        if self.prefix and path:
            return f"{self.prefix}/{path}"
        return self.prefix or path

    def _dir_prefix(self, path: str) -> str:
        key = self._key(path)
        return f"{key}/" if key else ""

    def _where(self, path: str) -> str:
        return f"s3://{self.bucket}/{self._key(path)}"

    def _call(self, op: str, path: str, fn: Callable[[], T]) -> T:
        """Run one S3 operation with bounded backoff-and-jitter retries; map failures to StorageError."""
        deadline = time.monotonic() + self.retry_deadline_s
        attempt = 0
        while True:
            try:
                return fn()
            except StorageError:
                raise
            except Exception as e:
                if not is_boto_error(e):
                    raise
                delay = random.uniform(0, min(8.0, 0.25 * 2**attempt))  # full jitter
                if attempt < self.retries and is_retryable(e) and time.monotonic() + delay < deadline:
                    attempt += 1
                    logger.warning(
                        "S3 %s of %s failed (%s); retry %d/%d in %.2f s",
                        op,
                        self._where(path),
                        error_code(e) or type(e).__name__,
                        attempt,
                        self.retries,
                        delay,
                    )
                    time.sleep(delay)
                    continue
                raise self._storage_error(op, path, e, attempt) from e

    def _storage_error(self, op: str, path: str, e: BaseException, retried: int) -> StorageError:
        """A StorageError naming the bucket/key, the cause in plain words, and what to check."""
        from botocore.exceptions import (
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        where = self._where(path)
        code = error_code(e)
        detail = next((str(c) for c in causes(e) if getattr(c, "response", None)), str(e))
        after = f" (after {retried} extra retries)" if retried else ""
        endpoint = self.endpoint_url or "the default AWS endpoint"
        if code == "NoSuchBucket":
            return StorageError(f"S3 bucket {self.bucket!r} does not exist ({op} {where}); create it or fix the URL")
        if code in NOT_FOUND_CODES:
            return StorageError(f"file not found: {where} ({op})")
        if code in CREDENTIAL_CODES:
            return StorageError(
                f"S3 rejected the AWS credentials ({code}) on {op} {where}: check AWS_ACCESS_KEY_ID/"
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the instance role ({detail})"
            )
        if code in ("AccessDenied", "AllAccessDisabled", "AccountProblem"):
            return StorageError(
                f"access denied to {where} ({op}): the credentials lack permission on bucket {self.bucket!r}; "
                f"check the IAM and bucket policies ({detail})"
            )
        if code == "403":  # HEAD responses carry no error code: either cause is possible
            return StorageError(
                f"access denied to {where} ({op}, HTTP 403): the AWS credentials were rejected or lack permission "
                f"on bucket {self.bucket!r}; check the credentials and the IAM and bucket policies"
            )
        for cause in causes(e):
            if isinstance(cause, (NoCredentialsError, PartialCredentialsError)):
                return StorageError(
                    f"no usable AWS credentials for {op} {where}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                    f"AWS_PROFILE, or run with an instance/container role ({cause})"
                )
            if isinstance(cause, (EndpointConnectionError, ConnectTimeoutError)):
                return StorageError(
                    f"cannot connect to S3 endpoint {endpoint} for {op} {where}{after}: {cause}; check the "
                    f"endpoint URL ({ENDPOINT_ENV} / AWS_ENDPOINT_URL_S3) and the network"
                )
            if isinstance(cause, ReadTimeoutError):
                return StorageError(
                    f"S3 endpoint {endpoint} did not answer {op} {where} within {self.read_timeout} s "
                    f"({self.max_attempts} attempts){after}: {cause}"
                )
        if code in RETRYABLE_CODES:
            return StorageError(
                f"S3 kept failing {op} {where} with {code}{after}; the endpoint is overloaded: {detail}"
            )
        return StorageError(f"S3 {op} of {where} failed{after}: {detail}")

    # ----------------------------------------------------------------- writing
    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """Upload from memory as the bytes come: a file smaller than ``part_size`` is one PUT when the block
        exits; a larger one becomes a multipart upload whose parts go out while the rest is written (at most
        ``max_concurrency`` in flight, so memory stays within (max_concurrency + 1) parts; no temporary file),
        completed when the block exits without error and aborted (nothing visible) otherwise."""
        upload = StreamingUpload(
            lambda: self._client, self._call, self.bucket, self._key(path), path, self.part_size, self.max_concurrency
        )
        try:
            yield cast(BinaryIO, upload)
            upload.finish()
        except BaseException:
            upload.abort()
            raise

    ranged_reads = True  # read_bytes(offset, length) is one ranged GET; open_read downloads the whole object
    mtime_resolution_s = 1.0  # LastModified: whole seconds

    def write_from_local_file(self, path: str, local_file: str) -> None:
        """Upload a local file as it is (multipart past ``part_size``), without buffering it again."""
        self._key(path)
        with open(local_file, "rb") as f:
            self._upload(path, f, os.fstat(f.fileno()).st_size)

    def write_bytes(self, path: str, data: bytes | bytearray | memoryview) -> None:
        """Write a whole small file with one PUT (multipart if it is large)."""
        self._key(path)
        self._upload(path, io.BytesIO(data), len(data))

    def _upload(self, path: str, f: Any, size: int) -> None:
        key = self._key(path)

        def upload() -> None:
            f.seek(0)
            if size < self.part_size:  # one PUT, no transfer-manager threads
                self._client.put_object(Bucket=self.bucket, Key=key, Body=f.read())
            else:  # parallel multipart upload; aborted (nothing visible) on failure
                self._client.upload_fileobj(f, self.bucket, key, Config=self._transfer_config())

        self._call("upload", path, upload)

    # ----------------------------------------------------------------- reading
    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        """The whole object in a seekable buffer. Objects up to ``part_size`` cost one GET (of the first
        ``part_size`` bytes); larger ones are downloaded by the transfer manager in parallel ranged GETs into a
        spooled file (the first part is fetched twice, which bounds the waste at one part)."""
        key = self._key(path)

        def get_small() -> bytes | None:
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes=0-{self.part_size - 1}")
            except Exception as e:
                if error_code(e) == "InvalidRange":  # only an empty object has no byte 0
                    return b""
                raise
            with contextlib.closing(response["Body"]) as body:
                content_range = response.get("ContentRange") or ""  # "bytes 0-1023/5000"
                total = int(content_range.rpartition("/")[2]) if "/" in content_range else None
                if total is not None and total > self.part_size:
                    return None
                return body.read()

        data = self._call("read", path, get_small)
        if data is not None:
            with io.BytesIO(data) as small:
                yield cast(BinaryIO, small)
            return
        buf = tempfile.SpooledTemporaryFile(max_size=self.spool_bytes, prefix="nxd_ckpt_s3_")  # noqa: SIM115
        try:

            def download() -> None:
                buf.seek(0)
                buf.truncate()
                self._client.download_fileobj(self.bucket, key, buf, Config=self._transfer_config())

            self._call("download", path, download)
            buf.seek(0)
            yield cast(BinaryIO, buf)
        finally:
            buf.close()

    def read_bytes(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        """The object's bytes, or ``length`` bytes from ``offset`` with a Range GET."""
        key = self._key(path)
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"invalid byte range offset={offset} length={length} for {self._where(path)}")
        if length == 0:
            return b""
        args: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            args["Range"] = f"bytes={offset}-{end}"

        def get() -> bytes:
            try:
                response = self._client.get_object(**args)
            except Exception as e:
                if error_code(e) == "InvalidRange":  # offset at or past the end, like reading a file there
                    return b""
                raise
            with contextlib.closing(response["Body"]) as body:
                return body.read()

        return self._call("read", path, get)

    # ----------------------------------------------------------------- metadata and listing
    def _head(self, path: str) -> dict[str, Any] | None:
        key = self._key(path)

        def head() -> dict[str, Any] | None:
            try:
                return self._client.head_object(Bucket=self.bucket, Key=key)
            except Exception as e:
                if error_code(e) in NOT_FOUND_CODES:
                    return None
                raise

        return self._call("head", path, head)

    def _any_under(self, path: str) -> bool:
        prefix = self._dir_prefix(path)
        response = self._call(
            "list",
            path,
            lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1),
        )
        return bool(response.get("KeyCount") or response.get("Contents"))

    def exists(self, path: str) -> bool:
        """A HEAD for the object, then (only if it is missing) a one-key LIST for a "directory"."""
        if path and self._head(path) is not None:
            return True
        return self._any_under(path)

    def size(self, path: str) -> int:
        head = self._head(path)
        if head is None:
            raise StorageError(f"file not found: {self._where(path)}")
        return int(head["ContentLength"])

    def mtime(self, path: str) -> float:
        head = self._head(path)
        if head is None:
            raise StorageError(f"file not found: {self._where(path)}")
        return float(head["LastModified"].timestamp())

    def _list_prefix(self, path: str, prefix: str, delimiter: bool) -> tuple[list[str], list[str]]:
        """(object keys, common prefixes) starting with ``prefix``, paginated (1000 keys per request)."""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = "/"

        def list_all() -> tuple[list[str], list[str]]:
            keys: list[str] = []
            prefixes: list[str] = []
            for page in self._client.get_paginator("list_objects_v2").paginate(**kwargs):
                keys += [obj["Key"] for obj in page.get("Contents", ())]
                prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", ())]
            return keys, prefixes

        return self._call("list", path, list_all)

    def _list(self, path: str, delimiter: bool) -> tuple[list[str], list[str]]:
        """(object keys, common prefixes) under the "directory" ``path``."""
        return self._list_prefix(path, self._dir_prefix(path), delimiter)

    def list_dir(self, path: str = "") -> list[str]:
        """ListObjectsV2 with Delimiter="/": objects and sub-prefixes directly under ``path``."""
        strip = len(self._dir_prefix(path))
        keys, prefixes = self._list(path, delimiter=True)
        names = {k[strip:] for k in keys} | {p[strip:].rstrip("/") for p in prefixes}
        return sorted(n for n in names if n)

    def walk_files(self, path: str = "") -> list[str]:
        """Every object under ``path`` with one paginated LIST (no per-directory requests)."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys, _ = self._list(path, delimiter=False)
        return sorted(k[strip:] for k in keys if not k.endswith("/"))

    # ----------------------------------------------------------------- deleting
    def delete(self, path: str) -> None:
        key = self._key(path)
        self._call("delete", path, lambda: self._client.delete_object(Bucket=self.bucket, Key=key))

    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it with batched DeleteObjects (1000 keys per request)."""
        if not path:
            raise StorageError(f"refusing to delete the whole checkpoint directory {self.url}")
        key = self._key(path)
        # One delimited LIST tells whether ``path`` is an object, a "directory", both or nothing (siblings
        # such as ``x.pt.tensors/`` come back collapsed into one prefix each).
        found, prefixes = self._list_prefix(path, key, delimiter=True)
        keys = [key] if key in found else []
        if f"{key}/" in prefixes:
            keys += self._list(path, delimiter=False)[0]
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]

            def delete_batch(batch: list[str] = batch) -> None:
                response = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
                errors = response.get("Errors") or []
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"could not delete {len(errors)} of {len(batch)} objects under {self._where(path)}; "
                        f"first: {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                    )

            self._call("delete", path, delete_batch)
