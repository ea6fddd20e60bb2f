"""The retry rules, the error envelope and the stream's failure paths, against a tiny local
``http.server`` that answers what each test scripts (no sandboxd needed): 429/503 retried after
``Retry-After``, non-idempotent calls not retried unless asked, the policy's bounds, error answers
turned into exceptions, and a streamed exec's ``error`` event or cut-off end raised."""

from __future__ import annotations

import http.server
import io
import json
import threading
import time
import unittest
from typing import Dict, List, Optional, Tuple

from sandboxd import (
    ConflictError,
    ExecEvent,
    NotFoundError,
    RateLimitedError,
    RetryPolicy,
    Sandboxd,
    SandboxdError,
    ServiceUnavailableError,
    StreamError,
)
from sandboxd.sandbox import Sandbox

#: One scripted answer: (status, headers, body).
Answer = Tuple[int, Dict[str, str], bytes]


def envelope(code: str, message: str = "scripted") -> bytes:
    return json.dumps({"code": code, "message": message}).encode()


OK_LIST: Answer = (200, {"Content-Type": "application/json"}, b'{"sandboxes": []}')
OK_CREATE: Answer = (
    201,
    {"Content-Type": "application/json"},
    json.dumps({"id": "sbx_abc", "template": "t", "state": "running", "endpoints": {}}).encode(),
)
LIMITED_1S: Answer = (429, {"Content-Type": "application/json", "Retry-After": "1"}, envelope("rate_limited"))
UNAVAILABLE: Answer = (503, {"Content-Type": "application/json"}, envelope("at_capacity"))


class Scripted(http.server.ThreadingHTTPServer):
    """Answers requests with ``script`` in order (the last one repeats); records each request."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.script: List[Answer] = []
        self.seen: List[Tuple[str, str, float, bytes]] = []
        self.lock = threading.Lock()

    def next_answer(self) -> Answer:
        with self.lock:
            return self.script.pop(0) if len(self.script) > 1 else self.script[0]


class Handler(http.server.BaseHTTPRequestHandler):
    server: Scripted

    def _answer(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = _read_chunked(self.rfile)
        self.server.seen.append((self.command, self.path, time.monotonic(), body))
        status, headers, payload = self.server.next_answer()
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


def _read_chunked(rf: io.BufferedIOBase) -> bytes:
    out = b""
    while True:
        size = int(rf.readline().split(b";")[0], 16)
        if size == 0:
            rf.readline()
            return out
        out += rf.read(size)
        rf.readline()


class LocalServerTest(unittest.TestCase):
    """A scripted server for the class; ``client()`` talks to it, its sleeps recorded."""

    server: Scripted
    url: str

    @classmethod
    def setUpClass(cls) -> None:
        cls.server = Scripted()
        threading.Thread(target=cls.server.serve_forever, daemon=True).start()
        cls.url = f"http://127.0.0.1:{cls.server.server_address[1]}"

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.shutdown()
        cls.server.server_close()

    def setUp(self) -> None:
        self.server.seen.clear()
        self.waits: List[float] = []

    def client(self, policy: Optional[RetryPolicy] = None, real_sleep: bool = False) -> Sandboxd:
        sleep = time.sleep if real_sleep else self.waits.append
        return Sandboxd(self.url, "svc_pro_test_key", retry=policy, sleep=sleep)


class RetryTest(LocalServerTest):
    def test_429_is_retried_after_its_retry_after_in_real_time(self) -> None:
        self.server.script = [LIMITED_1S, LIMITED_1S, OK_LIST]
        t0 = time.monotonic()
        self.assertEqual(self.client(real_sleep=True).sandboxes.list(), [])
        self.assertEqual(len(self.server.seen), 3)
        gaps = [b[2] - a[2] for a, b in zip(self.server.seen, self.server.seen[1:])]
        # Each retry came no sooner than the one second the answer asked for.
        for g in gaps:
            self.assertGreaterEqual(g, 0.95)
        self.assertGreaterEqual(time.monotonic() - t0, 1.9)

    def test_get_sends_the_key_and_retries_503_with_backoff(self) -> None:
        self.server.script = [UNAVAILABLE, UNAVAILABLE, OK_LIST]
        c = self.client(RetryPolicy(initial_delay=0.25, max_delay=0.4))
        self.assertEqual(c.sandboxes.list(), [])
        self.assertEqual(len(self.waits), 2)
        # No Retry-After: full-jitter backoff, under initial_delay * 2**attempt and max_delay.
        self.assertLessEqual(self.waits[0], 0.25)
        self.assertLessEqual(self.waits[1], 0.4)
        self.assertEqual([s[1] for s in self.server.seen], ["/v1/sandboxes"] * 3)

    def test_non_idempotent_calls_are_not_retried_by_default(self) -> None:
        self.server.script = [LIMITED_1S, OK_CREATE]
        with self.assertRaises(RateLimitedError) as cm:
            self.client().sandboxes.create(template="t")
        e = cm.exception
        self.assertEqual((e.code, e.status, e.retry_after), ("rate_limited", 429, 1.0))
        self.assertEqual(len(self.server.seen), 1)
        self.assertEqual(self.waits, [])

    def test_non_idempotent_calls_retry_when_asked_per_call_or_by_policy(self) -> None:
        self.server.script = [LIMITED_1S, OK_CREATE]
        sbx = self.client().sandboxes.create(template="t", retry=True)
        self.assertEqual(sbx.id, "sbx_abc")
        self.assertEqual(self.waits, [1.0])
        self.assertEqual(json.loads(self.server.seen[1][3]), {"template": "t"})

        self.server.seen.clear()
        self.waits.clear()
        self.server.script = [UNAVAILABLE, OK_CREATE]
        c = self.client(RetryPolicy(non_idempotent=True, initial_delay=0.01))
        self.assertEqual(c.sandboxes.create(template="t").id, "sbx_abc")
        self.assertEqual(len(self.server.seen), 2)

    def test_retry_false_turns_it_off_for_one_call(self) -> None:
        self.server.script = [LIMITED_1S, OK_LIST]
        with self.assertRaises(RateLimitedError):
            self.client()._http.request("GET", "/v1/sandboxes", retry=False)
        self.assertEqual(len(self.server.seen), 1)

    def test_gives_up_after_max_retries(self) -> None:
        self.server.script = [UNAVAILABLE]
        with self.assertRaises(ServiceUnavailableError) as cm:
            self.client(RetryPolicy(max_retries=2, initial_delay=0.01)).sandboxes.list()
        self.assertEqual((cm.exception.code, cm.exception.status), ("at_capacity", 503))
        self.assertEqual(len(self.server.seen), 3)
        self.assertEqual(len(self.waits), 2)

    def test_max_retries_zero_is_off(self) -> None:
        self.server.script = [LIMITED_1S, OK_LIST]
        with self.assertRaises(RateLimitedError):
            self.client(RetryPolicy(max_retries=0)).sandboxes.list()
        self.assertEqual(len(self.server.seen), 1)

    def test_a_retry_after_beyond_the_policy_is_raised_at_once(self) -> None:
        hour = (429, {"Retry-After": "3600", "Content-Type": "application/json"}, envelope("quota_exceeded"))
        self.server.script = [hour, OK_LIST]
        with self.assertRaises(RateLimitedError) as cm:
            self.client().sandboxes.list()
        self.assertEqual((cm.exception.code, cm.exception.retry_after), ("quota_exceeded", 3600.0))
        self.assertEqual(self.waits, [])

    def test_other_errors_are_not_retried(self) -> None:
        self.server.script = [(404, {"Content-Type": "application/json"}, envelope("not_found", "no such sandbox"))]
        with self.assertRaises(NotFoundError) as cm:
            self.client().sandboxes.get("sbx_missing")
        self.assertEqual((cm.exception.code, cm.exception.status), ("not_found", 404))
        self.assertEqual(cm.exception.message, "no such sandbox")
        self.assertEqual(len(self.server.seen), 1)

    def test_a_streamed_body_is_never_sent_twice(self) -> None:
        self.server.script = [UNAVAILABLE, (200, {"Content-Type": "application/json"}, b'{"path":"/a","size":3}')]
        box = Sandbox(self.client()._http, "sbx_abc")
        with self.assertRaises(ServiceUnavailableError):
            box.files.write("/a", iter([b"a", b"bc"]))
        self.assertEqual(len(self.server.seen), 1)
        # The same write from bytes is retried (a PUT is idempotent), and chunks arrive whole.
        self.server.seen.clear()
        self.server.script = [UNAVAILABLE, (200, {"Content-Type": "application/json"}, b'{"path":"/a","size":3}')]
        self.assertEqual(box.files.write("/a", b"abc"), 3)
        self.assertEqual([s[3] for s in self.server.seen], [b"abc", b"abc"])

    def test_an_answer_that_is_not_an_envelope_still_raises_with_its_status(self) -> None:
        self.server.script = [(502, {"Content-Type": "text/html"}, b"<h1>bad gateway</h1>")]
        with self.assertRaises(SandboxdError) as cm:
            self.client().sandboxes.list()
        self.assertEqual((cm.exception.code, cm.exception.status), ("http_error", 502))
        self.assertIn("bad gateway", cm.exception.message)


SSE = {"Content-Type": "text/event-stream"}


class StreamFailureTest(LocalServerTest):
    """The failure paths of a streamed exec, which a healthy service rarely shows."""

    last: List[ExecEvent]

    def stream(self, body: bytes) -> List[ExecEvent]:
        self.server.script = [(200, SSE, body)]
        got: List[ExecEvent] = []
        try:
            for ev in Sandbox(self.client()._http, "sbx_abc").exec_stream("x"):
                got.append(ev)
        finally:
            self.last = got
        return got

    def test_an_error_event_is_raised_after_the_output_before_it(self) -> None:
        body = (
            b'event: stdout\ndata: {"data_b64":"AP8="}\n\n'
            b'event: error\ndata: {"code":"agent_unavailable","message":"the host went away"}\n\n'
        )
        with self.assertRaises(StreamError) as cm:
            self.stream(body)
        self.assertEqual((cm.exception.code, cm.exception.message), ("agent_unavailable", "the host went away"))
        self.assertEqual([(e.type, e.data) for e in self.last], [("stdout", b"\x00\xff")])

    def test_a_stream_that_ends_without_exit_is_an_error(self) -> None:
        with self.assertRaises(StreamError) as cm:
            self.stream(b'event: stdout\ndata: {"data":"partial"}\n\n')
        self.assertEqual(cm.exception.code, "connection_error")

    def test_a_refusal_before_output_is_the_ordinary_error(self) -> None:
        self.server.script = [(409, {"Content-Type": "application/json"}, envelope("busy"))]
        with self.assertRaises(ConflictError) as cm:
            Sandbox(self.client()._http, "sbx_abc").exec_stream("x")
        self.assertEqual((cm.exception.code, cm.exception.status), ("busy", 409))
        self.assertEqual(self.server.seen[0][:2], ("POST", "/v1/sandboxes/sbx_abc/exec"))


if __name__ == "__main__":
    unittest.main()
