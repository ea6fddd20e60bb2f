"""The SDK's HTTP transport: one ``http.client`` connection per call, JSON in and out, bodies
streamed both ways, the error envelope turned into exceptions, and the retry of 429/503 answers.
Standard library only."""

from __future__ import annotations

import http.client
import io
import json
import os
import random
import ssl
import time
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Dict, Iterable, Iterator, Mapping, Optional, Union
from urllib.parse import quote, urlencode, urlsplit

from .errors import SandboxdError, TransportError, error_for

#: What a raw request body may be: bytes, text (sent as UTF-8), a binary file object (read in
#: blocks, never whole) or an iterable of byte chunks.
Body = Union[bytes, bytearray, memoryview, str, BinaryIO, Iterable[bytes]]

#: Bytes http.client reads from a file body per send, and we read per chunk of a download: large
#: enough that a few-GB transfer is not dominated by per-call overhead, small enough to stay in cache.
BLOCK_BYTES = 256 * 1024

#: Statuses worth retrying: the rate limit (429) and a service that cannot serve now (503). Every
#: other failure repeats when repeated.
RETRYABLE_STATUSES = frozenset({429, 503})


@dataclass(frozen=True)
class RetryPolicy:
    """How 429 and 503 answers are retried.

    A retry waits the answer's ``Retry-After`` when it has one, else an exponential backoff with
    full jitter (``initial_delay * 2**attempt``, at most ``max_delay``). Calls that are not
    idempotent (create, exec, fork, suspend, resume, a one-shot exec) are retried only when
    ``non_idempotent`` is true or the call passes ``retry=True``: their 503 may come after the
    service acted. ``max_retries=0`` turns retries off.
    """

    #: Retries after the first attempt; three ride out a one-second rate-limit window twice over.
    max_retries: int = 3
    #: First backoff without a Retry-After, seconds.
    initial_delay: float = 0.5
    #: Cap of one backoff without a Retry-After, seconds.
    max_delay: float = 8.0
    #: A Retry-After longer than this (seconds) is not waited for: the error is raised at once so the
    #: caller decides (a quota that frees in an hour is not worth a blocked thread).
    max_retry_after: float = 60.0
    #: Retry non-idempotent calls too.
    non_idempotent: bool = False

    def delay(self, attempt: int, retry_after: Optional[float]) -> Optional[float]:
        """Seconds to wait before retry number ``attempt`` (0-based); None: do not retry."""
        if attempt >= self.max_retries:
            return None
        if retry_after is not None:
            return retry_after if retry_after <= self.max_retry_after else None
        return random.uniform(0, min(self.max_delay, self.initial_delay * (2**attempt)))


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """``Retry-After`` in seconds (the service sends delta-seconds; an HTTP date is honoured too)."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    from email.utils import parsedate_to_datetime

    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _content_length(body: Any) -> Optional[int]:
    """The length of a body that knows it (bytes, a regular file from its position); else None."""
    if isinstance(body, (bytes, bytearray)):
        return len(body)
    if isinstance(body, memoryview):
        return body.nbytes
    if hasattr(body, "fileno") and hasattr(body, "tell"):
        try:
            st = os.fstat(body.fileno())
            import stat

            if stat.S_ISREG(st.st_mode):
                return max(0, st.st_size - int(body.tell()))
        except (OSError, io.UnsupportedOperation):
            return None
    return None


class Response:
    """An answer whose body has not been read yet: ``json()``, ``read()`` or ``iter_bytes()``."""

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse) -> None:
        self._conn = conn
        self.raw = resp
        self.status = resp.status
        self.headers = resp.headers

    def read(self) -> bytes:
        try:
            return self.raw.read()
        except (OSError, http.client.HTTPException) as e:
            raise TransportError("connection_error", None, f"reading the answer failed: {e}") from e
        finally:
            self.close()

    def json(self) -> Any:
        data = self.read()
        return json.loads(data) if data else None

    def read1(self, n: int = BLOCK_BYTES) -> bytes:
        """Up to ``n`` bytes as soon as some arrived (b"" at the end); the incremental read."""
        try:
            return self.raw.read1(n)
        except (OSError, http.client.HTTPException) as e:
            # A chunked body cut short (the service failed mid-download) lands here as IncompleteRead.
            raise TransportError("connection_error", None, f"the answer broke off: {e}") from e

    def iter_bytes(self, chunk: int = BLOCK_BYTES) -> Iterator[bytes]:
        try:
            while True:
                b = self.read1(chunk)
                if not b:
                    return
                yield b
        finally:
            self.close()

    def close(self) -> None:
        self.raw.close()
        self._conn.close()

    def __enter__(self) -> "Response":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Http:
    """Requests against one service with one key."""

    def __init__(
        self,
        base_url: str,
        api_key: Optional[str],
        *,
        timeout: Optional[float],
        retry: RetryPolicy,
        ssl_context: Optional[ssl.SSLContext] = None,
        user_agent: str = "sandboxd-python",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.scheme = u.scheme
        self.host = u.hostname
        self.port = u.port
        self.prefix = u.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.retry = retry
        self.ssl_context = ssl_context
        self.user_agent = user_agent
        self._sleep = sleep

    # ---- building blocks -------------------------------------------------------------------

    def url_path(self, path: str, query: Optional[Mapping[str, Any]] = None) -> str:
        # A list or tuple is the parameter repeated, once per value (``label=a:1&label=b:2``).
        q = [
            (k, _query_value(one))
            for k, v in (query or {}).items()
            if v is not None
            for one in (v if isinstance(v, (list, tuple)) else [v])
        ]
        return self.prefix + path + (("?" + urlencode(q, quote_via=quote)) if q else "")

    def auth_headers(self) -> Dict[str, str]:
        h = {"User-Agent": self.user_agent}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def _connect(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            ctx = self.ssl_context or ssl.create_default_context()
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=ctx, blocksize=BLOCK_BYTES
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout, blocksize=BLOCK_BYTES)

    def _send(
        self, method: str, target: str, headers: Dict[str, str], body: Any
    ) -> Response:
        conn = self._connect()
        try:
            if isinstance(body, str):
                body = body.encode("utf-8")
            length = _content_length(body) if body is not None else None
            chunked = False
            if body is not None and length is not None:
                headers["Content-Length"] = str(length)
            elif body is not None:
                chunked = True
                if not hasattr(body, "read"):
                    body = iter(body)
            conn.request(method, target, body=body, headers=headers, encode_chunked=chunked)
            return Response(conn, conn.getresponse())
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise TransportError("connection_error", None, f"{method} {target}: {e}") from e

    # ---- the call --------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Optional[Mapping[str, Any]] = None,
        json_body: Any = None,
        body: Optional[Body] = None,
        content_type: Optional[str] = None,
        accept: Optional[str] = None,
        idempotent: Optional[bool] = None,
        retry: Optional[bool] = None,
    ) -> Response:
        """Sends the call and returns the answer once its status is a success (2xx), its body
        unread; an error answer is raised as a SandboxdError. 429/503 are retried per the policy:
        ``retry`` (True/False) overrides the policy's choice for this call; ``idempotent``
        defaults to the method's HTTP meaning. A body that is a stream is never resent."""
        target = self.url_path(path, query)
        headers = self.auth_headers()
        if accept:
            headers["Accept"] = accept
        payload: Any = body
        if json_body is not None:
            payload = json.dumps(json_body, separators=(",", ":")).encode("utf-8")
            headers["Content-Type"] = "application/json"
        elif body is not None:
            headers["Content-Type"] = content_type or "application/octet-stream"
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "PUT", "DELETE")
        may_retry = retry if retry is not None else (idempotent or self.retry.non_idempotent)
        # A file or iterator body is consumed by the first attempt: it cannot be sent again.
        if payload is not None and not isinstance(payload, (bytes, bytearray, memoryview, str)):
            may_retry = False
        attempt = 0
        while True:
            res = self._send(method, target, dict(headers), payload)
            if 200 <= res.status < 300:
                return res
            err = _error_of(res)
            wait = self.retry.delay(attempt, err.retry_after) if may_retry else None
            if res.status not in RETRYABLE_STATUSES or wait is None:
                raise err
            self._sleep(wait)
            attempt += 1

    def json(self, method: str, path: str, **kw: Any) -> Dict[str, Any]:
        """A call whose answer is a JSON object (every JSON answer of the API is one)."""
        d = self.request(method, path, **kw).json()
        return d if isinstance(d, dict) else {}


def _query_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _error_of(res: Response) -> SandboxdError:
    """The answer's error envelope as an exception (a body that is not one still says its status)."""
    retry_after = parse_retry_after(res.headers.get("Retry-After"))
    try:
        text = res.read()
    except SandboxdError:
        text = b""
    code, message = "http_error", f"HTTP {res.status}"
    details = None
    try:
        env = json.loads(text)
        if isinstance(env, dict) and isinstance(env.get("code"), str):
            code = env["code"]
            message = str(env.get("message", ""))
            if isinstance(env.get("details"), dict):
                details = env["details"]
    except ValueError:
        if text:
            message = text[:500].decode("utf-8", "replace")
    return error_for(code, res.status, message, retry_after, details)
