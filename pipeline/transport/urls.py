"""Redis urls without redis-py: the Sentinel form's parser and ``redact``, so config validation can check a
url without importing the client library (the memory default never imports it).

    redis+sentinel://[user:password@]host1:26379,host2:26379/<master name>[/<db>][?ssl_ca_certs=...]
    rediss+sentinel://...   the same over TLS (data nodes and sentinels alike)
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit, urlunsplit

SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
SENTINEL_FORM = "redis+sentinel://[user:password@]host1:26379,host2:26379/<master name>/<db>"
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    master: str  # the name the sentinels monitor (``sentinel monitor <name> ...``)
    db: int
    data_url: str  # redis[s]://[user:password@]<first sentinel>/<db>?<query>: credentials and TLS options


def is_sentinel_url(url: str) -> bool:
    return url.partition("://")[0] in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelUrl:
    """ValueError naming what is wrong and the expected form."""
    scheme, _, rest = url.partition("://")
    if scheme not in SENTINEL_SCHEMES:
        raise ValueError(f"scheme {scheme!r} is not redis+sentinel or rediss+sentinel")
    location, _, query = rest.partition("?")
    netloc, _, path = location.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    sentinels = []
    for address in hosts.split(","):
        host, port = _host_port(address)
        sentinels.append((host, port))
    names = [unquote(part) for part in path.split("/") if part]
    if not names:
        raise ValueError("no master name after the sentinel addresses")
    if len(names) > 2 or (len(names) == 2 and not names[1].isdigit()):
        raise ValueError(f"the path {'/' + path!r} must be /<master name> or /<master name>/<db number>")
    db = int(names[1]) if len(names) == 2 else 0
    first = f"[{sentinels[0][0]}]" if ":" in sentinels[0][0] else sentinels[0][0]
    credentials = f"{userinfo}@" if userinfo else ""
    data_url = f"{SENTINEL_SCHEMES[scheme]}://{credentials}{first}:{sentinels[0][1]}/{db}"
    return SentinelUrl(sentinels, names[0], db, data_url + (f"?{query}" if query else ""))


def _host_port(address: str) -> tuple[str, int]:
    if not address:
        raise ValueError("an empty sentinel address")
    if address.startswith("["):  # [::1]:26379
        host, _, port = address[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "")
    if not host:
        raise ValueError(f"sentinel address {address!r} has no host")
    if port and not port.isdigit():
        raise ValueError(f"sentinel address {address!r} has a port that is no number")
    return host, int(port) if port else SENTINEL_PORT


def redact(url: str) -> str:
    """The url without its password, for messages (every scheme, the Sentinel form with its host list too)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[2]}"))
