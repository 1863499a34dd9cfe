"""What of a client's URL an error message or a log line may repeat: never its credentials.

`redact_url` replaces the userinfo of a URL (`scheme://USER:PASSWORD@host/...`) with `***`, reading the raw
string (a malformed URL is exactly the one an error message quotes, so no parser is trusted with it): the
authority is what follows `://` up to the first `/`, `?` or `#`, and its userinfo is everything up to the last
`@` in it. Long URLs (a `data:` URL of megabytes) are cut to `limit` characters.

Invariant: for any string, the result contains no character of the userinfo it had.
"""

from __future__ import annotations


def redact_url(url: str, limit: int = 200) -> str:
    s = str(url)
    head, sep, rest = s.partition("://")
    if sep:
        end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        authority = rest[:end]
        at = authority.rfind("@")
        if at >= 0:
            s = f"{head}://***@{authority[at + 1 :]}{rest[end:]}"
    return s if len(s) <= limit else s[:limit] + "..."
