"""The SDK against a real sandboxd (real VMs): ``SANDBOXD_URL`` and ``SANDBOXD_API_KEY`` (a Pro
key), ``SANDBOXD_TEST_LIVE_KEY`` (a live key of the same tenant, for sessions and one-shot exec)
and ``SANDBOXD_TEST_OTHER_KEY`` (a Pro key of another tenant). ``SANDBOXD_TEST_TEMPLATE`` names a
template with python3 (default ``python``). tests/e2e/sdk-python.test.ts runs these with the service
it starts; without the variables the module is skipped.

One sandbox serves most tests (VMs are the expensive part); the context-manager and fork tests
make their own."""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile
import time
import unittest
from typing import List

from sandboxd import (
    BadRequestError,
    ConflictError,
    ExecEvent,
    NotFoundError,
    Sandbox,
    Sandboxd,
    SandboxdError,
)

URL = os.environ.get("SANDBOXD_URL")
TEMPLATE = os.environ.get("SANDBOXD_TEST_TEMPLATE", "python")
#: Bytes of the binary round trip: several MiB, so the transfer spans many chunks each way.
FILE_BYTES = 3 * 1024 * 1024 + 7
#: A harness wait for terminal output from a shell on a loaded, emulated guest, seconds.
TERMINAL_WAIT_S = 30.0


@unittest.skipUnless(URL, "SANDBOXD_URL is not set: no service to test against")
class ServiceTest(unittest.TestCase):
    client: Sandboxd
    sbx: Sandbox

    @classmethod
    def setUpClass(cls) -> None:
        cls.client = Sandboxd()
        cls.sbx = cls.client.sandboxes.create(template=TEMPLATE, labels={"suite": "sdk-python"})

    @classmethod
    def tearDownClass(cls) -> None:
        cls.sbx.delete()

    # ---- errors ----------------------------------------------------------------------------

    def test_another_tenants_id_is_not_found(self) -> None:
        other = Sandboxd(api_key=os.environ["SANDBOXD_TEST_OTHER_KEY"])
        with self.assertRaises(NotFoundError) as cm:
            other.sandboxes.get(self.sbx.id)
        self.assertEqual((cm.exception.code, cm.exception.status), ("not_found", 404))
        foreign = Sandbox(other._http, self.sbx.id)
        calls = (
            lambda: foreign.exec("true"),
            lambda: foreign.files.read("/etc/hostname"),
            lambda: foreign.terminal(),  # refused before the WebSocket upgrade
        )
        for call in calls:
            with self.assertRaises(SandboxdError) as cm2:
                call()
            self.assertEqual((cm2.exception.code, cm2.exception.status), ("not_found", 404))

    def test_refusals_carry_their_codes(self) -> None:
        with self.assertRaises(BadRequestError) as cm:
            self.sbx.exec("true", cwd="/no/such/dir")
        self.assertEqual((cm.exception.code, cm.exception.status), ("bad_request", 400))
        with self.assertRaises(NotFoundError):
            self.sbx.files.read("/no/such/file")
        with self.assertRaises(SandboxdError) as cm3:
            Sandboxd(api_key="svc_pro_aaaaaaaaaaaa_" + "b" * 40).sandboxes.list()
        self.assertEqual((cm3.exception.code, cm3.exception.status), ("unauthorized", 401))

    # ---- exec ------------------------------------------------------------------------------

    def test_exec_options_reach_the_command(self) -> None:
        r = self.sbx.exec(
            'echo "$GREETING from $(pwd) as $(id -un)"; cat; exit 3',
            env={"GREETING": "hello"},
            cwd="/tmp",
            user="nobody",
            stdin="from stdin\n",
        )
        self.assertEqual(r.exit_code, 3)
        self.assertFalse(r.ok)
        self.assertEqual(r.stdout, "hello from /tmp as nobody\nfrom stdin\n")
        argv = self.sbx.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "c"])
        self.assertEqual(argv.stdout, "['a b', 'c']\n")
        withfile = self.sbx.exec("cat /tmp/f.bin | od -An -tx1", files=[("/tmp/f.bin", b"\x00\xff")])
        self.assertEqual(withfile.stdout.split(), ["00", "ff"])

    def test_stream_arrives_in_order_while_the_command_runs(self) -> None:
        script = (
            "for i in 1 2 3; do echo out$i; sleep 0.3; echo err$i >&2; sleep 0.3; done; "
            "printf '\\377\\376'; exit 7"
        )
        events: List[ExecEvent] = []
        arrived: List[float] = []
        with self.sbx.exec_stream(script) as stream:
            for ev in stream:
                events.append(ev)
                arrived.append(time.monotonic())
        self.assertEqual([e.type for e in events].count("exit"), 1)
        self.assertEqual(events[-1].type, "exit")
        self.assertEqual(events[-1].exit_code, 7)
        self.assertEqual(stream.result.exit_code if stream.result else None, 7)
        out = b"".join(e.data for e in events if e.type == "stdout")
        err = b"".join(e.data for e in events if e.type == "stderr")
        self.assertEqual(out, b"out1\nout2\nout3\n\xff\xfe")  # the last bytes exact (not UTF-8)
        self.assertEqual(err, b"err1\nerr2\nerr3\n")
        # Across the two streams, in the order written (0.3 s apart).
        order = [e.text.strip() for e in events if e.type != "exit" and e.text.strip()]
        lines = [ln for chunk in order for ln in chunk.split("\n") if ln.startswith(("out", "err"))]
        self.assertEqual(lines, ["out1", "err1", "out2", "err2", "out3", "err3"])
        # Streamed, not delivered at the end: the first line came well before the exit.
        self.assertGreater(arrived[-1] - arrived[0], 1.0)

    def test_closing_a_stream_cancels_the_command(self) -> None:
        stream = self.sbx.exec_stream("echo started; sleep 300")
        for ev in stream:
            self.assertEqual(ev.text, "started\n")
            break
        stream.close()
        # The guest kills the command's group once the connection is gone: soon the sandbox takes
        # an exec again (409 busy while it still runs) and no `sleep 300` is left. The image has no
        # pgrep: count argv entries "300" (the pattern 30[0] keeps grep from counting itself).
        count = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -cx '30[0]' || true"
        deadline = time.monotonic() + 30  # a harness wait: the kill travels through the agent
        left = "?"
        while time.monotonic() < deadline:
            try:
                left = self.sbx.exec(count).stdout.strip()
            except ConflictError:
                left = "busy"
            if left == "0":
                break
            time.sleep(0.2)
        self.assertEqual(left, "0")

    # ---- files -----------------------------------------------------------------------------

    def test_files_round_trip_byte_exact(self) -> None:
        data = os.urandom(FILE_BYTES)
        digest = hashlib.sha256(data).hexdigest()
        files = self.sbx.files
        self.assertEqual(files.write("/tmp/sdk/blob.bin", data), FILE_BYTES)
        self.assertEqual(files.read("/tmp/sdk/blob.bin"), data)
        # The guest sees the same bytes.
        self.assertEqual(self.sbx.exec("sha256sum /tmp/sdk/blob.bin").stdout.split()[0], digest)
        # Streamed from a local file (Content-Length from its size) and from chunks (chunked).
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            self.assertEqual(files.upload(f.name, "/tmp/sdk/from-file.bin"), FILE_BYTES)
        chunks = (data[i : i + 100_000] for i in range(0, len(data), 100_000))
        self.assertEqual(files.write("/tmp/sdk/from-chunks.bin", chunks), FILE_BYTES)
        sink = io.BytesIO()
        self.assertEqual(files.download("/tmp/sdk/from-chunks.bin", sink), FILE_BYTES)
        self.assertEqual(hashlib.sha256(sink.getvalue()).hexdigest(), digest)
        self.assertEqual(files.read("/tmp/sdk/from-file.bin"), data)
        entries = {e.name: e for e in files.list("/tmp/sdk")}
        self.assertEqual(set(entries), {"blob.bin", "from-file.bin", "from-chunks.bin"})
        self.assertEqual(entries["blob.bin"].type, "file")
        self.assertEqual(entries["blob.bin"].size, FILE_BYTES)
        files.write("/tmp/sdk/text.txt", "héllo\n")
        self.assertEqual(files.read_text("/tmp/sdk/text.txt"), "héllo\n")
        with self.assertRaises(ConflictError):
            files.remove("/tmp/sdk")  # not empty
        for name in entries:
            files.remove(f"/tmp/sdk/{name}")
        self.assertFalse(files.exists("/tmp/sdk/blob.bin"))
        with self.assertRaises(NotFoundError):
            files.read("/tmp/sdk/blob.bin")

    # ---- processes and the terminal --------------------------------------------------------

    def test_background_process_logs_and_kill(self) -> None:
        procs = self.sbx.processes
        p = procs.start("echo ready; read line; echo got $line; sleep 300")
        self.assertTrue(p.running)
        procs.write_stdin(p.pid, "ping\n")
        followed = b""
        with procs.follow(p.pid) as stream:
            for ev in stream:
                followed += ev.data
                if b"got ping" in followed:
                    break
        self.assertIn(b"ready\ngot ping\n", followed)
        self.assertIn(p.pid, [x.pid for x in procs.list()])
        killed = procs.kill(p.pid)
        self.assertEqual((killed.running, killed.exit_code), (False, 137))
        self.assertEqual(procs.logs(p.pid).stdout, "ready\ngot ping\n")

    def test_terminal_types_and_reads(self) -> None:
        with self.sbx.terminal(cols=100, rows=30) as term:
            term.write("echo $((6*7))\r")
            # 42 on a line of its own (bash may put a bracketed-paste switch and a bare CR before
            # it): the echoed command line holds $((6*7)), not 42.
            term.read_until(re.compile(rb"[\r\n]42\r\n"), timeout=TERMINAL_WAIT_S)
            term.resize(120, 40)
            term.write("stty size\r")
            term.read_until(b"40 120", timeout=TERMINAL_WAIT_S)
            term.write("exit\r")
            rest = b"".join(term)  # until the shell's exit closes it
            self.assertIsInstance(rest, bytes)
        self.assertEqual(term.close_code, 1000)

    # ---- lifecycle -------------------------------------------------------------------------

    def test_context_manager_deletes_even_when_the_block_raises(self) -> None:
        with self.assertRaises(ZeroDivisionError):
            with self.client.sandboxes.create(template=TEMPLATE) as s:
                sid = s.id
                self.assertEqual(s.exec("echo in").stdout, "in\n")
                self.assertIn(sid, [x.id for x in self.client.sandboxes.list()])
                1 / 0
        self.assertNotIn(sid, [x.id for x in self.client.sandboxes.list()])
        with self.assertRaises(NotFoundError):
            self.client.sandboxes.get(sid)

    def test_fork_suspend_resume(self) -> None:
        self.sbx.files.write("/tmp/state", "parent")
        kids = self.sbx.fork(count=2)
        try:
            self.assertEqual(len(kids), 2)
            kids[0].files.write("/tmp/state", "child0")
            self.assertEqual([k.files.read_text("/tmp/state") for k in kids], ["child0", "parent"])
            self.assertEqual(self.sbx.files.read_text("/tmp/state"), "parent")
            k = kids[1]
            self.assertEqual(k.suspend()["state"], "suspended")
            self.assertEqual(k.state, "suspended")
            m = k.metrics()  # looking at a suspended sandbox leaves it suspended
            self.assertEqual(m["state"], "suspended")
            self.assertEqual(m["interval_s"], 2)
            self.assertEqual(k.state, "suspended")
            with self.assertRaises(ConflictError):
                k.exec("true")  # a user's suspend holds until resume
            self.assertEqual(k.resume()["state"], "running")
            self.assertEqual(k.exec("cat /tmp/state").stdout, "parent")
        finally:
            for k in kids:
                k.delete()

    def test_connect_url_for_a_port_the_template_does_not_expose(self) -> None:
        with self.assertRaises(ConflictError) as cm:
            self.sbx.connect_url(9999, ttl_seconds=60)
        self.assertEqual(cm.exception.code, "port_not_exposed")

    def test_templates(self) -> None:
        self.assertIn(TEMPLATE, [t["id"] for t in self.client.templates.list()])
        self.assertEqual(self.client.templates.get(TEMPLATE)["phase"], "Live")


@unittest.skipUnless(URL, "SANDBOXD_URL is not set: no service to test against")
class SessionsApiTest(unittest.TestCase):
    """One-shot exec and sessions with a live key."""

    def setUp(self) -> None:
        self.client = Sandboxd(api_key=os.environ["SANDBOXD_TEST_LIVE_KEY"])

    def test_one_shot_exec(self) -> None:
        r = self.client.exec(code="print(6*7)", template_id=TEMPLATE)
        self.assertEqual((r.stdout, r.exit_code), ("42\n", 0))

    def test_session_keeps_its_state_and_streams(self) -> None:
        with self.client.sessions.create(TEMPLATE) as sess:
            self.assertIn(sess.id, [s.session_id for s in self.client.sessions.list()])
            sess.files.write("/tmp/x", "41")
            r = sess.exec("print(int(open('/tmp/x').read()) + 1)")
            self.assertEqual(r.stdout, "42\n")
            events = list(sess.exec_stream(commands=[["sh", "-c", "echo a; echo b >&2"]]))
            self.assertEqual(events[-1].type, "exit")
            self.assertEqual(b"".join(e.data for e in events if e.type == "stdout"), b"a\n")
            sid = sess.id
        with self.assertRaises(SandboxdError) as cm:
            self.client.sessions.get(sid)
        self.assertIn(cm.exception.status, (404, 410))


if __name__ == "__main__":
    unittest.main()
