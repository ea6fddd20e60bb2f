"""Sandboxes of the sandboxes API (Pro, demo and enterprise keys): ``client.sandboxes``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from ._box import Box, EventStream, ExecOptions, fields, quote_id
from ._http import Http
from .errors import NotFoundError
from .models import ConnectUrl, ExecResult, Page, SandboxSummary, follow_pages, label_query

if TYPE_CHECKING:  # the annotations are strings at run time (PEP 563): 3.9 needs no Unpack
    from typing_extensions import Unpack

Command = Union[str, Sequence[str], Sequence[Sequence[str]]]


def command_fields(cmd: Optional[Command]) -> Dict[str, Any]:
    """A command line (``/bin/sh -c``), one argv list, or a list of argv lists run in order."""
    if cmd is None:
        return {}
    if isinstance(cmd, str):
        return {"command": cmd}
    items = list(cmd)
    if items and all(isinstance(c, str) for c in items):
        return {"commands": [items]}
    return {"commands": [list(c) for c in items]}


class Sandbox(Box):
    """A sandbox: a VM that lives until deleted. ``with client.sandboxes.create(...) as sbx:``
    deletes it when the block ends."""

    def __init__(self, http: Http, id: str, info: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(http, f"/v1/sandboxes/{quote_id(id)}")
        self.id = id
        #: The last answer describing this sandbox (create, fork or ``info()``).
        self.data: Dict[str, Any] = dict(info or {"id": id})

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"

    @property
    def template(self) -> Optional[str]:
        return self.data.get("template")

    @property
    def endpoints(self) -> Dict[str, str]:
        return dict(self.data.get("endpoints") or {})

    def info(self) -> Dict[str, Any]:
        """``GET /v1/sandboxes/{id}``: state, age, idle time, exec count, labels, endpoints..."""
        self.data = self._http.json("GET", self._base)
        return self.data

    @property
    def state(self) -> str:
        return str(self.info()["state"])

    def exec(self, cmd: Optional[Command] = None, **options: Unpack[ExecOptions]) -> ExecResult:
        """Runs ``cmd`` (a shell line, an argv list, or argv lists in order) and waits for it.

        Options (``ExecOptions``): ``env`` adds variables, ``cwd`` is an absolute working
        directory, ``user`` a name or uid of the sandbox, ``stdin`` text or bytes, ``files``
        ``(path, content)`` pairs written first, ``timeout`` the command's limit in seconds,
        ``retry`` this call's retry choice. A non-zero exit is a result, not an error."""
        return self._exec_json(command_fields(cmd), options)

    def exec_stream(self, cmd: Command, **options: Unpack[ExecOptions]) -> EventStream:
        """Like ``exec`` (the same options), but its output arrives as events while it runs::

            for ev in sbx.exec_stream("make test"):
                if ev.type == "stdout": print(ev.text, end="")
                elif ev.type == "exit": print("exit", ev.exit_code)

        Refusals before any output (busy, a bad cwd) raise at the call; closing the stream early
        cancels the command."""
        return self._exec_stream(command_fields(cmd), options)

    def fork(
        self, count: int = 1, *, labels: Optional[Sequence[str]] = None, retry: Optional[bool] = None
    ) -> List["Sandbox"]:
        """Copy-on-write children of this sandbox as it is now (memory, disk, processes' state)."""
        body = fields(count=count, labels=list(labels) if labels is not None else None)
        d = self._http.json("POST", f"{self._base}/fork", json_body=body, retry=retry)
        return [
            Sandbox(self._http, c["id"], {"template": self.template, **c}) for c in d["children"]
        ]

    def snapshot(
        self,
        *,
        name: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        retry: Optional[bool] = None,
    ) -> Dict[str, Any]:
        """Keeps this sandbox's memory and disk as a snapshot (it runs on after a short stall);
        ``client.sandboxes.create(snapshot=...)`` starts sandboxes from it. The snapshot's info:
        ``id``, ``state``, ``size_bytes``, ``created_at``..."""
        body = fields(name=name, labels=dict(labels) if labels is not None else None)
        return self._http.json("POST", f"{self._base}/snapshots", json_body=body, retry=retry)

    def restore(self, snapshot: str, *, retry: Optional[bool] = None) -> Dict[str, Any]:
        """Rolls this sandbox back to ``snapshot`` in place: the same sandbox, its memory,
        processes and files as they were then. Open tunnels and background processes end. The
        answer: ``id``, ``state``, ``snapshot``, ``restore_ms``, ``down_ms``."""
        body = {"snapshot": snapshot}
        return self._http.json("POST", f"{self._base}/restore", json_body=body, retry=retry)

    def suspend(self, *, retry: Optional[bool] = None) -> Dict[str, Any]:
        """Snapshots the sandbox to disk (metering stops); ``resume()`` brings it back."""
        return self._http.json("POST", f"{self._base}/suspend", retry=retry)

    def resume(self, *, retry: Optional[bool] = None) -> Dict[str, Any]:
        return self._http.json("POST", f"{self._base}/resume", retry=retry)

    def metrics(self) -> Dict[str, Any]:
        """``GET /v1/sandboxes/{id}/metrics``: CPU %, memory and disk over the last two minutes,
        sampled by the host every 2 s (``current`` the newest of ``samples``); asking neither
        resumes the sandbox nor counts as use. Fields: docs/metrics.md."""
        return self._http.json("GET", f"{self._base}/metrics")

    def set_timeout(
        self, timeout_seconds: int, *, on_timeout: Optional[str] = None, retry: Optional[bool] = None
    ) -> Dict[str, Any]:
        """A new absolute lifetime counted from this call: ``{id, timeout_seconds, on_timeout,
        expires_at}``; ``on_timeout`` (``"delete"`` or ``"suspend"``) absent keeps its own."""
        body = fields(timeout_seconds=timeout_seconds, on_timeout=on_timeout)
        return self._http.json("POST", f"{self._base}/timeout", json_body=body, retry=retry)

    def set_egress(self, allow: List[str], *, retry: Optional[bool] = None) -> Dict[str, Any]:
        """Replaces the egress allow-list: ``{id, egress: {allow}}``. New connections follow it at
        once, open ones it no longer allows are closed; a suspended sandbox resumes under it."""
        # Setting the same list twice leaves what once did: safe to retry like a read.
        body = {"allow": list(allow)}
        return self._http.json("PUT", f"{self._base}/egress", json_body=body, idempotent=True, retry=retry)

    def connect_url(self, port: int, *, ttl_seconds: int = 600, protocol: Optional[str] = None) -> ConnectUrl:
        """A WebSocket URL to ``port`` inside the sandbox that needs no key (Pro), valid for
        ``ttl_seconds`` (the service clamps it to an hour); ``protocol`` ``"tcp"`` or ``"cdp"``."""
        body = fields(port=port, ttl_seconds=ttl_seconds, protocol=protocol)
        # Minting twice only makes two tokens: safe to retry like a read.
        d = self._http.json("POST", f"{self._base}/connect-url", json_body=body, idempotent=True)
        return ConnectUrl(d["url"], d["expires_at"])

    def delete(self) -> None:
        self._http.request("DELETE", self._base).read()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.delete()
        except NotFoundError:
            pass  # deleted already (by the block itself, or by its idle lifetime)


class Sandboxes:
    """``client.sandboxes``: create, look up and list the tenant's sandboxes."""

    def __init__(self, http: Http) -> None:
        self._http = http

    def create(
        self,
        template: Optional[str] = None,
        *,
        snapshot: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        label: Optional[str] = None,
        egress: Union[Sequence[str], Mapping[str, Any], None] = None,
        idle_timeout_seconds: Optional[int] = None,
        idle_action: Optional[str] = None,
        timeout_seconds: Optional[int] = None,
        on_timeout: Optional[str] = None,
        vcpus: Optional[int] = None,
        memory_mib: Optional[int] = None,
        retry: Optional[bool] = None,
    ) -> Sandbox:
        """A new running sandbox from ``template``, or from ``snapshot`` (one of them: its
        processes, memory and files as they were when it was taken). ``egress`` lists the host names it may reach
        (or is the service's ``{"allow": [...]}`` object); ``idle_timeout_seconds`` with
        ``idle_action`` (``"suspend"`` or ``"delete"``) sets its idle lifetime; ``timeout_seconds``
        with ``on_timeout`` (``"delete"``, the default, or ``"suspend"``) its absolute lifetime.
        ``vcpus`` and/or ``memory_mib`` pick one of the template's size classes (its ``sizes``);
        another size raises BadRequestError ``size_unavailable`` whose ``details["sizes"]`` lists
        the sizes there are (with ``snapshot``, only the snapshot's own size is allowed)."""
        body = fields(
            template=template,
            snapshot=snapshot,
            labels=dict(labels) if labels is not None else None,
            label=label,
            egress=(dict(egress) if isinstance(egress, Mapping) else {"allow": list(egress)})
            if egress is not None
            else None,
            idle_timeout_seconds=idle_timeout_seconds,
            idle_action=idle_action,
            timeout_seconds=timeout_seconds,
            on_timeout=on_timeout,
            vcpus=vcpus,
            memory_mib=memory_mib,
        )
        d = self._http.json("POST", "/v1/sandboxes", json_body=body, retry=retry)
        return Sandbox(self._http, d["id"], d)

    def get(self, id: str) -> Sandbox:
        """The sandbox ``id`` with its info (NotFoundError when it is not the tenant's)."""
        sbx = Sandbox(self._http, id)
        sbx.info()
        return sbx

    def list(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        template: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> List[SandboxSummary]:
        """The tenant's live sandboxes matching the filters (all AND-ed), oldest first: every
        page, followed to the last. ``pages`` reads them a page at a time."""
        pages = self.pages(labels=labels, state=state, template=template, limit=limit)
        return [row for page in pages for row in page.items]

    def page(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        template: Optional[str] = None,
        limit: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> Page[SandboxSummary]:
        """One page of the list: after ``cursor`` (a previous page's ``next_cursor``, sent with
        the same filters). ``labels``: pairs every sandbox must hold (at most 16; a key must not
        hold ``:``); ``limit``: 1 to 200 (the service's default: 50)."""
        query = {
            "label": label_query(labels),
            "state": state,
            "template": template,
            "limit": limit,
            "cursor": cursor,
        }
        d = self._http.json("GET", "/v1/sandboxes", query=query)
        items = [SandboxSummary(s["id"], s["template"], s["state"]) for s in d["sandboxes"]]
        # A service older than paged lists answers every row and no ``next_cursor``: one page.
        return Page(items, d.get("next_cursor"))

    def pages(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        template: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> Iterator[Page[SandboxSummary]]:
        """Every page of the list in order, each fetched when the loop asks for it."""
        return follow_pages(
            lambda cursor: self.page(labels=labels, state=state, template=template, limit=limit, cursor=cursor)
        )


class Snapshots:
    """``client.snapshots``: the tenant's kept snapshots (``Sandbox.snapshot()`` takes one)."""

    def __init__(self, http: Http) -> None:
        self._http = http

    def list(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        source_sandbox: Optional[str] = None,
        template: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> List[Dict[str, Any]]:
        """The tenant's snapshots matching the filters (all AND-ed), newest first: every page,
        followed to the last (``limit`` is the page size, 1 to 200; the service's default 50)."""
        pages = self.pages(
            labels=labels, state=state, source_sandbox=source_sandbox, template=template, limit=limit
        )
        return [row for page in pages for row in page.items]

    def page(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        source_sandbox: Optional[str] = None,
        template: Optional[str] = None,
        limit: Optional[int] = None,
        cursor: Optional[str] = None,
    ) -> Page[Dict[str, Any]]:
        """One page of the list: after ``cursor`` (a previous page's ``next_cursor``, sent with
        the same filters)."""
        query = {
            "label": label_query(labels),
            "state": state,
            "source_sandbox": source_sandbox,
            "template": template,
            "limit": limit,
            "cursor": cursor,
        }
        d = self._http.json("GET", "/v1/snapshots", query=query)
        # A service older than paged snapshot lists answers one capped list and no ``next_cursor``.
        return Page(list(d["snapshots"]), d.get("next_cursor"))

    def pages(
        self,
        *,
        labels: Optional[Mapping[str, str]] = None,
        state: Optional[str] = None,
        source_sandbox: Optional[str] = None,
        template: Optional[str] = None,
        limit: Optional[int] = None,
    ) -> Iterator[Page[Dict[str, Any]]]:
        """Every page of the list in order, each fetched when the loop asks for it."""
        return follow_pages(
            lambda cursor: self.page(
                labels=labels,
                state=state,
                source_sandbox=source_sandbox,
                template=template,
                limit=limit,
                cursor=cursor,
            )
        )

    def get(self, id: str) -> Dict[str, Any]:
        """The snapshot ``id`` (NotFoundError when it is not the tenant's or was deleted)."""
        return self._http.json("GET", f"/v1/snapshots/{quote_id(id)}")

    def delete(self, id: str) -> None:
        """Deletes it; sandboxes started from it run on."""
        self._http.request("DELETE", f"/v1/snapshots/{quote_id(id)}").read()
