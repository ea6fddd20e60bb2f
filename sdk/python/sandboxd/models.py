"""The values the SDK returns. Each keeps the service's whole JSON answer in ``raw``, so a field
the service adds later is readable before this SDK names it."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, Iterator, List, Mapping, Optional, TypeVar

from .errors import StreamError


@dataclass(frozen=True)
class ExecResult:
    """One command's (or one exec's last command's) outcome."""

    id: str
    stdout: str
    stderr: str
    exit_code: int
    exec_time_ms: float = 0.0
    fork_time_ms: float = 0.0
    total_time_ms: float = 0.0
    #: True when stdout and stderr were cut to the service's output cap (the command ran on).
    truncated: bool = False
    seed: Optional[str] = None
    seed_ack: Optional[str] = None
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ExecResult":
        return cls(
            id=str(d.get("id", "")),
            stdout=d.get("stdout", ""),
            stderr=d.get("stderr", ""),
            exit_code=int(d.get("exit_code", -1)),
            exec_time_ms=float(d.get("exec_time_ms", 0)),
            fork_time_ms=float(d.get("fork_time_ms", 0)),
            total_time_ms=float(d.get("total_time_ms", 0)),
            truncated=bool(d.get("truncated", False)),
            seed=d.get("seed"),
            seed_ack=d.get("seed_ack"),
            raw=d,
        )


@dataclass(frozen=True)
class ExecEvent:
    """One event of a streamed exec or followed log.

    ``type`` is ``"stdout"`` or ``"stderr"`` (``data`` holds the exact bytes, ``text`` them decoded)
    or ``"exit"`` (last; ``result`` holds the exec's result, or ``process`` a process's info, and
    ``exit_code`` its code). A failure after the stream began is raised as a ``StreamError``.
    """

    type: str
    data: bytes = b""
    result: Optional[ExecResult] = None
    process: Optional["ProcessInfo"] = None

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    @property
    def exit_code(self) -> Optional[int]:
        if self.result is not None:
            return self.result.exit_code
        if self.process is not None:
            return self.process.exit_code
        return None


def output_event(kind: str, payload: str) -> ExecEvent:
    """A ``stdout``/``stderr`` event from its JSON data (``data`` text or ``data_b64`` bytes)."""
    d = json.loads(payload)
    if "data_b64" in d:
        return ExecEvent(kind, base64.b64decode(d["data_b64"]))
    return ExecEvent(kind, str(d.get("data", "")).encode("utf-8"))


def stream_error(payload: str) -> StreamError:
    try:
        d = json.loads(payload)
    except ValueError:
        d = {}
    return StreamError(str(d.get("code", "internal")), None, str(d.get("message", payload)))


@dataclass(frozen=True)
class FileEntry:
    name: str
    #: ``file``, ``dir``, ``symlink`` (the link itself) or ``other`` (device, FIFO, socket).
    type: str
    size: int
    #: Permission bits, e.g. 0o644.
    mode: int
    #: Seconds since the epoch.
    mtime: int

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "FileEntry":
        return cls(d["name"], d["type"], int(d["size"]), int(d["mode"]), int(d["mtime"]))


@dataclass(frozen=True)
class ProcessInfo:
    """A background process: ``pid`` is the service's number for it in its sandbox (1, 2, ...)."""

    pid: int
    command: str
    running: bool
    #: None while it runs (or when unknown); 128+N after signal N (137 once killed).
    exit_code: Optional[int]
    keep_awake: bool = False

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ProcessInfo":
        return cls(
            pid=int(d["pid"]),
            command=str(d.get("command", "")),
            running=bool(d.get("running", False)),
            exit_code=d.get("exit_code"),
            keep_awake=bool(d.get("keep_awake", False)),
        )


@dataclass(frozen=True)
class ProcessLogs:
    stdout: str
    stderr: str
    #: Older output was dropped (the service keeps the last 1 MiB of each stream).
    truncated: bool
    process: ProcessInfo


@dataclass(frozen=True)
class ConnectUrl:
    """A scoped WebSocket URL to a port of the sandbox, valid until ``expires_at`` (RFC 3339)."""

    url: str
    expires_at: str


@dataclass(frozen=True)
class SandboxSummary:
    id: str
    template: str
    state: str


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    idle_secs: float
    exec_count: int


T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a list (docs/lists.md): its rows and the cursor of the next page, ``None`` on
    the last."""

    items: List[T]
    next_cursor: Optional[str]


def follow_pages(page: Callable[[Optional[str]], Page[T]]) -> Iterator[Page[T]]:
    """Every page ``page`` gives (called with the previous page's ``next_cursor``, ``None`` for
    the first), in order, each fetched when the loop asks for it (docs/lists.md)."""
    cursor: Optional[str] = None
    while True:
        p = page(cursor)
        yield p
        if p.next_cursor is None:
            return
        cursor = p.next_cursor


def label_query(labels: Optional[Mapping[str, str]]) -> List[str]:
    """``label`` query values for pairs every row must hold."""
    return [f"{k}:{v}" for k, v in (labels or {}).items()]


def file_entries(items: List[Dict[str, Any]]) -> List[FileEntry]:
    return [FileEntry.from_json(e) for e in items]
