"""The loopback S3 set-up the ``s3`` suite and saveload's ``s3_loopback`` section share: a moto server on
127.0.0.1 (not AWS S3) and this process's AWS environment pointed at it."""

from __future__ import annotations

import os

S3_TITLE = "S3 (loopback moto server)"
S3_BUCKET = "nxd-ckpt-bench"


def apply_loopback_s3_env(endpoint_url: str) -> None:
    """Point this process's AWS environment at the loopback moto server at ``endpoint_url``."""
    from harness.s3server import loopback_aws_environ

    for key, value in loopback_aws_environ(endpoint_url).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def have_moto() -> bool:
    """Whether boto3 and moto's server import here."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True
