"""The incremental SSE parser: the same events whatever the chunking, comments skipped, CRLF and
multi-line data as the format defines them."""

from __future__ import annotations

import unittest
from typing import List

from sandboxd._sse import SseEvent, SseParser

STREAM = (
    b": open\n\n"
    b'event: stdout\ndata: {"data":"line 1\\n"}\n\n'
    b'event: stderr\r\ndata: {"data_b64":"//4="}\r\n\r\n'
    b"event: note\ndata: a\ndata: b\n\n"
    b'event: exit\ndata: {"exit_code":0}\n\n'
)
WANT = [
    SseEvent("stdout", '{"data":"line 1\\n"}'),
    SseEvent("stderr", '{"data_b64":"//4="}'),
    SseEvent("note", "a\nb"),
    SseEvent("exit", '{"exit_code":0}'),
]


class SseTest(unittest.TestCase):
    def parse(self, chunks: List[bytes]) -> List[SseEvent]:
        p = SseParser()
        return [ev for c in chunks for ev in p.feed(c)]

    def test_whole(self) -> None:
        self.assertEqual(self.parse([STREAM]), WANT)

    def test_byte_by_byte(self) -> None:
        self.assertEqual(self.parse([STREAM[i : i + 1] for i in range(len(STREAM))]), WANT)

    def test_every_split_point(self) -> None:
        for i in range(len(STREAM) + 1):
            self.assertEqual(self.parse([STREAM[:i], STREAM[i:]]), WANT, f"split at {i}")

    def test_an_event_waits_for_its_blank_line(self) -> None:
        p = SseParser()
        self.assertEqual(list(p.feed(b"event: stdout\ndata: x\n")), [])
        self.assertEqual(list(p.feed(b"\n")), [SseEvent("stdout", "x")])


if __name__ == "__main__":
    unittest.main()
