"""The entry point: ``Sandboxd(base_url=..., api_key=...)``."""

from __future__ import annotations

import os
import ssl
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

from ._box import fields, quote_id
from ._http import Body, Http, RetryPolicy
from .errors import SandboxdError, error_for
from .models import ExecResult
from .sandbox import Sandboxes, Snapshots
from .session import Sessions

#: Seconds one socket read may wait: the longest exec the service allows by default (600 s,
#: its MAX_EXEC_TIMEOUT_S) plus time for a VM to start on a loaded host. Pass ``timeout=`` for
#: operators that allow longer execs.
DEFAULT_TIMEOUT_S = 660.0
#: Seconds between polls of a building template in ``templates.wait_ready``.
POLL_INTERVAL_S = 1.0


class Templates:
    """``client.templates``: list, inspect, register (sessions API upload, sandboxes API bake) and delete."""

    def __init__(self, http: Http) -> None:
        self._http = http

    def list(self) -> List[Dict[str, Any]]:
        """One dict per template: the catalog entries for a sandboxes API key, ``{"id", "ready"}``
        for a sessions API key (whose answer is a map by id)."""
        d = self._http.json("GET", "/v1/templates")["templates"]
        if isinstance(d, Mapping):
            return [{"id": k, **v} for k, v in d.items()]
        return list(d)

    def get(self, id: str) -> Dict[str, Any]:
        """Sessions API: ``status`` building/ready/failed. Sandboxes API: ``phase`` and telemetry."""
        return self._http.json("GET", f"/v1/templates/{quote_id(id)}")

    def delete(self, id: str) -> None:
        self._http.request("DELETE", f"/v1/templates/{quote_id(id)}").read()

    def upload(
        self,
        id: str,
        image: Body,
        *,
        mem_mib: Optional[int] = None,
        vcpu_count: Optional[int] = None,
        wait_secs: Optional[int] = None,
    ) -> Dict[str, Any]:
        """The sessions API (scale key): registers ``id`` from an image archive (``docker save`` or OCI
        tarball) given as bytes or a binary file object (streamed). The build runs on; see
        ``wait_ready``."""
        q = {"id": id, "mem_mib": mem_mib, "vcpu_count": vcpu_count, "wait_secs": wait_secs}
        return self._http.json("POST", "/v1/templates", query=q, body=image)

    def bake(
        self,
        name: str,
        image: str,
        *,
        ready: Optional[Mapping[str, Any]] = None,
        registry_auth: Optional[Mapping[str, str]] = None,
        expected_width: Optional[int] = None,
        sizes: Optional[Sequence[Mapping[str, int]]] = None,
    ) -> Dict[str, Any]:
        """The sandboxes API (Pro): bakes ``name`` from the OCI reference ``image``; the same request
        again returns the same template. ``ready`` is the service's ready spec (``cmd``,
        ``ports``...). ``sizes`` (``[{"vcpus": 1, "memory_mib": 256}, ...]``, the first the
        default) are the size classes a create may pick, each frozen at the bake."""
        body = fields(
            name=name,
            image=image,
            ready=dict(ready) if ready is not None else None,
            registry_auth=dict(registry_auth) if registry_auth is not None else None,
            expected_width=expected_width,
            sizes=[dict(s) for s in sizes] if sizes is not None else None,
        )
        # Idempotent by the service's rule: the same definition under the same name is one template.
        return self._http.json("POST", "/v1/templates", json_body=body, idempotent=True)

    def wait_ready(self, id: str, timeout: float = 600.0) -> Dict[str, Any]:
        """Polls until the template is ready (sessions API ``ready``, sandboxes API ``Live``); raises
        SandboxdError ``template_failed`` when its build failed, ``timeout`` past ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            t = self.get(id)
            if t.get("status") == "ready" or t.get("phase") == "Live":
                return t
            if t.get("status") == "failed" or t.get("phase") == "Failed":
                raise SandboxdError("template_failed", None, str(t.get("error", "the build failed")))
            if time.monotonic() > deadline:
                raise SandboxdError("timeout", None, f"template {id} not ready after {timeout} s: {t}")
            time.sleep(POLL_INTERVAL_S)


class Sandboxd:
    """A client of one sandboxd service with one API key.

    ``base_url`` and ``api_key`` default to ``SANDBOXD_URL`` and ``SANDBOXD_API_KEY``. The key's
    tier decides what it may call: the sandboxes API keys (demo, pro, enterprise) use ``sandboxes``;
    sessions API keys (live, scale) use ``exec``, ``exec_batch`` and ``sessions``. ``retry`` sets how
    429/503 answers are retried (``RetryPolicy(max_retries=0)`` turns it off); ``timeout`` bounds
    each socket wait in seconds (None: no bound).
    """

    def __init__(
        self,
        base_url: Optional[str] = None,
        api_key: Optional[str] = None,
        *,
        timeout: Optional[float] = DEFAULT_TIMEOUT_S,
        retry: Optional[RetryPolicy] = None,
        ssl_context: Optional[ssl.SSLContext] = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        url = base_url or os.environ.get("SANDBOXD_URL")
        if not url:
            raise ValueError("no service URL: pass base_url= or set SANDBOXD_URL")
        key = api_key if api_key is not None else os.environ.get("SANDBOXD_API_KEY")
        self._http = Http(
            url,
            key,
            timeout=timeout,
            retry=retry or RetryPolicy(),
            ssl_context=ssl_context,
            user_agent=f"sandboxd-python/{_version()}",
            sleep=sleep,
        )
        self.sandboxes = Sandboxes(self._http)
        self.snapshots = Snapshots(self._http)
        self.sessions = Sessions(self._http)
        self.templates = Templates(self._http)

    @property
    def base_url(self) -> str:
        return self._http.base_url

    def health(self) -> Dict[str, Any]:
        """``GET /v1/health`` (no key needed): status, version, templates' readiness, settings."""
        return self._http.json("GET", "/v1/health")

    def exec(
        self,
        code: str,
        template_id: str,
        *,
        timeout: Optional[int] = None,
        retry: Optional[bool] = None,
    ) -> ExecResult:
        """A one-shot of the sessions API: runs ``code`` in a fresh VM of ``template_id`` (its interpreter)."""
        body = fields(code=code, template_id=template_id, timeout_seconds=timeout)
        return ExecResult.from_json(self._http.json("POST", "/v1/exec", json_body=body, retry=retry))

    def exec_batch(
        self,
        executions: Sequence[Mapping[str, Any]],
        *,
        retry: Optional[bool] = None,
    ) -> List[Union[ExecResult, SandboxdError]]:
        """The sessions API: one VM per item (``{"code", "template_id", "timeout_seconds"?}``), in
        parallel; one result per item in order, an item that failed as its SandboxdError."""
        d = self._http.json(
            "POST", "/v1/exec/batch", json_body={"executions": [dict(e) for e in executions]}, retry=retry
        )
        out: List[Union[ExecResult, SandboxdError]] = []
        for r in d["results"]:
            if "error" in r and "exit_code" not in r:
                e = r["error"]
                out.append(error_for(e["code"], r.get("status"), e["message"], r.get("retry_after_seconds")))
            else:
                out.append(ExecResult.from_json(r))
        return out

    def usage(self, start: Optional[str] = None, end: Optional[str] = None) -> Dict[str, Any]:
        """The sandboxes API: the tenant's usage totals between two RFC 3339 times (default: this month)."""
        return self._http.json("GET", "/v1/usage", query={"from": start, "to": end})

    def close(self) -> None:
        """Nothing to release (every call opens and closes its own connection); for symmetry."""

    def __enter__(self) -> "Sandboxd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _version() -> str:
    from . import __version__

    return __version__
