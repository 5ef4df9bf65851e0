"""S3 tests run against moto's standalone S3 server on 127.0.0.1, started once per session.

The session fixture points the standard AWS environment (credentials, region, ``AWS_ENDPOINT_URL_S3``) at the
server, so spawned ranks inherit it, and creates one bucket; each test gets its own prefix in it. The tests
skip, with the reason, only if the server cannot start.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from harness.s3server import MotoServer, loopback_aws_environ

BUCKET = "nxd-ckpt-test"


def _start_or_skip(extra_env: dict[str, str] | None = None) -> MotoServer:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        pytest.skip(f"S3 tests need boto3 and moto[server] (pip install -e '.[s3,test]'): {e}")
    try:
        return MotoServer(extra_env=extra_env).start()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"the loopback S3 server (moto) could not start: {e}")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[MotoServer]:
    """moto's S3 server on 127.0.0.1 with the AWS environment pointing at it and bucket ``BUCKET`` created."""
    server = _start_or_skip()
    saved = {k: os.environ.get(k) for k in loopback_aws_environ(server.endpoint_url)}
    for key, value in loopback_aws_environ(server.endpoint_url).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ.pop("NXD_CKPT_S3_ENDPOINT_URL", None)
    try:
        import boto3

        boto3.session.Session().client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=BUCKET)
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_url(s3_server: MotoServer, request: pytest.FixtureRequest) -> str:
    """A fresh ``s3://bucket/prefix`` for one test."""
    name = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")
    return f"s3://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def auth_server() -> Iterator[MotoServer]:
    """A second moto server that enforces IAM authentication after its first 4 (setup) requests."""
    server = _start_or_skip(extra_env={"INITIAL_NO_AUTH_ACTION_COUNT": "4"})
    try:
        yield server
    finally:
        server.stop()
