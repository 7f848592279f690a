"""Who may ask the built-in server: checked on every request before its handler runs.

- `Host` must name this server: the address it listens on (for a wildcard bind, any address of
  this machine or its host name) or a loopback name (localhost, 127.0.0.0/8, ::1), any port.
  A web page whose DNS name was rebound to 127.0.0.1 sends its own name (`Host:
  evil.example:PORT`) and gets 403, whatever Origin it sends with it. A request without a Host
  (HTTP/1.0; no browser sends one) is let through to the checks below.
- One `Host` and at most one `Authorization` header: more is a 400, never a guess at which one
  counts.
- With an API key, `Authorization: Bearer KEY` on every endpoint but GET /health (401).
- A POST from a web page is refused: a browser sends an Origin header, and cross-site it can
  only send text/plain or form bodies without a preflight. Every client of this API sends JSON,
  or no body (with no Content-Type, or the application/octet-stream that aiohttp and others name
  for an empty POST), and no foreign Origin; so a POST with a body that is not JSON is a 415, and
  so is one that names a cross-site type (text/plain, a form) even with no body: an empty
  text/plain POST must not pause generation.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from urllib.parse import urlsplit

from aiohttp import web

from megatron_gspo.server.validate import is_local_address, is_loopback

WILDCARDS = ("", "0.0.0.0", "::")
# The Content-Types a web page may POST cross-site without a preflight (the CORS-safelisted ones).
CROSS_SITE_TYPES = frozenset(
    {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)


class Hosts:
    """The Host names that name this server (see the module doc)."""

    def __init__(self, bind_host: str):
        self.bind = _norm(bind_host)
        self.wildcard = self.bind in WILDCARDS
        self.names = {self.bind} | _addresses(self.bind)
        if self.wildcard:
            self.names |= {_norm(socket.gethostname()), _norm(socket.getfqdn())}

    def allows(self, host_header: str) -> bool:
        name = _norm(_without_port(host_header))
        if not name or name in WILDCARDS:
            return False
        if name in self.names or name == "localhost" or name.endswith(".localhost"):
            return True
        if not _is_ip(name):
            return False
        return is_loopback(name) or (self.wildcard and is_local_address(name))


def _norm(host: str) -> str:
    return host.strip().lower().removesuffix(".")


def _without_port(host: str) -> str:
    """The name of `name[:port]` or `[v6][:port]`; "" (no name) where what follows it is not a
    port (`127.0.0.1:80@evil.example` names nothing)."""
    host = host.strip()
    if host.startswith("["):  # [v6]:port
        name, _, rest = host[1:].partition("]")
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
        rest = ":" + port
    else:
        return host  # a name, or an unbracketed v6 address
    port = rest.removeprefix(":")
    if rest and not (rest.startswith(":") and port.isascii() and port.isdigit()):
        return ""
    return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _addresses(host: str) -> set[str]:
    """The addresses a bind name resolves to (a client may use them in Host)."""
    if host in WILDCARDS or _is_ip(host):
        return set()
    try:
        return {_norm(str(info[4][0])) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return set()


def refused(request: web.Request, hosts: Hosts, api_key: str | None) -> tuple[int, str] | None:
    """(HTTP status, why) when `request` may not be served; None when it may."""
    host = request.headers.getall("Host", [])
    if len(host) > 1:
        return 400, "a request must carry one Host header"
    if host and not hosts.allows(host[0]):
        return 403, (
            f"Host {host[0][:100]!r} does not name this server; address it by the host it "
            "listens on or by a loopback name"
        )
    auth = request.headers.getall("Authorization", [])
    if len(auth) > 1:
        return 400, "a request must carry at most one Authorization header"
    if api_key and not (request.method == "GET" and request.path == "/health"):
        given = auth[0] if auth else ""
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return 401, "Unauthorized"
    return _not_from_a_client(request)


def _not_from_a_client(request: web.Request) -> tuple[int, str] | None:
    if request.method in ("GET", "HEAD"):
        return None
    origin = request.headers.get("Origin")
    if origin is not None and _netloc(origin) != request.host:
        return 403, f"cross-origin request from {origin[:100]!r} refused"
    named = "Content-Type" in request.headers
    simple = named and request.content_type in CROSS_SITE_TYPES
    if (simple or request.body_exists) and request.content_type != "application/json":
        return 415, f"Content-Type must be application/json, not {request.content_type!r}"
    return None


def _netloc(url: str) -> str | None:
    try:
        return urlsplit(url).netloc
    except ValueError:  # not a URL at all: no origin of ours
        return None
