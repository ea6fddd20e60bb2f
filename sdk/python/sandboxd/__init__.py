"""Python client of sandboxd: sandboxes, sessions, streamed exec, files, processes, terminals.

Standard library only. Quickstart: sdk/python/README.md.
"""

__version__ = "0.1.0"

from ._http import RetryPolicy
from ._box import EventStream, Files, Processes
from .client import Sandboxd, Templates
from .errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    GoneError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitedError,
    SandboxdError,
    ServiceUnavailableError,
    StreamError,
    TransportError,
)
from .models import (
    ConnectUrl,
    ExecEvent,
    ExecResult,
    FileEntry,
    Page,
    ProcessInfo,
    ProcessLogs,
    SandboxSummary,
    SessionSummary,
)
from .sandbox import Sandbox, Sandboxes, Snapshots
from .session import Session, Sessions
from .terminal import Terminal

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ConflictError",
    "ConnectUrl",
    "EventStream",
    "ExecEvent",
    "ExecResult",
    "FileEntry",
    "Files",
    "GoneError",
    "NotFoundError",
    "Page",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "ProcessInfo",
    "ProcessLogs",
    "Processes",
    "RateLimitedError",
    "RetryPolicy",
    "Sandbox",
    "SandboxSummary",
    "Sandboxd",
    "SandboxdError",
    "Sandboxes",
    "Snapshots",
    "ServiceUnavailableError",
    "Session",
    "SessionSummary",
    "Sessions",
    "StreamError",
    "Templates",
    "Terminal",
    "TransportError",
]
