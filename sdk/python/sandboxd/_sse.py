"""An incremental Server-Sent Events parser (the WHATWG ``text/event-stream`` format): bytes go
in as they arrive from the socket, whole events come out. The service's streams (a streamed exec,
followed process logs) send ``event:`` + one ``data:`` line per event and open with a comment."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional


@dataclass(frozen=True)
class SseEvent:
    event: str
    data: str
    id: Optional[str] = None


class SseParser:
    """Feed it chunks; it yields each event once its blank line arrived."""

    def __init__(self) -> None:
        self._buf = b""
        self._event = ""
        self._data: List[str] = []
        self._id: Optional[str] = None
        self._first = True

    def feed(self, chunk: bytes) -> Iterator[SseEvent]:
        buf = self._buf + chunk
        pos = 0
        try:
            while True:
                # Lines end with LF, CRLF or CR; the service writes LF. A CR at the very end may be
                # the first half of a CRLF, so it waits for the next chunk.
                lf = buf.find(b"\n", pos)
                cr = buf.find(b"\r", pos, lf if lf >= 0 else len(buf))
                if cr >= 0 and cr + 1 < len(buf):
                    cut, step = cr, 2 if buf[cr + 1] == 0x0A else 1
                elif lf >= 0 and cr < 0:
                    cut, step = lf, 1
                else:
                    return
                line = buf[pos:cut]
                pos = cut + step
                ev = self._line(line.decode("utf-8", "replace"))
                if ev is not None:
                    yield ev
        finally:
            self._buf = buf[pos:]

    def _line(self, line: str) -> Optional[SseEvent]:
        if self._first:
            self._first = False
            line = line.lstrip("\ufeff")
        if line == "":
            if not self._data:
                self._event = ""
                return None
            ev = SseEvent(self._event or "message", "\n".join(self._data), self._id)
            self._event, self._data = "", []
            return ev
        if line.startswith(":"):
            return None  # a comment (the service's `: open`)
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id":
            self._id = value
        return None


def parse_events(chunks: Iterable[bytes]) -> Iterator[SseEvent]:
    """Events of a whole stream of chunks, as each completes."""
    p = SseParser()
    for c in chunks:
        yield from p.feed(c)
