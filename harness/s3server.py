"""A loopback S3-protocol server for tests and benchmarks: moto's standalone server in a subprocess, plus a
tiny HTTP proxy that answers ``503 SlowDown`` to the first requests (to test throttling retries).

Everything listens on 127.0.0.1 only. No torch import: the benchmark and the S3 tests share this module.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOST = "127.0.0.1"

# Standard AWS variables that make boto3 talk to a loopback server with dummy credentials, and never to the
# instance-metadata service or a developer's real AWS configuration.
TEST_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
TEST_AWS_UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL")


def loopback_aws_environ(endpoint_url: str) -> dict[str, str | None]:
    """Environment changes (None = unset) pointing the standard AWS chain at a loopback endpoint."""
    env: dict[str, str | None] = {**TEST_AWS_ENV, "AWS_ENDPOINT_URL_S3": endpoint_url}
    env.update(dict.fromkeys(TEST_AWS_UNSET))
    return env


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections while the context lasts: bound here (so nobody else can
    take it) but never listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        yield int(s.getsockname()[1])


_SERVE = """
import sys
from moto.moto_server.threaded_moto_server import ThreadedMotoServer
server = ThreadedMotoServer(sys.argv[1], 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""
"""The server process: moto's S3 app on a port the kernel chose when it bound port 0, reported on its first line
of output; it serves until its standard input closes (or it is ended)."""


class MotoServer:
    """moto's S3 server in a subprocess on 127.0.0.1; it binds port 0 itself and reports the port it got (never
    a port chosen here and bound there later). ``stop()`` ends the process it started."""

    def __init__(self, extra_env: dict[str, str] | None = None, startup_timeout: float = 60.0) -> None:
        self.extra_env = dict(extra_env or {})
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> MotoServer:
        """Start the server, read its port and wait until it answers HTTP; raise RuntimeError (with its output)
        if it cannot."""
        env = {k: v for k, v in os.environ.items() if k not in TEST_AWS_UNSET}
        env.update({**TEST_AWS_ENV, **self.extra_env})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, HOST],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        first: list[bytes] = []
        reader = threading.Thread(target=lambda: first.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(self.startup_timeout)
        line = first[0].strip() if first else b""
        if line.isdigit():
            self.port = int(line)
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                if self._answers():
                    self._drain_output()
                    return self
                time.sleep(0.1)
        output = line.decode(errors="replace") + "\n" + self._stop_and_collect()
        raise RuntimeError(f"moto server did not start on {HOST}: {output.strip()[-2000:] or 'no output'}")

    def _answers(self) -> bool:
        try:
            conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
            conn.request("GET", "/moto-api/")
            conn.getresponse().read()
            conn.close()
            return True
        except OSError:
            return False

    def _drain_output(self) -> None:
        """Keep reading the server's request log so its pipe never fills up and blocks it."""
        proc = self.proc

        def drain() -> None:
            assert proc is not None and proc.stdout is not None
            for _ in iter(proc.stdout.readline, b""):
                pass

        threading.Thread(target=drain, name="moto-output", daemon=True).start()

    def _stop_and_collect(self) -> str:
        if self.proc is None:
            return ""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        self.proc = None
        return (out or b"").decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]  # the server's signal to stop
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


_SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>nxd-ckpt-proxy</RequestId></Error>"
)
_DENIED_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message><RequestId>nxd-ckpt-proxy</RequestId></Error>"
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade", "trailer"}


class ThrottlingProxy:
    """HTTP proxy on 127.0.0.1 in front of ``upstream``: the first ``throttle_first`` requests get
    ``503 SlowDown`` (as S3 answers when a prefix is hot), and after them each request does with probability
    ``slowdown_rate`` (a storm; ``seed`` makes it repeatable); the rest are forwarded, except that the bodies of
    the first ``cut_first_gets`` GET responses are cut in half by closing the connection (a reset mid-stream),
    and uploads (PUT/POST) to keys containing ``deny_writes_to`` get ``403 AccessDenied`` (a bucket policy or
    a lost permission that fails one part of a save). ``by_method`` counts the requests forwarded, by HTTP
    method (GET with ``?list-type`` counts as LIST)."""

    def __init__(
        self,
        upstream_port: int,
        throttle_first: int,
        cut_first_gets: int = 0,
        deny_writes_to: str = "",
        slowdown_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.upstream_port = upstream_port
        self.throttle_first = throttle_first
        self.cut_first_gets = cut_first_gets
        self.deny_writes_to = deny_writes_to
        self.slowdown_rate = slowdown_rate
        self._random = random.Random(seed)
        self.denied = 0
        self.requests = 0
        self.throttled = 0
        self.cut = 0
        self.by_method: dict[str, int] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _error(self, status: int, reason: str, body: bytes) -> None:
                self.send_response(status, reason)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                write = self.command in ("PUT", "POST")
                deny = write and bool(proxy.deny_writes_to) and proxy.deny_writes_to in self.path
                with proxy._lock:
                    proxy.requests += 1
                    proxy.denied += deny
                    storm = proxy.slowdown_rate > 0 and proxy._random.random() < proxy.slowdown_rate
                    throttle = not deny and (proxy.throttled < proxy.throttle_first or storm)
                    proxy.throttled += throttle
                    if not (deny or throttle):
                        kind = "LIST" if self.command == "GET" and "list-type=" in self.path else self.command
                        proxy.by_method[kind] = proxy.by_method.get(kind, 0) + 1
                if deny:
                    self._error(403, "Forbidden", _DENIED_BODY)
                    return
                if throttle:
                    self._error(503, "Slow Down", _SLOWDOWN_BODY)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers.pop("Expect", None)
                if body or "Content-Length" in self.headers or "Transfer-Encoding" in self.headers:
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(HOST, proxy.upstream_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    for k, v in response.getheaders():
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    if self.command == "HEAD":
                        self.send_header("Content-Length", response.getheader("Content-Length") or "0")
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    with proxy._lock:
                        cut = self.command == "GET" and len(data) > 1 and proxy.cut < proxy.cut_first_gets
                        proxy.cut += cut
                    if cut:
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                    elif self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="throttling-proxy", daemon=True)

    @property
    def endpoint_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> ThrottlingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ThrottlingProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
