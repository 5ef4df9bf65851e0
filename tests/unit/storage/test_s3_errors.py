"""What an S3 failure is, read off botocore's exceptions: throttling and 5xx are retried by S3Storage's own loop,
a missing object or rejected credentials are not, and a cause wrapped without chaining is still found."""

from __future__ import annotations

import pytest

from nxd_ckpt.storage import s3_errors

botocore_exceptions = pytest.importorskip("botocore.exceptions")  # the s3 extra (and the test extra's moto)


def _client_error(code: str, status: int = 400) -> Exception:
    response = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return botocore_exceptions.ClientError(response, "PutObject")


class Wrapper(Exception):
    """As s3transfer wraps a botocore error: in an attribute, neither chained nor raised from it."""

    def __init__(self, inner: BaseException) -> None:
        super().__init__("upload failed")
        self.last_exception = inner


@pytest.mark.parametrize(("code", "retry"), [("SlowDown", True), ("503", True), ("NoSuchKey", False)])
def test_client_errors_are_retried_by_code(code, retry):
    assert s3_errors.error_code(_client_error(code)) == code
    assert s3_errors.is_retryable(_client_error(code)) is retry


def test_a_wrapped_cause_is_found():
    wrapped = Wrapper(_client_error("ExpiredToken"))
    assert s3_errors.error_code(wrapped) in s3_errors.CREDENTIAL_CODES
    assert not s3_errors.is_retryable(wrapped)


def test_a_stream_cut_mid_transfer_is_retried_and_a_dead_endpoint_is_not():
    assert s3_errors.is_retryable(Wrapper(ConnectionResetError("reset by peer")))
    dead = botocore_exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    assert not s3_errors.is_retryable(dead)
    assert s3_errors.is_boto_error(dead) and not s3_errors.is_boto_error(ValueError("not S3"))
