"""What an S3 failure is: its error code, the exceptions it wraps, and whether another attempt may succeed."""

from __future__ import annotations

from collections.abc import Iterator

RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "InternalError",
        "500",
        "502",
        "503",
        "504",
    }
)
"""S3 error codes that mean "slow down or try again", retried by ``S3Storage``'s own loop once botocore has given
up."""
NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
"""Codes of a missing object (a HEAD answers with the bare HTTP status)."""
CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
)
"""Codes of AWS credentials S3 rejected."""


def causes(e: BaseException) -> Iterator[BaseException]:
    """``e`` and the exceptions it wraps (s3transfer wraps botocore errors without always chaining)."""
    seen: set[int] = set()
    stack: list[BaseException | None] = [e]
    while stack:
        cur = stack.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        stack += [getattr(cur, "last_exception", None), cur.__cause__, cur.__context__]


def error_code(e: BaseException) -> str | None:
    """The S3 error code (or bare HTTP status) of the first of ``e``'s causes that carries a response, else None."""
    for cause in causes(e):
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code or status:
                return str(code or status)
    return None


def is_retryable(e: BaseException) -> bool:
    """Throttling, 5xx, RequestTimeout and streams cut mid-transfer; not dead endpoints or read timeouts
    (botocore already retried those, and retrying again would make a bad endpoint fail slowly)."""
    from botocore.exceptions import (
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        IncompleteReadError,
        ReadTimeoutError,
        ResponseStreamingError,
    )

    code = error_code(e)
    if code is not None:
        return code in RETRYABLE_CODES
    for cause in causes(e):
        if isinstance(cause, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
            return False
        if isinstance(cause, (ConnectionClosedError, ResponseStreamingError, IncompleteReadError)):
            return True
        if isinstance(cause, (ConnectionResetError, BrokenPipeError)):
            return True
        if type(cause).__name__ in ("ProtocolError", "IncompleteRead"):  # urllib3 / http.client, mid-body
            return True
    return False


def is_boto_error(e: BaseException) -> bool:
    """Whether ``e`` comes from boto3, botocore, s3transfer or urllib3 (the failures an S3 call retries or maps)."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    return isinstance(e, (ClientError, BotoCoreError, Boto3Error, ConnectionError)) or (
        type(e).__module__.startswith(("s3transfer", "urllib3"))
    )
