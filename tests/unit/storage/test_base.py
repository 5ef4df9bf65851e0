"""The storage interface's shared pieces: CountingStream, the one stream wrapper the stall watchdog and the
command's progress bars count bytes with."""

from __future__ import annotations

import io

from nxd_ckpt.storage.base import CountingStream


def test_a_large_write_is_passed_on_and_reported_in_pieces():
    """A write larger than ``chunk_bytes`` reaches the target in pieces, each reported as it lands (so a slow
    multi-GB record is not mistaken for a stall), and the call returns the whole length."""
    target, seen = io.BytesIO(), []
    stream = CountingStream(target, seen.append, chunk_bytes=4)
    assert stream.write(b"0123456789") == 10
    assert seen == [4, 4, 2] and target.getvalue() == b"0123456789"
    assert stream.write(b"") == 0 and seen[-1] == 0


def test_a_short_write_is_reported_as_the_target_made_it():
    class Short(io.BytesIO):
        def write(self, data):  # type: ignore[override]
            return super().write(bytes(data)[:3])

    seen: list[int] = []
    assert CountingStream(Short(), seen.append, chunk_bytes=4).write(b"0123456789") == 3
    assert seen == [3]


def test_reads_are_reported_and_everything_else_reaches_the_target():
    target, seen = io.BytesIO(b"abcdefgh"), []
    stream = CountingStream(target, seen.append)
    assert stream.read(3) == b"abc"
    buffer = bytearray(4)
    assert stream.readinto(buffer) == 4 and bytes(buffer) == b"defg"
    assert stream.tell() == 7 and stream.read() == b"h"
    assert seen == [3, 4, 1]
