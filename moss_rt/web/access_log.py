"""The access log, without the secrets that ride in URLs.

Session ids, script ids, take ids and share tokens are capabilities (whoever has one may read what it names,
within the owner rules), and browser tokens are credentials; all of them appear in request paths, query strings
and ``Referer`` headers. aiohttp's default access log writes those verbatim, so anyone who can read the log could
replay them. This logger writes the same line (Apache's combined format) with each of them cut down to a short
prefix, enough to follow one client's requests and never enough to use them.
"""

from __future__ import annotations

import datetime
import re

from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

# Capabilities in paths (session, script, take, share ids) and credential-like query parameters.
_IDS = re.compile(r"\b(s|sc|t|sh)_([A-Za-z0-9_-]{4})[A-Za-z0-9_-]{4,}")
_SECRET_PARAMS = re.compile(r"([?&](?:token|share|session|key|api_key)=)[^&#\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` (a path, a query, a URL) with ids shortened to ``s_abcd…`` and secret parameters blanked."""
    return _SECRET_PARAMS.sub(r"\1…", _IDS.sub(r"\1_\2…", text))


class RedactingAccessLogger(AbstractAccessLogger):
    """Apache combined format: ``remote [time] "METHOD path HTTP/x.y" status bytes "referer" "agent" seconds``."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        try:
            now = datetime.datetime.now(datetime.UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
            version = f"{request.version.major}.{request.version.minor}"
            line = f"{request.method} {redact(request.raw_path)} HTTP/{version}"
            referer = redact(request.headers.get("Referer", "-"))
            agent = request.headers.get("User-Agent", "-")
            self.logger.info(
                '%s [%s] "%s" %d %d "%s" "%s" %.3f',
                request.remote or "-",
                now,
                line,
                response.status,
                response.body_length,
                referer,
                agent,
                time,
            )
        except Exception:  # an access log line is never worth a failed request
            self.logger.exception("could not write an access log line")
