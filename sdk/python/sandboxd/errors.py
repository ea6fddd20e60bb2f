"""Errors of the sandboxd SDK.

Every failure the service reports is a :class:`SandboxdError` carrying the service's stable
``code`` (the ``{"code", "message"}`` envelope of every error answer), the HTTP ``status`` and,
when the service sent one, ``retry_after`` in seconds. Branch on ``code`` (or on the subclasses,
which group the common codes), never on ``message``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Type


class SandboxdError(Exception):
    """An error answer of the service, or a failure to reach it (``TransportError``)."""

    code: str
    status: Optional[int]
    message: str
    retry_after: Optional[float]
    #: Machine-readable facts, for the codes that document them (``size_unavailable``: ``sizes``).
    details: Optional[Dict[str, Any]]

    def __init__(
        self,
        code: str,
        status: Optional[int],
        message: str,
        retry_after: Optional[float] = None,
        details: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__(f"{code}: {message}" if status is None else f"{status} {code}: {message}")
        self.code = code
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.details = details


class BadRequestError(SandboxdError):
    """400: the request is malformed, or the sandbox refused a path, user or file."""


class AuthenticationError(SandboxdError):
    """401: no key, or a key the service does not know (or revoked)."""


class PermissionDeniedError(SandboxdError):
    """403: the key's tier or API may not do this."""


class NotFoundError(SandboxdError):
    """404: no such sandbox, session, template, file or process (or another tenant's)."""


class GoneError(SandboxdError):
    """410: the session was reclaimed."""


class ConflictError(SandboxdError):
    """409: the state does not allow the call (busy, suspended, in use, not exposed...)."""


class PayloadTooLargeError(SandboxdError):
    """413: the body is over the service's limit."""


class RateLimitedError(SandboxdError):
    """429: over the key's rate limit or the tenant's quota; ``retry_after`` says when to retry."""


class ServiceUnavailableError(SandboxdError):
    """5xx: the service, its database or the sandbox's host could not serve the call now."""


class TransportError(SandboxdError):
    """The service could not be reached, or the connection broke (``status`` is None)."""


class StreamError(SandboxdError):
    """A streamed exec or log failed after it began (the stream's ``error`` event)."""


_BY_CODE: Dict[str, Type[SandboxdError]] = {
    "bad_request": BadRequestError,
    "invalid_file": BadRequestError,
    "size_unavailable": BadRequestError,
    "unauthorized": AuthenticationError,
    "forbidden": PermissionDeniedError,
    "demo_tier_limit": PermissionDeniedError,
    "not_found": NotFoundError,
    "gone": GoneError,
    "busy": ConflictError,
    "conflict": ConflictError,
    "template_in_use": ConflictError,
    "template_not_ready": ConflictError,
    "port_not_exposed": ConflictError,
    "payload_too_large": PayloadTooLargeError,
    "rate_limited": RateLimitedError,
    "quota_exceeded": RateLimitedError,
    "at_capacity": ServiceUnavailableError,
    "agent_unavailable": ServiceUnavailableError,
    "db_unavailable": ServiceUnavailableError,
    "gateway_unavailable": ServiceUnavailableError,
    "spawn_failed": ServiceUnavailableError,
    "bringup_timeout": ServiceUnavailableError,
    "insufficient_storage": ServiceUnavailableError,
}

_BY_STATUS: Dict[int, Type[SandboxdError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    413: PayloadTooLargeError,
    429: RateLimitedError,
}


def error_for(
    code: str,
    status: Optional[int],
    message: str,
    retry_after: Optional[float] = None,
    details: Optional[Dict[str, Any]] = None,
) -> SandboxdError:
    """The most specific class for ``code`` (else for ``status``) holding this answer."""
    cls = _BY_CODE.get(code)
    if cls is None and status is not None:
        cls = _BY_STATUS.get(status, ServiceUnavailableError if status >= 500 else SandboxdError)
    return (cls or SandboxdError)(code, status, message, retry_after, details)
