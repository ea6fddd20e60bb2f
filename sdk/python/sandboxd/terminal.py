"""An interactive terminal (``GET .../pty``): a shell in the sandbox behind a WebSocket."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from typing import Iterator, Optional, Pattern, Union

from ._ws import OP_BINARY, WebSocket
from .errors import SandboxdError


class Terminal:
    """A duplex terminal: ``write()`` types, ``recv()``/iteration reads the shell's output,
    ``resize()`` changes its size, ``close()`` hangs it up (the shell and its jobs are killed).

    A background thread reads the WebSocket, so output is taken off the connection as it comes;
    a program that never reads keeps it in memory until ``close()``. Usable as a context manager.
    """

    def __init__(self, ws: WebSocket) -> None:
        self._ws = ws
        self._q: "queue.Queue[Optional[bytes]]" = queue.Queue()
        self._ended = False
        self._pending = b""
        self._reader = threading.Thread(target=self._read, name="sandboxd-terminal", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            msg = self._ws.recv()
            if msg is None:
                self._q.put(None)
                return
            op, data = msg
            # The guest's output always comes as binary messages; a text one is passed on as its bytes.
            self._q.put(data if op == OP_BINARY else bytes(data))

    @property
    def close_code(self) -> Optional[int]:
        """The WebSocket's close code once it ended (1000: the shell exited), else None."""
        return self._ws.close_code if self._ended else None

    def write(self, data: Union[bytes, str]) -> None:
        """Types ``data`` (text as UTF-8): include ``\\r`` to press Enter."""
        self._ws.send_binary(data.encode("utf-8") if isinstance(data, str) else bytes(data))

    def resize(self, cols: int, rows: int) -> None:
        self._ws.send_text(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    def recv(self, timeout: Optional[float] = None) -> Optional[bytes]:
        """The next output, waiting up to ``timeout`` seconds; b"" once the terminal ended, None
        when nothing came in time."""
        if self._pending:
            out, self._pending = self._pending, b""
            return out
        if self._ended:
            return b""
        try:
            item = self._q.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._ended = True
            return b""
        return item

    def read_until(self, pattern: Union[bytes, str, Pattern[bytes]], timeout: float = 30.0) -> bytes:
        """Reads until the output so far matches ``pattern`` (bytes, text or a compiled bytes
        regex); returns the output up to the end of the match (the rest stays for the next read).
        Raises ``SandboxdError`` (code ``timeout``) when it does not come in ``timeout`` seconds,
        or ``closed`` when the terminal ends first."""
        if isinstance(pattern, str):
            pattern = pattern.encode("utf-8")
        rx = re.compile(re.escape(pattern)) if isinstance(pattern, bytes) else pattern
        deadline = time.monotonic() + timeout
        got = b""
        while True:
            m = rx.search(got)
            if m:
                self._pending = got[m.end() :] + self._pending
                return got[: m.end()]
            left = deadline - time.monotonic()
            if left <= 0:
                self._pending = got
                raise SandboxdError("timeout", None, f"no {rx.pattern!r} in the terminal output: {got[-300:]!r}")
            chunk = self.recv(timeout=left)
            if chunk == b"":
                raise SandboxdError("closed", None, f"the terminal ended before {rx.pattern!r}: {got[-300:]!r}")
            if chunk:
                got += chunk

    def __iter__(self) -> Iterator[bytes]:
        while True:
            chunk = self.recv()
            if not chunk:
                return
            yield chunk

    def close(self) -> None:
        self._ws.close()
        self._reader.join(timeout=5)  # the server answers a close at once; a lost peer: give up
        self._ws.abort()
        self._ended = True

    def __enter__(self) -> "Terminal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
