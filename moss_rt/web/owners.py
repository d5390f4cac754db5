"""Who a request is, for what it owns (directing sessions): an API key's principal, or a signed owner cookie.

Under an API key every credential names a principal (:func:`moss_rt.web.security.key_principal`): the key, or a
browser token bought with it. That principal owns the sessions its requests create. A keyless server has no
credentials to go by, so a browser (or any client that keeps cookies) is given an owner cookie the first time it
needs one (the studio page, a new session, an import, the WebSocket upgrade)::

    Set-Cookie: moss_rt_owner=<random id>.<HMAC-SHA256>; HttpOnly; SameSite=Lax; Path=/; Max-Age=34560000

The cookie is signed with a secret kept in the data dir (``owner_secret``, created on first start, mode 0600), so
it survives restarts and cannot be forged; deleting the file disowns every cookie. Front ends sharing a
PostgreSQL session store share one secret, kept in the store (:meth:`OwnerCookies.for_store`). ``HttpOnly``
keeps page scripts from reading it, ``SameSite=Lax`` keeps other sites' pages from sending it with their
requests (a top-level navigation to the studio still carries it, so a link does not mint a new owner).
Same-origin ``fetch`` and WebSocket upgrades send it by themselves, so the studio needs nothing to use it.

Owners are opaque strings to the session store: ``key:<principal>`` or ``cookie:<id>``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import secrets
import time
from pathlib import Path

from aiohttp import web

from moss_rt.session_store import SessionStore
from moss_rt.web.security import key_principal
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)

OWNER_COOKIE = "moss_rt_owner"
SECRET_FILE = "owner_secret"
SECRET_NAME = "owner_cookies"  # its name in a shared store (store_secrets)
COOKIE_MAX_AGE = 400 * 24 * 3600  # the longest lifetime browsers keep (400 days); renewed on every mint check


class OwnerCookies:
    """Mints and checks owner cookies with one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    @classmethod
    def load(cls, data_dir: Path) -> OwnerCookies:
        """The secret in ``data_dir/owner_secret``, created (random, mode 0600) when missing."""
        path = Path(data_dir) / SECRET_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            text = path.read_text().strip()
            for _ in range(40):  # another process sharing the data dir made it a moment ago and is writing it
                if text or time.time() - path.stat().st_mtime > 5.0:
                    break
                time.sleep(0.05)
                text = path.read_text().strip()
            secret = bytes.fromhex(text)
            if len(secret) < 16:
                raise ValueError(f"{path} holds no usable secret; delete it to make a new one") from None
            return cls(secret)
        secret = secrets.token_bytes(32)
        with os.fdopen(fd, "w") as f:
            f.write(secret.hex())
            f.flush()
            os.fsync(f.fileno())
        log.info("owner cookies: a new secret in %s", path)
        return cls(secret)

    @classmethod
    def for_store(cls, store: SessionStore, data_dir: Path) -> OwnerCookies:
        """The secret of the front ends sharing ``store``: a store on several hosts (PostgreSQL) keeps one for all
        of them (a cookie minted by one front end is valid on every other), proposed by the first front end that
        starts: its data dir's secret when it has one (owners of an earlier single front end stay owners), else
        a new one. A store of one host keeps the secret in the data dir, as :meth:`load` does."""
        if not store.shared:
            return cls.load(data_dir)
        path = Path(data_dir) / SECRET_FILE
        try:
            proposal = bytes.fromhex(path.read_text().strip())
        except (OSError, ValueError):
            proposal = b""
        if len(proposal) < 16:
            proposal = secrets.token_bytes(32)
        return cls(store.shared_secret(SECRET_NAME, proposal))

    def _sign(self, owner_id: str) -> str:
        digest = hmac.new(self._secret, owner_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def mint(self) -> tuple[str, str]:
        """A new owner: (its id, the cookie value carrying it)."""
        owner_id = secrets.token_urlsafe(18)
        return owner_id, f"{owner_id}.{self._sign(owner_id)}"

    def verify(self, value: str | None) -> str | None:
        """The owner id a cookie value carries, or None when it is missing, malformed or not signed by us."""
        if not value or len(value) > 200:
            return None
        owner_id, _, signature = value.partition(".")
        if not owner_id or not signature:
            return None
        expected = self._sign(owner_id)
        if not hmac.compare_digest(signature.encode("utf-8", "surrogatepass"), expected.encode()):
            return None
        return owner_id


def request_owner(request: web.Request) -> str | None:
    """The identity the request acts as, or None when it has none (no valid credential or cookie)."""
    state = request.app[STATE]
    principal = key_principal(state.settings, request)
    if principal is not None:
        return f"key:{principal}"
    if state.settings.api_key or state.owner_cookies is None:
        return None
    owner_id = state.owner_cookies.verify(request.cookies.get(OWNER_COOKIE))
    return None if owner_id is None else f"cookie:{owner_id}"


def voice_owner(request: web.Request) -> str:
    """The owner a request's voice uploads get and its voice edits must match: the client's address (as resolved
    through ``trusted_proxies``), not the session owner above (docs/security.md, "Voice owners")."""
    return request.remote or "unknown"


def owner_or_mint(request: web.Request) -> tuple[str | None, str | None]:
    """(owner, cookie value to set): the request's identity, or on a keyless server a new one minted for it."""
    owner = request_owner(request)
    state = request.app[STATE]
    if owner is not None or state.settings.api_key or state.owner_cookies is None:
        return owner, None
    owner_id, cookie = state.owner_cookies.mint()
    return f"cookie:{owner_id}", cookie


def set_owner_cookie(response: web.StreamResponse, request: web.Request, cookie: str | None) -> None:
    """Put a newly minted owner cookie on ``response`` (before it is prepared); nothing when ``cookie`` is None."""
    if cookie is None:
        return
    forwarded = request.headers.get("X-Forwarded-Proto", "").strip().lower()
    response.set_cookie(
        OWNER_COOKIE,
        cookie,
        max_age=COOKIE_MAX_AGE,
        path="/",
        httponly=True,
        samesite="Lax",
        secure=request.secure or forwarded == "https",
    )
