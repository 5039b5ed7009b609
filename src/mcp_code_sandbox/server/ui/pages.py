"""``/ui``: the operator's view of sessions, recent runs, the warm pool and paused state,
with a button to close a session (DESIGN §9).

Who sees what: a viewer is the owner the request authenticates as, exactly as ``/mcp``
decides (:mod:`..auth`): by ``Authorization: Bearer`` (scripts, curl) or by the login
cookie the sign-in form gives a browser (:mod:`.cookies`). An owner sees and closes only
its own sessions and runs; a token marked ``admin`` (``name:token:admin``) sees and closes
every owner's. Without authentication configured (loopback) the one owner is ``local``,
who gets a login cookie on the first visit without a form (the CSRF tokens need it).

Every answer goes through the Host/Origin checks of ``/mcp`` (a rebinding page must not
read or post), carries :data:`.views.SECURITY_HEADERS`, and a changing request (``POST``)
from a cookie login must carry that login's CSRF token; the sign-in form's post, that of
its pre-login cookie. Refusals say little: a session another owner holds is "not found",
as in the tools.

Routes: ``GET /ui`` (the overview; without a login, a redirect to the form), ``GET|POST
/ui/login``, ``POST /ui/logout``, ``POST /ui/close`` (``owner``, ``session_id``), and
``GET /ui/static/ui.css``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from mcp.server.transport_security import TransportSecurityMiddleware, TransportSecuritySettings
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route

from mcp_code_sandbox import __version__
from mcp_code_sandbox.errors import SandboxError
from mcp_code_sandbox.server.auth import (
    LOCAL_OWNER,
    ServerAuth,
    StaticTokens,
    is_admin,
    owner_of_request,
    owner_of_token,
)
from mcp_code_sandbox.server.ui.cookies import (
    COOKIE_NAME,
    PRE_COOKIE_NAME,
    CookieSigner,
    LiveLogins,
    Login,
)
from mcp_code_sandbox.server.ui.views import SECURITY_HEADERS, STATIC_DIR, ended_note, render
from mcp_code_sandbox.service import SandboxService

__all__ = ["ui_routes"]

log = structlog.get_logger("mcp_code_sandbox.ui")

#: A form body larger than this is refused unread (a token is under 4 KiB).
MAX_FORM_BYTES = 8 * 1024
#: What ``?notice=`` may name: fixed words, so the page never repeats a client's text.
NOTICES = {
    "closed": "The session was closed: its sandbox is stopped and its files are gone.",
    "not_found": "No such session (already closed, or not yours).",
    "incomplete": "The session was closed, but part of it could not be freed yet; the "
    "server keeps trying.",
}


@dataclass(frozen=True)
class Viewer:
    owner: str
    admin: bool
    #: The browser login the request came with; ``None`` for a bearer request (which
    #: needs no CSRF token: no browser adds that header by itself).
    login: Login | None


class _Refused(Exception):
    def __init__(self, response: Response) -> None:
        self.response = response


def ui_routes(
    service: SandboxService,
    auth: ServerAuth | None,
    security: TransportSecuritySettings,
    secret: bytes,
) -> list[Route]:
    """The ``/ui`` routes; ``secret``: the server's URL secret (the cookies' key is
    derived from it)."""
    return _Ui(service, auth, security, CookieSigner(secret)).routes()


class _Ui:
    def __init__(
        self,
        service: SandboxService,
        auth: ServerAuth | None,
        security: TransportSecuritySettings,
        signer: CookieSigner,
    ) -> None:
        self.service = service
        self.auth = auth
        self.host_check = TransportSecurityMiddleware(security)
        self.signer = signer
        #: The logins given out and not ended (a cookie is good only while its login is here).
        self.logins = LiveLogins(signer.clock)
        base = service.settings.public_base_url or ""
        #: The path the server is published under (a proxy strips it before us).
        self.prefix = urlsplit(base).path.rstrip("/")
        self.tls = base.startswith("https://")

    def routes(self) -> list[Route]:
        guarded = self._guarded
        return [
            Route("/ui", guarded(self.index), methods=["GET"]),
            Route("/ui/", guarded(self.to_index), methods=["GET"]),
            Route("/ui/login", guarded(self.login_form), methods=["GET"]),
            Route("/ui/login", guarded(self.login), methods=["POST"]),
            Route("/ui/logout", guarded(self.logout), methods=["POST"]),
            Route("/ui/close", guarded(self.close), methods=["POST"]),
            Route("/ui/static/ui.css", guarded(self.css), methods=["GET"]),
        ]

    def _guarded(
        self, handler: Callable[[Request], Awaitable[Response]]
    ) -> Callable[[Request], Awaitable[Response]]:
        """Host/Origin checks first, then the handler; a refusal it raises is answered."""

        async def guarded(request: Request) -> Response:
            refused = await self.host_check.validate_request(request)
            if refused is not None:
                return refused
            try:
                return await handler(request)
            except _Refused as exc:
                return exc.response

        return guarded

    # -- who is asking --------------------------------------------------------------------

    async def viewer(self, request: Request) -> Viewer | None:
        """The authenticated viewer, or ``None``. A request with an ``Authorization``
        header is decided by it alone (a wrong token is refused, whatever cookie)."""
        if "authorization" in request.headers:
            owner = await owner_of_request(self.auth, request)
            if owner is None:
                raise _Refused(
                    PlainTextResponse(
                        "unauthorized: the bearer token is not valid here",
                        status_code=401,
                        headers={**SECURITY_HEADERS, "WWW-Authenticate": "Bearer"},
                    )
                )
            return Viewer(owner, is_admin(self.auth, owner), None)
        login = self.signer.decode(request.cookies.get(COOKIE_NAME))
        if login is None or not self.logins.holds(login) or not self._still_valid(login):
            return None
        return Viewer(login.owner, is_admin(self.auth, login.owner), login)

    def _still_valid(self, login: Login) -> bool:
        """Whether the token a login was made with still stands as configured now."""
        if self.auth is None:
            return login.owner == LOCAL_OWNER
        verifier = self.auth.verifier
        if isinstance(verifier, StaticTokens):
            expected = self.signer.fingerprint(verifier.digest_of(login.owner))
            return bool(login.fingerprint) and hmac.compare_digest(expected, login.fingerprint)
        return not login.fingerprint  # OAuth: bounded by the access token's expiry

    def _set_login(self, response: Response, login: Login | None) -> Response:
        """Give the browser ``login``'s cookie (the server holds the login from now), or
        (``None``) tell it to drop its cookie."""
        path = f"{self.prefix}/ui"
        if login is None:
            response.delete_cookie(COOKIE_NAME, path=path, secure=self.tls, httponly=True)
            return response
        self.logins.add(login)
        response.set_cookie(
            COOKIE_NAME,
            self.signer.encode(login),
            max_age=max(0, login.expires - int(self.signer.clock())),
            path=path,
            secure=self.tls,
            httponly=True,
            samesite="strict",
        )
        return response

    def _set_pre_login(self, response: Response, pre: Login | None) -> Response:
        """The sign-in form's pre-login cookie (``None``: drop it), sent to the form only."""
        path = f"{self.prefix}/ui/login"
        if pre is None:
            response.delete_cookie(PRE_COOKIE_NAME, path=path, secure=self.tls, httponly=True)
            return response
        response.set_cookie(
            PRE_COOKIE_NAME,
            self.signer.encode_pre(pre),
            max_age=max(0, pre.expires - int(self.signer.clock())),
            path=path,
            secure=self.tls,
            httponly=True,
            samesite="strict",
        )
        return response

    def _redirect(self, to: str) -> RedirectResponse:
        return RedirectResponse(f"{self.prefix}{to}", status_code=303, headers=SECURITY_HEADERS)

    def _context(self, viewer: Viewer | None, **more: Any) -> dict[str, Any]:
        csrf = self.signer.csrf(viewer.login) if viewer and viewer.login else ""
        return {
            "prefix": self.prefix,
            "viewer": viewer,
            "csrf": csrf,
            "version": __version__,
            "backend": self.service.backend.name,
            "signs_in": self.auth is not None,
            **more,
        }

    async def _form(self, request: Request) -> dict[str, str]:
        """The urlencoded body, bounded; one value per name (the first)."""
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise _Refused(
                    PlainTextResponse("form too large", status_code=413, headers=SECURITY_HEADERS)
                )
        try:
            fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=16)
        except ValueError:  # more fields than any of our forms has
            raise _Refused(
                PlainTextResponse("malformed form", status_code=400, headers=SECURITY_HEADERS)
            ) from None
        return {name: values[0] for name, values in fields.items()}

    def _check_csrf(self, viewer: Viewer, form: dict[str, str]) -> None:
        if viewer.login is None:
            return  # bearer: no browser sends that by itself
        if not self.signer.csrf_ok(viewer.login, form.get("csrf", "")):
            raise _Refused(_stale_form())

    async def _required(self, request: Request) -> Viewer:
        viewer = await self.viewer(request)
        if viewer is None:
            raise _Refused(
                PlainTextResponse(
                    "unauthorized: sign in at /ui/login first",
                    status_code=401,
                    headers=SECURITY_HEADERS,
                )
            )
        return viewer

    # -- pages ----------------------------------------------------------------------------

    async def to_index(self, request: Request) -> Response:
        return self._redirect("/ui")

    async def index(self, request: Request) -> Response:
        viewer = await self.viewer(request)
        fresh: Login | None = None
        if viewer is None:
            if self.auth is not None:
                return self._redirect("/ui/login")
            fresh = self.signer.login(LOCAL_OWNER, None, None)
            viewer = Viewer(LOCAL_OWNER, True, fresh)
        scope = None if viewer.admin else viewer.owner
        sessions = await self.service.session_overview(scope)
        listed = self.service.recent_runs.listed(scope, limit=50)
        live = {(s.owner, s.session_id): s.created_at for s in sessions}
        ended = self.service.ended_sessions()
        runs = [(run, ended_note(run, live, ended)) for run in listed]
        notice = NOTICES.get(request.query_params.get("notice", ""))
        context = self._context(
            viewer,
            sessions=sessions,
            replicas=bool(self.service.replica),
            replica=self.service.replica,
            runs=runs,
            pool=self.service.pool_status(),
            paused=self.service.paused_status(scope),
            notice=notice,
        )
        response = render("index.html", context)
        return self._set_login(response, fresh) if fresh else response

    async def login_form(self, request: Request) -> Response:
        if self.auth is None or await self.viewer(request) is not None:
            return self._redirect("/ui")
        pre = self.signer.decode_pre(request.cookies.get(PRE_COOKIE_NAME))
        fresh = pre is None
        pre = pre or self.signer.pre_login()
        page = render("login.html", self._sign_in_context(pre, problem=None))
        return self._set_pre_login(page, pre) if fresh else page

    def _sign_in_context(self, pre: Login, problem: str | None) -> dict[str, Any]:
        return {**self._context(None, problem=problem), "csrf": self.signer.csrf(pre)}

    async def login(self, request: Request) -> Response:
        """The sign-in form posted: its CSRF token first (made from the pre-login cookie
        its page set: a form posted from another page signs nobody in), then the token."""
        if self.auth is None:
            return self._redirect("/ui")
        form = await self._form(request)
        pre = self.signer.decode_pre(request.cookies.get(PRE_COOKIE_NAME))
        if pre is None or not self.signer.csrf_ok(pre, form.get("csrf", "")):
            raise _Refused(_stale_form())
        token = form.get("token", "").strip()
        access = await self.auth.verifier.verify_token(token) if token else None
        required = self.auth.settings.required_scopes or []
        if access is None or any(scope not in access.scopes for scope in required):
            problem = "That token is not valid here."
            return render("login.html", self._sign_in_context(pre, problem), status=401)
        owner = owner_of_token(access)
        verifier = self.auth.verifier
        digest = verifier.digest_of(owner) if isinstance(verifier, StaticTokens) else None
        login = self.signer.login(owner, digest, access.expires_at)
        signed_in = self._set_login(self._redirect("/ui"), login)
        return self._set_pre_login(signed_in, None)

    async def logout(self, request: Request) -> Response:
        """End the login on the server (its cookie, wherever a copy is, is no login from
        now) and drop the browser's cookie."""
        viewer = await self._required(request)
        self._check_csrf(viewer, await self._form(request))
        if viewer.login is not None:
            self.logins.end(viewer.login)
        return self._set_login(self._redirect("/ui/login"), None)

    async def close(self, request: Request) -> Response:
        """Close the session ``owner``/``session_id`` names: the viewer's own, or any for
        an admin; another owner's is "not found" to a non-admin."""
        viewer = await self._required(request)
        form = await self._form(request)
        self._check_csrf(viewer, form)
        owner = form.get("owner", "")
        session_id = form.get("session_id", "")
        if owner != viewer.owner and not viewer.admin:
            return self._redirect("/ui?notice=not_found")
        log.info("close requested from /ui", by=viewer.owner, owner=owner, session=session_id)
        try:
            await self.service.close_session(owner, session_id)
        except SandboxError as exc:
            word = "incomplete" if exc.code == "sandbox_failed" else "not_found"
            return self._redirect(f"/ui?notice={word}")
        return self._redirect("/ui?notice=closed")

    async def css(self, request: Request) -> Response:
        return FileResponse(STATIC_DIR / "ui.css", media_type="text/css", headers=SECURITY_HEADERS)


def _stale_form() -> Response:
    return PlainTextResponse(
        "forbidden: this form is stale or did not come from this page; reload the page and "
        "try again",
        status_code=403,
        headers=SECURITY_HEADERS,
    )
