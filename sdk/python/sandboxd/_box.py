"""What a sandboxes API sandbox and a sessions API session share: streamed exec, files, background
processes and the terminal, on ``/v1/sandboxes/{id}`` or ``/v1/sessions/{id}``."""

from __future__ import annotations

import base64
import os
from typing import (
    IO,
    Any,
    BinaryIO,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    TypedDict,
    Union,
)
from urllib.parse import quote

from ._http import Body, Http, Response
from ._sse import SseParser
from ._ws import WebSocket
from .errors import NotFoundError
from .models import (
    ExecEvent,
    ExecResult,
    FileEntry,
    ProcessInfo,
    ProcessLogs,
    file_entries,
    output_event,
    stream_error,
)
from .terminal import Terminal

#: A file for ``exec(files=...)``: ``(path, content)``, content as text or bytes.
FileSpec = Tuple[str, Union[str, bytes]]
Stdin = Union[str, bytes, None]


class ExecOptions(TypedDict, total=False):
    """The options every exec form takes (``exec``, ``exec_stream`` of sandboxes and sessions)."""

    #: Variables added to the image's environment for this exec.
    env: Mapping[str, str]
    #: An absolute working directory (one that does not exist is BadRequestError).
    cwd: str
    #: A user name of the sandbox's /etc/passwd, or a uid.
    user: Union[str, int]
    #: Standard input: text, or bytes sent exactly.
    stdin: Stdin
    #: ``(path, content)`` pairs written before the command runs.
    files: Sequence[FileSpec]
    #: The command's limit, seconds.
    timeout: int
    #: Retry a 429/503 (True) or not (False) whatever the client's policy says.
    retry: bool


def fields(**kw: Any) -> Dict[str, Any]:
    """The members that are not None: a request body's optional fields."""
    return {k: v for k, v in kw.items() if v is not None}


def exec_body(o: ExecOptions) -> Dict[str, Any]:
    """The per-exec fields both exec forms take, as the service names them."""
    stdin = o.get("stdin")
    user = o.get("user")
    files = o.get("files")
    env = o.get("env")
    return fields(
        env=dict(env) if env is not None else None,
        cwd=o.get("cwd"),
        user=str(user) if user is not None else None,
        stdin=stdin if isinstance(stdin, str) else None,
        stdin_b64=base64.b64encode(stdin).decode("ascii") if isinstance(stdin, bytes) else None,
        files=[_file_write(p, c) for p, c in files] if files else None,
        timeout_seconds=o.get("timeout"),
    )


def _file_write(path: str, content: Union[str, bytes]) -> Dict[str, str]:
    if isinstance(content, str):
        return {"path": path, "content": content}
    return {"path": path, "content": base64.b64encode(content).decode("ascii"), "encoding": "base64"}


class EventStream:
    """The events of a streamed exec or followed log, read as they arrive.

    Iterate it for :class:`ExecEvent` values (``stdout``/``stderr`` chunks in the order they were
    written, then one ``exit``); a failure after the stream began raises ``StreamError``. Closing it
    early (``close()``, leaving a ``with`` block, or ``break`` then dropping it) closes the
    connection, which cancels a streamed exec's command. ``result`` holds the exit event's
    ExecResult once seen.
    """

    def __init__(self, res: Response, exit_kind: str) -> None:
        self._res = res
        self._exit_kind = exit_kind
        self.result: Optional[ExecResult] = None
        self.process: Optional[ProcessInfo] = None
        self._done = False

    def __iter__(self) -> Iterator[ExecEvent]:
        parser = SseParser()
        try:
            while not self._done:
                chunk = self._res.read1()
                if not chunk:
                    break
                for ev in parser.feed(chunk):
                    if ev.event in ("stdout", "stderr"):
                        yield output_event(ev.event, ev.data)
                    elif ev.event == "exit":
                        self._done = True
                        yield self._exit(ev.data)
                        return
                    elif ev.event == "error":
                        self._done = True
                        raise stream_error(ev.data)
            if not self._done:
                raise stream_error('{"code":"connection_error","message":"the stream ended without an exit event"}')
        finally:
            self.close()

    def _exit(self, payload: str) -> ExecEvent:
        import json

        d = json.loads(payload)
        if self._exit_kind == "process":
            self.process = ProcessInfo.from_json(d)
            return ExecEvent("exit", process=self.process)
        self.result = ExecResult.from_json(d)
        return ExecEvent("exit", result=self.result)

    def close(self) -> None:
        self._res.close()

    def __enter__(self) -> "EventStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Files:
    """Files of a sandbox or session, any size, binary or not; bodies are streamed both ways."""

    def __init__(self, http: Http, base: str) -> None:
        self._http = http
        self._path = f"{base}/files"

    def write(self, path: str, data: Body, *, user: Union[str, int, None] = None) -> int:
        """Writes ``data`` (bytes, text as UTF-8, a binary file object read in blocks, or an
        iterable of byte chunks) to the absolute ``path``, creating parent directories; the file
        is replaced atomically. Returns its size."""
        q = {"path": path, "user": user}
        return int(self._http.json("PUT", self._path, query=q, body=data)["size"])

    def upload(self, local_path: Union[str, "os.PathLike[str]"], path: str, **kw: Any) -> int:
        """Writes the local file ``local_path`` to ``path`` in the sandbox (streamed)."""
        with open(local_path, "rb") as f:
            return self.write(path, f, **kw)

    def read(self, path: str, *, user: Union[str, int, None] = None) -> bytes:
        """The whole file's bytes (use ``stream``/``download`` for files too big for memory)."""
        return b"".join(self.stream(path, user=user))

    def read_text(self, path: str, *, user: Union[str, int, None] = None, encoding: str = "utf-8") -> str:
        return self.read(path, user=user).decode(encoding)

    def stream(self, path: str, *, user: Union[str, int, None] = None) -> Iterator[bytes]:
        """The file's bytes in chunks as they arrive. A download that breaks off raises
        ``TransportError`` rather than ending short."""
        res = self._http.request("GET", self._path, query={"path": path, "user": user})
        return res.iter_bytes()

    def download(
        self, path: str, dest: Union[str, "os.PathLike[str]", IO[bytes]], *, user: Union[str, int, None] = None
    ) -> int:
        """Copies the file to a local path or binary file object; returns the bytes written."""
        n = 0
        if isinstance(dest, (str, os.PathLike)):
            with open(dest, "wb") as f:
                return self.download(path, f, user=user)
        out: BinaryIO = dest  # type: ignore[assignment]
        for chunk in self.stream(path, user=user):
            out.write(chunk)
            n += len(chunk)
        return n

    def list(self, path: str, *, user: Union[str, int, None] = None) -> List[FileEntry]:
        """The directory's entries (at most 10,000: the service's cap)."""
        d = self._http.json("GET", self._path, query={"path": path, "list": True, "user": user})
        return file_entries(d["entries"])

    def exists(self, path: str, *, user: Union[str, int, None] = None) -> bool:
        """Whether ``path`` exists (a file or a directory)."""
        parent, _, name = path.rstrip("/").rpartition("/")
        try:
            return any(e.name == name for e in self.list(parent or "/", user=user))
        except NotFoundError:
            return False

    def remove(self, path: str, *, user: Union[str, int, None] = None) -> None:
        """Deletes a file, symlink or empty directory (a directory with entries: ConflictError)."""
        self._http.request("DELETE", self._path, query={"path": path, "user": user}).read()


class Processes:
    """Background processes: they run beside exec and outlive the call that started them."""

    def __init__(self, http: Http, base: str) -> None:
        self._http = http
        self._path = f"{base}/processes"

    def start(
        self,
        command: Union[str, Sequence[str]],
        *,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        user: Union[str, int, None] = None,
        keep_awake: bool = False,
    ) -> ProcessInfo:
        """Starts ``command`` (a line for ``/bin/sh -c``, or an argv list run without a shell)."""
        body = fields(
            env=dict(env) if env is not None else None,
            cwd=cwd,
            user=str(user) if user is not None else None,
            keep_awake=keep_awake or None,
            **({"command": command} if isinstance(command, str) else {"argv": list(command)}),
        )
        return ProcessInfo.from_json(self._http.json("POST", self._path, json_body=body))

    def list(self) -> List[ProcessInfo]:
        return [ProcessInfo.from_json(p) for p in self._http.json("GET", self._path)["processes"]]

    def logs(self, pid: int) -> ProcessLogs:
        """The output kept so far (the last 1 MiB of each stream) and the process's info."""
        d = self._http.json("GET", f"{self._path}/{pid}/logs")
        return ProcessLogs(d["stdout"], d["stderr"], bool(d["truncated"]), ProcessInfo.from_json(d["process"]))

    def follow(self, pid: int) -> EventStream:
        """The kept output, then new output as it is written, then an ``exit`` event carrying the
        process's info once it ended. Closing the stream stops following; the process runs on."""
        res = self._http.request("GET", f"{self._path}/{pid}/logs", accept="text/event-stream")
        return EventStream(res, "process")

    def write_stdin(self, pid: int, data: Union[str, bytes], *, eof: bool = False) -> int:
        """Writes to the process's standard input (``eof=True`` closes it afterwards)."""
        body: Dict[str, Any] = {"eof": eof}
        if isinstance(data, str):
            body["data"] = data
        else:
            body["data_b64"] = base64.b64encode(data).decode("ascii")
        return int(self._http.json("POST", f"{self._path}/{pid}/stdin", json_body=body)["bytes"])

    def kill(self, pid: int) -> ProcessInfo:
        """Kills the process's group (SIGKILL); returns its info once it ended (exit code 137)."""
        return ProcessInfo.from_json(self._http.json("DELETE", f"{self._path}/{pid}"))


class Box:
    """The shared half of Sandbox and Session."""

    def __init__(self, http: Http, base: str) -> None:
        self._http = http
        self._base = base
        self.files = Files(http, base)
        self.processes = Processes(http, base)

    def _exec_json(self, body: Dict[str, Any], o: ExecOptions) -> ExecResult:
        body = {**body, **exec_body(o)}
        d = self._http.json("POST", f"{self._base}/exec", json_body=body, retry=o.get("retry"))
        return ExecResult.from_json(d)

    def _exec_stream(self, body: Dict[str, Any], o: ExecOptions) -> EventStream:
        body = {**body, **exec_body(o)}
        res = self._http.request(
            "POST", f"{self._base}/exec", json_body=body, accept="text/event-stream", retry=o.get("retry")
        )
        return EventStream(res, "exec")

    def terminal(self, cols: int = 80, rows: int = 24) -> Terminal:
        """Opens an interactive login shell in the sandbox (a PTY of ``cols`` x ``rows``)."""
        h = self._http
        scheme = "wss" if h.scheme == "https" else "ws"
        netloc = h.host if h.port is None else f"{h.host}:{h.port}"
        if ":" in h.host:  # an IPv6 literal
            netloc = f"[{h.host}]" + ("" if h.port is None else f":{h.port}")
        url = f"{scheme}://{netloc}{h.url_path(self._base + '/pty', {'cols': cols, 'rows': rows})}"
        ws = WebSocket.connect(url, h.auth_headers(), h.timeout, h.ssl_context)
        return Terminal(ws)


def quote_id(id: str) -> str:
    return quote(id, safe="")
