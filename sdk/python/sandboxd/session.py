"""The sessions API sessions (live and scale keys): ``client.sessions``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence

from ._box import Box, EventStream, ExecOptions, fields, quote_id
from ._http import Http
from .errors import GoneError, NotFoundError
from .models import ExecResult, Page, SessionSummary

if TYPE_CHECKING:  # the annotations are strings at run time (PEP 563): 3.9 needs no Unpack
    from typing_extensions import Unpack


def code_fields(code: Optional[str], commands: Optional[Sequence[Sequence[str]]]) -> Dict[str, Any]:
    return fields(code=code, commands=[list(c) for c in commands] if commands is not None else None)


class Session(Box):
    """A session: a VM of a template whose ``code`` runs in the template's interpreter, kept
    between execs until deleted or idle too long (then ``GoneError``). A context manager that
    deletes it on exit."""

    def __init__(self, http: Http, session_id: str, info: Optional[Dict[str, Any]] = None) -> None:
        super().__init__(http, f"/v1/sessions/{quote_id(session_id)}")
        self.id = session_id
        self.data: Dict[str, Any] = dict(info or {"session_id": session_id})

    def __repr__(self) -> str:
        return f"Session({self.id!r})"

    @property
    def session_id(self) -> str:
        return self.id

    @property
    def template_id(self) -> Optional[str]:
        return self.data.get("template_id")

    def info(self) -> Dict[str, Any]:
        self.data = self._http.json("GET", self._base)
        return self.data

    def exec(
        self,
        code: Optional[str] = None,
        *,
        commands: Optional[Sequence[Sequence[str]]] = None,
        **options: Unpack[ExecOptions],
    ) -> ExecResult:
        """Runs ``code`` in the template's interpreter (its stdin), or ``commands`` (argv lists);
        the options are Sandbox.exec's."""
        return self._exec_json(code_fields(code, commands), options)

    def exec_stream(
        self,
        code: Optional[str] = None,
        *,
        commands: Optional[Sequence[Sequence[str]]] = None,
        **options: Unpack[ExecOptions],
    ) -> EventStream:
        """``exec`` whose output arrives as events while it runs (see Sandbox.exec_stream)."""
        return self._exec_stream(code_fields(code, commands), options)

    def fork(self, *, retry: Optional[bool] = None) -> "Session":
        """One child session, a copy-on-write copy of this one as it is now."""
        d = self._http.json("POST", f"{self._base}/fork", retry=retry)
        return Session(self._http, d["session_id"], {"template_id": self.template_id, **d})

    def delete(self, *, force: bool = False) -> None:
        """Ends the session (``force=True`` aborts an exec in flight instead of waiting for it)."""
        self._http.request("DELETE", self._base, query={"force": force} if force else None).read()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.delete(force=True)
        except (NotFoundError, GoneError):
            pass  # gone already: deleted, or reclaimed when idle


class Sessions:
    """``client.sessions`` (sessions API keys; a sandboxes API key's create is an alias of sandboxes')."""

    def __init__(self, http: Http) -> None:
        self._http = http

    def create(
        self, template_id: str, *, idle_timeout_seconds: Optional[int] = None, retry: Optional[bool] = None
    ) -> Session:
        body = fields(template_id=template_id, idle_timeout_seconds=idle_timeout_seconds)
        d = self._http.json("POST", "/v1/sessions", json_body=body, retry=retry)
        return Session(self._http, d["session_id"], d)

    def get(self, session_id: str) -> Session:
        s = Session(self._http, session_id)
        s.info()
        return s

    def list(self, *, template_id: Optional[str] = None, limit: Optional[int] = None) -> List[SessionSummary]:
        """The tenant's live sessions, oldest first: every page, followed to the last."""
        out: List[SessionSummary] = []
        for page in self.pages(template_id=template_id, limit=limit):
            out.extend(page.items)
        return out

    def page(
        self, *, template_id: Optional[str] = None, limit: Optional[int] = None, cursor: Optional[str] = None
    ) -> Page[SessionSummary]:
        """One page of the list: after ``cursor`` (a previous page's ``next_cursor``, sent with
        the same ``template_id``); ``limit``: 1 to 200 (the service's default: 50)."""
        query = {"template_id": template_id, "limit": limit, "cursor": cursor}
        d = self._http.json("GET", "/v1/sessions", query=query)
        items = [SessionSummary(s["session_id"], s["idle_secs"], s["exec_count"]) for s in d["sessions"]]
        return Page(items, d.get("next_cursor"))

    def pages(
        self, *, template_id: Optional[str] = None, limit: Optional[int] = None
    ) -> Iterator[Page[SessionSummary]]:
        """Every page of the list in order, each fetched when the loop asks for it."""
        cursor: Optional[str] = None
        while True:
            page = self.page(template_id=template_id, limit=limit, cursor=cursor)
            yield page
            if page.next_cursor is None:
                return
            cursor = page.next_cursor
