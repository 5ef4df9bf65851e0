"""Streaming an S3 object up as it is written: whole parts uploaded as they fill, made visible only at the end."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from nxd_ckpt.storage.base import ForwardWriter

Call = Callable[[str, str, Callable[[], Any]], Any]
"""``S3Storage._call``: run one S3 operation (its name, the file's path, the request) with retries."""


class StreamingUpload(ForwardWriter):
    """The write stream of ``S3Storage.open_write``: whole ``part_size`` parts are uploaded as they fill (on
    ``max_concurrency`` threads, each part retried like any request); ``finish`` sends the rest (one PUT if no
    part was needed) and completes the upload; ``abort`` cancels it.

    Args:
        client: returns the boto3 S3 client (created on first use).
        call: runs one request with the storage's retries and error mapping.
        bucket: the bucket.
        key: the object's key.
        path: the file's path under the storage root (for retries' logs and errors).
        part_size: bytes per part (and the threshold below which the file is one PUT).
        max_concurrency: parts in flight at most.
    """

    def __init__(
        self,
        client: Callable[[], Any],
        call: Call,
        bucket: str,
        key: str,
        path: str,
        part_size: int,
        max_concurrency: int,
    ) -> None:
        self._client, self._call = client, call
        self._bucket, self._key, self._path = bucket, key, path
        self._part_size, self._max_concurrency = part_size, max_concurrency
        self._buffer = bytearray()
        self._size = 0
        self._upload_id: str | None = None
        self._parts: list[Any] = []  # futures of {"PartNumber", "ETag"}
        self._pool: Any = None
        self.closed = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buffer += view
        self._size += len(view)
        part = self._part_size
        while len(self._buffer) >= part:
            chunk = bytes(self._buffer[:part])
            del self._buffer[:part]
            self._send(chunk)
        return len(view)

    def flush(self) -> None:
        pass

    def tell(self) -> int:
        return self._size

    def _send(self, chunk: bytes) -> None:
        """Upload ``chunk`` as the next part (starting the multipart upload first); waits while the pool is full."""
        if self._upload_id is None:
            from concurrent.futures import ThreadPoolExecutor

            created = self._call(
                "upload",
                self._path,
                lambda: self._client().create_multipart_upload(Bucket=self._bucket, Key=self._key),
            )
            self._upload_id = created["UploadId"]
            self._pool = ThreadPoolExecutor(max_workers=self._max_concurrency, thread_name_prefix="nxd_ckpt_s3_part")
        in_flight = [f for f in self._parts if not f.done()]
        if len(in_flight) >= self._max_concurrency:
            in_flight[0].result()
        number = len(self._parts) + 1
        upload_id = self._upload_id

        def put_part() -> dict[str, Any]:
            response = self._client().upload_part(
                Bucket=self._bucket, Key=self._key, PartNumber=number, UploadId=upload_id, Body=chunk
            )
            return {"PartNumber": number, "ETag": response["ETag"]}

        self._parts.append(self._pool.submit(self._call, "upload part", self._path, put_part))

    def finish(self) -> None:
        """Send what is left and make the object visible (one PUT, or the multipart upload's completion)."""
        self.closed = True
        if self._upload_id is None:
            data = bytes(self._buffer)
            self._call(
                "upload", self._path, lambda: self._client().put_object(Bucket=self._bucket, Key=self._key, Body=data)
            )
            return
        if self._buffer:
            self._send(bytes(self._buffer))
            self._buffer.clear()
        parts = [f.result() for f in self._parts]
        self._pool.shutdown()
        upload = {"Parts": parts}
        self._call(
            "upload",
            self._path,
            lambda: self._client().complete_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=self._upload_id, MultipartUpload=upload
            ),
        )

    def abort(self) -> None:
        """Cancel the upload: nothing becomes visible (best effort; S3 lifecycle rules reap what is left)."""
        self.closed = True
        if self._pool is not None:
            for f in self._parts:
                f.cancel()
            self._pool.shutdown(wait=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):
                self._client().abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self._upload_id)
