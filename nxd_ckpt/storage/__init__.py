"""Storage backends, chosen from the checkpoint directory's form (``s3://`` or a local path)."""

from __future__ import annotations

import os

from nxd_ckpt.storage.base import DelegatingStorage, Storage, check_relative_path
from nxd_ckpt.storage.local import LocalStorage

__all__ = ["DelegatingStorage", "LocalStorage", "Storage", "check_relative_path", "storage_for"]


def storage_for(checkpoint_dir: str | os.PathLike[str] | Storage) -> Storage:
    """The backend for a checkpoint directory: an ``s3://bucket/prefix`` URL or a local path."""
    if isinstance(checkpoint_dir, Storage):
        return checkpoint_dir
    url = os.fspath(checkpoint_dir)
    if url.startswith("s3://"):
        from nxd_ckpt.storage.s3 import S3Storage  # imported lazily: boto3 is optional

        return S3Storage(url)
    if "://" in url:
        raise ValueError(f"unsupported checkpoint location {url!r}: use a local path or s3://bucket/prefix")
    return LocalStorage(url)
