"""The urllib opener for every request to a rollout server or the router: a redirect is refused.

urllib's default opener (`urllib.request.urlopen`) follows a 3xx with every header of the
request, an `Authorization: Bearer <API key>` included, to whatever host the answer names (a
server, or a proxy in front of it, that points elsewhere). `OPENER` raises the 3xx as an
`HTTPError` instead, and `redirect_refusal` words it in one line naming where it pointed. The
weight sync (weight_sync/servers.py), the server launcher (rollout/launcher.py) and the launch
scripts (launch/serve_node.py) all send their requests through it; the rollout client (aiohttp,
with `allow_redirects=False`) words its refusals with `refusal_line`. No torch, no Megatron.
"""

from __future__ import annotations

import urllib.error
import urllib.request


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is refused, not followed: urllib then raises the 3xx as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def is_redirect(e: urllib.error.HTTPError | int) -> bool:
    """Whether `e` (an HTTPError, or an answer's status) is a 3xx."""
    return 300 <= (e if isinstance(e, int) else e.code) < 400


def redirect_refusal(path: str, e: urllib.error.HTTPError, with_key: bool = True) -> str:
    """One line for a 3xx answer to `path`: its status and where it pointed (its Location);
    `with_key`: the request carried the API key, which is why it is not followed."""
    where = e.headers.get("Location") if e.headers is not None else None
    return refusal_line(path, e.code, where, with_key)


def refusal_line(path: str, status: int, location: str | None, with_key: bool) -> str:
    """redirect_refusal's line from an answer's status and Location header (None: it gave none),
    for a client other than urllib's (the rollout client's aiohttp, rollout/answers.py)."""
    why = " (the API key would go with it)" if with_key else ""
    where = (location or "?")[:200]
    return f"{path} answered HTTP {status}, a redirect to {where}, which is not followed{why}"
