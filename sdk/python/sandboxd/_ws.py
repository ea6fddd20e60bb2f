"""A small RFC 6455 WebSocket client on the standard library, for terminals: the opening
handshake (an error answer instead of 101 is raised as the service's SandboxdError), masked
frames out, fragmented messages in, ping/pong and the closing handshake. No extensions (the
service's relays need none), no subprotocols.

Why not a package: Debian 12's python3-websockets (10.4) has no synchronous client, and a terminal
needs only this much of the protocol."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import ssl
import struct
import threading
from typing import IO, Dict, Optional, Tuple
from urllib.parse import urlsplit

from .errors import TransportError, error_for

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
#: Largest message accepted from the server: the service's relays send chunks far below this;
#: anything larger is a broken peer, not output to buffer.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: Longest handshake answer head read, bytes: a status line and a few headers.
MAX_HEAD_BYTES = 64 * 1024


class WebSocket:
    """One client connection. ``recv`` is for one reader thread; ``send`` may be called from any."""

    def __init__(self, sock: socket.socket, reader: IO[bytes]) -> None:
        self._sock = sock
        self._rf = reader
        self._wlock = threading.Lock()
        self.close_code: Optional[int] = None
        self.close_reason = ""
        self._closing = False

    @classmethod
    def connect(
        cls,
        url: str,
        headers: Dict[str, str],
        timeout: Optional[float],
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> "WebSocket":
        u = urlsplit(url)
        secure = u.scheme in ("wss", "https")
        host = u.hostname or ""
        port = u.port or (443 if secure else 80)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            if secure:
                sock = (ssl_context or ssl.create_default_context()).wrap_socket(sock, server_hostname=host)
        except OSError as e:
            raise TransportError("connection_error", None, f"connecting to {host}:{port}: {e}") from e
        key = base64.b64encode(os.urandom(16)).decode()
        host_header = host if u.port is None else f"{host}:{u.port}"
        lines = [
            f"GET {target} HTTP/1.1",
            f"Host: {host_header}",
            "Upgrade: websocket",
            "Connection: Upgrade",
            f"Sec-WebSocket-Key: {key}",
            "Sec-WebSocket-Version: 13",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            rf = sock.makefile("rb")
            status, head = _read_head(rf)
        except OSError as e:
            sock.close()
            raise TransportError("connection_error", None, f"WebSocket handshake: {e}") from e
        if status != 101:
            body = b""
            try:
                n = int(head.get("content-length", "0"))
                body = rf.read(min(n, MAX_HEAD_BYTES)) if n > 0 else b""
            except (OSError, ValueError):
                pass
            sock.close()
            code, message = "http_error", f"HTTP {status}"
            try:
                env = json.loads(body)
                code, message = str(env["code"]), str(env.get("message", ""))
            except (ValueError, KeyError, TypeError):
                pass
            raise error_for(code, status, message)
        want = base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest()).decode()
        if head.get("sec-websocket-accept") != want:
            sock.close()
            raise TransportError("connection_error", None, "WebSocket handshake: bad Sec-WebSocket-Accept")
        # After the handshake the reader thread blocks in recv for as long as the terminal is open.
        sock.settimeout(None)
        return cls(sock, rf)

    # ---- sending ---------------------------------------------------------------------------

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            head = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        mask = os.urandom(4)
        masked = _mask(payload, mask)
        with self._wlock:
            try:
                self._sock.sendall(head + mask + masked)
            except OSError as e:
                raise TransportError("connection_error", None, f"WebSocket send: {e}") from e

    def send_binary(self, data: bytes) -> None:
        self._send_frame(OP_BINARY, data)

    def send_text(self, text: str) -> None:
        self._send_frame(OP_TEXT, text.encode("utf-8"))

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Starts the closing handshake (the reader sees the server's close and ends)."""
        if self._closing:
            return
        self._closing = True
        try:
            self._send_frame(OP_CLOSE, struct.pack("!H", code) + reason.encode("utf-8")[:120])
        except TransportError:
            self.abort()

    def abort(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    # ---- receiving -------------------------------------------------------------------------

    def recv(self) -> Optional[Tuple[int, bytes]]:
        """The next message as (opcode, payload), or None once the connection closed."""
        buf = bytearray()
        first_op = None
        try:
            while True:
                fin, op, payload = self._read_frame()
                if op == OP_PING:
                    self._send_frame(OP_PONG, payload)
                    continue
                if op == OP_PONG:
                    continue
                if op == OP_CLOSE:
                    self.close_code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                    self.close_reason = payload[2:].decode("utf-8", "replace")
                    if not self._closing:
                        self.close(self.close_code if self.close_code != 1005 else 1000)
                    self.abort()
                    return None
                if op != OP_CONT:
                    first_op = op
                buf += payload
                if len(buf) > MAX_MESSAGE_BYTES:
                    self.close(1009)
                    self.abort()
                    return None
                if fin:
                    return (first_op or OP_BINARY, bytes(buf))
        except (OSError, EOFError, ValueError):
            if self.close_code is None:
                self.close_code = 1006  # no close frame: the connection was lost
            self.abort()
            return None

    def _read_exact(self, n: int) -> bytes:
        b = self._rf.read(n)
        if b is None or len(b) < n:
            raise EOFError("connection closed")
        return b

    def _read_frame(self) -> Tuple[bool, int, bytes]:
        b0, b1 = self._read_exact(2)
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", self._read_exact(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", self._read_exact(8))
        if n > MAX_MESSAGE_BYTES:
            raise ValueError("frame too large")
        mask = self._read_exact(4) if b1 & 0x80 else None
        payload = self._read_exact(n) if n else b""
        if mask:
            payload = _mask(payload, mask)
        return bool(b0 & 0x80), b0 & 0x0F, payload


def _mask(payload: bytes, mask: bytes) -> bytes:
    """XOR with the 4-byte mask, as one big-integer operation (fast for large payloads)."""
    if not payload:
        return b""
    n = len(payload)
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


def _read_head(rf: IO[bytes]) -> Tuple[int, Dict[str, str]]:
    line = rf.readline(MAX_HEAD_BYTES)
    parts = line.decode("latin-1").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise OSError(f"not an HTTP answer: {line[:80]!r}")
    status = int(parts[1])
    head: Dict[str, str] = {}
    total = len(line)
    while True:
        h = rf.readline(MAX_HEAD_BYTES)
        total += len(h)
        if total > MAX_HEAD_BYTES:
            raise OSError("answer head too long")
        if h in (b"\r\n", b"\n", b""):
            return status, head
        k, _, v = h.decode("latin-1").partition(":")
        head[k.strip().lower()] = v.strip()
