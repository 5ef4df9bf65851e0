"""S3Storage against the loopback moto server: the Storage contract, multipart, byte ranges, listing, deletion,
endpoint selection, and prompt, clear errors for a missing bucket, bad credentials, denied access and dead
endpoints."""

from __future__ import annotations

import os
import socket

import pytest

from harness.s3server import ThrottlingProxy, refusing_port
from nxd_ckpt.errors import StorageError
from nxd_ckpt.storage import storage_for
from nxd_ckpt.storage.s3 import ENDPOINT_ENV, MIB, S3Storage, parse_s3_url

pytestmark = [pytest.mark.s3, pytest.mark.device_independent]


def test_parse_url_and_routing(s3_url):
    assert parse_s3_url("s3://bkt") == ("bkt", "")
    assert parse_s3_url("s3://bkt/a/b/") == ("bkt", "a/b")
    with pytest.raises(ValueError, match="no bucket"):
        parse_s3_url("s3:///prefix")
    with pytest.raises(ValueError, match="'..'"):
        parse_s3_url("s3://bkt/a/../b")
    storage = storage_for(s3_url + "/")
    assert isinstance(storage, S3Storage) and storage.url == s3_url


def test_write_read_list_exists_size_delete(s3_url):
    s = S3Storage(s3_url)
    s.write_bytes("step_1/done", b"1")
    with s.open_write("step_1/model/dp_rank_00.pt") as f:
        f.write(b"model bytes")
    s.write_bytes("step_2/checkpoint", b"1")
    assert s.list_dir() == ["step_1", "step_2"]
    assert s.list_dir("step_1") == ["done", "model"]
    assert s.list_dir("missing") == []
    assert s.walk_files() == ["step_1/done", "step_1/model/dp_rank_00.pt", "step_2/checkpoint"]
    assert s.walk_files("step_1/model") == ["step_1/model/dp_rank_00.pt"]
    assert s.exists("step_1/done") and s.exists("step_1") and s.exists("step_1/model") and s.exists("")
    assert not s.exists("step_1/missing") and not s.exists("step_3") and not s.exists("step_1/do")
    assert s.size("step_1/model/dp_rank_00.pt") == len(b"model bytes")
    assert s.mtime("step_1/done") > 1.6e9
    with s.open_read("step_1/model/dp_rank_00.pt") as f:
        assert f.read() == b"model bytes"
        f.seek(6)
        assert f.read() == b"bytes"
    s.delete("step_1/done")
    s.delete("step_1/done")  # deleting a missing file is not an error
    assert not s.exists("step_1/done")
    s.delete_tree("step_1")
    assert s.list_dir() == ["step_2"]
    with pytest.raises(StorageError, match="refusing"):
        s.delete_tree("")


def test_byte_ranges(s3_url):
    s = S3Storage(s3_url)
    data = bytes(range(256)) * 4
    s.write_bytes("f.bin", data)
    assert s.read_bytes("f.bin") == data
    assert s.read_bytes("f.bin", 10, 5) == data[10:15]
    assert s.read_bytes("f.bin", 1000) == data[1000:]
    assert s.read_bytes("f.bin", 1020, 100) == data[1020:]  # a range past the end is cut, as with a file
    assert s.read_bytes("f.bin", 5000) == b""
    assert s.read_bytes("f.bin", 7, 0) == b""
    with pytest.raises(ValueError, match="invalid byte range"):
        s.read_bytes("f.bin", -1)
    s.write_bytes("empty", b"")
    with s.open_read("empty") as f:
        assert f.read() == b""
    assert s.read_bytes("empty") == b"" and s.read_bytes("empty", 3, 4) == b"" and s.size("empty") == 0


def test_multipart_upload_and_parallel_download(s3_url):
    s = S3Storage(s3_url, part_size=5 * MIB, max_concurrency=4, spool_bytes=1 * MIB)
    data = os.urandom(11 * MIB + 123)  # three parts; spooled to disk on both sides
    with s.open_write("big.bin") as f:
        for start in range(0, len(data), 3 * MIB):
            f.write(data[start : start + 3 * MIB])
    head = s._client.head_object(Bucket=s.bucket, Key=s._key("big.bin"))
    assert head["ETag"].strip('"').endswith("-3")  # multipart: 3 parts
    with s.open_read("big.bin") as f:
        assert f.read() == data
    assert s.read_bytes("big.bin", 6 * MIB, 10) == data[6 * MIB : 6 * MIB + 10]
    s.delete_tree("big.bin")  # a file path: deletes the file
    assert not s.exists("big.bin")


def test_failed_write_leaves_nothing(s3_url):
    s = S3Storage(s3_url, part_size=5 * MIB)
    with pytest.raises(RuntimeError, match="serializer broke"), s.open_write("partial.pt") as f:
        f.write(os.urandom(6 * MIB))
        raise RuntimeError("serializer broke")
    assert not s.exists("partial.pt")
    uploads = s._client.list_multipart_uploads(Bucket=s.bucket, Prefix=s.prefix).get("Uploads", [])
    assert uploads == []


def test_delete_tree_batches_beyond_one_request(s3_url):
    s = S3Storage(s3_url)
    names = [f"tag/model/dp_rank_00.pt.tensors/tensor_{i}.pt" for i in range(1005)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: s.write_bytes(n, b"x"), names))
    s.write_bytes("tag0/done", b"1")  # a sibling sharing the name prefix survives
    s.write_bytes("tag.pt", b"1")
    assert len(s.walk_files("tag")) == 1005  # more than one LIST page
    s.delete_tree("tag")
    assert s.walk_files() == ["tag.pt", "tag0/done"]
    s.delete_tree("missing")  # nothing there: not an error


def test_missing_file_and_missing_bucket_name_the_object(s3_url):
    s = S3Storage(s3_url)
    with pytest.raises(StorageError, match=r"file not found: s3://nxd-ckpt-test/.*/nope\.pt"):
        s.read_bytes("nope.pt")
    with pytest.raises(StorageError, match="file not found"), s.open_read("nope.pt"):
        pass
    with pytest.raises(StorageError, match="file not found"):
        s.size("nope.pt")
    missing = S3Storage("s3://no-such-bucket-here/run")
    for op in (lambda: missing.list_dir(), lambda: missing.exists("t/done"), lambda: missing.write_bytes("a", b"1")):
        with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
            op()


def test_endpoint_precedence(s3_server, monkeypatch):
    assert S3Storage("s3://b/p").endpoint_url is None  # boto3 reads AWS_ENDPOINT_URL_S3 itself
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:1")
    assert S3Storage("s3://b/p").endpoint_url == "http://127.0.0.1:1"
    assert S3Storage("s3://b/p", endpoint_url=s3_server.endpoint_url).endpoint_url == s3_server.endpoint_url


def test_refused_endpoint_fails_promptly_with_the_cause(s3_server):
    with refusing_port() as port:
        s = S3Storage("s3://bkt/run", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2)
        with pytest.raises(
            StorageError, match=r"cannot connect to S3 endpoint http://127\.0\.0\.1:\d+ for upload s3://bkt/"
        ):
            s.write_bytes("step_1/checkpoint", b"1")


def test_silent_endpoint_times_out_with_the_cause(s3_server):
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        s = S3Storage("s3://bkt/run", endpoint_url=url, connect_timeout=1, read_timeout=1, max_attempts=2)
        with pytest.raises(StorageError, match=r"did not answer list s3://bkt/run within 1 s \(2 attempts\)"):
            s.list_dir()


def test_bad_credentials_and_denied_access(auth_server):
    import boto3

    endpoint = auth_server.endpoint_url
    iam = boto3.session.Session().client("iam", endpoint_url=endpoint)
    iam.create_user(UserName="no-permissions")
    key = iam.create_access_key(UserName="no-permissions")["AccessKey"]
    s3 = boto3.session.Session().client("s3", endpoint_url=endpoint)
    s3.create_bucket(Bucket="locked")
    s3.put_object(Bucket="locked", Key="run/step_1/done", Body=b"1")  # the 4th and last unauthenticated call

    bad = boto3.session.Session(aws_access_key_id="AKIANOTAKEY", aws_secret_access_key="wrong")
    s = S3Storage("s3://locked/run", endpoint_url=endpoint, session=bad)
    with pytest.raises(
        StorageError, match=r"rejected the AWS credentials \(InvalidAccessKeyId\) on upload s3://locked"
    ):
        s.write_bytes("step_2/checkpoint", b"1")
    with pytest.raises(StorageError, match="rejected the AWS credentials"):
        s.list_dir()

    user = boto3.session.Session(aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"])
    s = S3Storage("s3://locked/run", endpoint_url=endpoint, session=user)
    with pytest.raises(StorageError, match=r"access denied to s3://locked/run/step_2/checkpoint \(upload\)"):
        s.write_bytes("step_2/checkpoint", b"1")
    with pytest.raises(StorageError, match=r"access denied to s3://locked/run/step_1/done \(read\)"):
        s.read_bytes("step_1/done")
    with pytest.raises(StorageError, match=r"access denied to s3://locked/run/step_1/done \(head, HTTP 403\)"):
        s.exists("step_1/done")


def test_throttled_requests_are_retried(s3_url, s3_server, caplog):
    with ThrottlingProxy(s3_server.port, throttle_first=6) as proxy:
        s = S3Storage(s3_url, endpoint_url=proxy.endpoint_url, max_attempts=3)
        s.write_bytes("a", b"payload")  # 3 botocore attempts, then 3 more after our backoff
        assert s.read_bytes("a") == b"payload"
        assert proxy.throttled == 6 and proxy.requests == 8
    assert any("SlowDown" in r.getMessage() and "retry 1/4" in r.getMessage() for r in caplog.records)


def test_sustained_throttling_gives_up_with_a_clear_error(s3_url, s3_server):
    with ThrottlingProxy(s3_server.port, throttle_first=10**6) as proxy:
        s = S3Storage(s3_url, endpoint_url=proxy.endpoint_url, max_attempts=2, retries=2)
        with pytest.raises(StorageError, match=r"kept failing upload .* with SlowDown \(after 2 extra retries\)"):
            s.write_bytes("a", b"payload")
        assert proxy.requests == 6  # bounded: (1 + retries) * max_attempts


def test_no_credentials_is_named(s3_url, monkeypatch):
    import boto3

    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s = S3Storage(s3_url, session=boto3.session.Session())  # instance metadata is disabled by the fixture
    with pytest.raises(StorageError, match=r"no usable AWS credentials for upload s3://nxd-ckpt-test/.*/a"):
        s.write_bytes("a", b"1")


def test_connection_cut_mid_body_is_retried(s3_url, s3_server, caplog):
    data = os.urandom(300_000)
    S3Storage(s3_url).write_bytes("f.bin", data)
    with ThrottlingProxy(s3_server.port, throttle_first=0, cut_first_gets=2) as proxy:
        s = S3Storage(s3_url, endpoint_url=proxy.endpoint_url)
        assert s.read_bytes("f.bin") == data  # botocore does not retry a body read; our loop does
        with s.open_read("f.bin") as f:
            assert f.read() == data
        assert proxy.cut == 2
    assert sum("ResponseStreamingError" in r.getMessage() for r in caplog.records) == 2


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on 127.0.0.1:``port`` (from /proc/net/tcp)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {r[9] for r in rows if r[1] == f"0100007F:{port:04X}" and r[3] == "0A"}


def test_the_server_process_binds_its_own_port_and_reports_it(s3_server):
    """MotoServer's port is one its own process bound (port 0) and listens on, not one chosen by the parent."""
    from harness.s3server import MotoServer

    with MotoServer() as other:
        assert other.port not in (0, s3_server.port)
        for server in (s3_server, other):
            fds = os.listdir(f"/proc/{server.proc.pid}/fd")
            owned = {os.readlink(f"/proc/{server.proc.pid}/fd/{fd}") for fd in fds}
            assert {f"socket:[{inode}]" for inode in _listening_inodes(server.port)} <= owned
            assert _listening_inodes(server.port)


def test_writes_upload_from_memory_part_by_part_without_temporary_files(s3_url, s3_server, monkeypatch):
    import tempfile

    def no_temporary_file(*args, **kwargs):
        raise AssertionError("open_write made a temporary file")

    monkeypatch.setattr(tempfile, "SpooledTemporaryFile", no_temporary_file)
    monkeypatch.setattr(tempfile, "TemporaryFile", no_temporary_file)
    monkeypatch.setenv("NXD_CKPT_S3_PART_SIZE", str(5 * MIB))
    monkeypatch.setenv("NXD_CKPT_S3_MAX_CONCURRENCY", "2")
    data = os.urandom(16 * MIB + 7)
    with ThrottlingProxy(s3_server.port, throttle_first=0) as proxy:
        s = S3Storage(s3_url, endpoint_url=proxy.endpoint_url)
        assert (s.part_size, s.max_concurrency) == (5 * MIB, 2)  # the knobs
        with s.open_write("big.bin") as f:
            for start in range(0, len(data), MIB):
                f.write(data[start : start + MIB])
            assert proxy.by_method.get("PUT", 0) >= 1  # parts went out while the file was still being written
        assert proxy.by_method == {"POST": 2, "PUT": 4}  # create, 4 parts (5+5+5+1 MiB), complete
    assert s.read_bytes("big.bin") == data


def test_the_crt_transfer_manager_only_where_it_can_be_used(s3_url, monkeypatch):
    s = S3Storage(s3_url)
    assert s.transfer_client() == "classic"  # auto: a loopback endpoint is not AWS's, whatever is installed
    monkeypatch.setenv("NXD_CKPT_S3_TRANSFER_CLIENT", "crt")
    with pytest.raises(StorageError, match="awscrt|custom endpoint"):
        s.transfer_client()
    monkeypatch.setenv("NXD_CKPT_S3_TRANSFER_CLIENT", "fast")
    with pytest.raises(ValueError, match="NXD_CKPT_S3_TRANSFER_CLIENT='fast'.*auto, crt, classic"):
        s.transfer_client()
