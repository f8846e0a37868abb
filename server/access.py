"""Who may call which route (CONTRACT §2): the API key, and the admin routes' switch."""
import dataclasses
import hmac
import ipaddress

from runtime.errors import ScoreError

OPEN_ROUTES = ("/health",)  # answered without a key: load balancers' probes send none
ADMIN_ROUTES = ("/flush_cache", "/start_profile", "/stop_profile")
ADMIN_SETTINGS = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    api_key: str | None = dataclasses.field(default=None, repr=False)  # never in a log line
    metrics_without_key: bool = False  # scrapers often cannot send an Authorization header
    admin_routes: bool = True

    def __post_init__(self):
        if self.api_key is not None and not (self.api_key.isascii()
                                             and self.api_key.isprintable()
                                             and " " not in self.api_key and self.api_key):
            raise ValueError("the API key must be non-empty printable ASCII without spaces")

    def check(self, path: str, authorization: str | None) -> None:
        """Raises the 401 or 403 that a request for `path` gets, if any. The key is checked
        before the path is looked at, so that a client without it learns nothing of routes."""
        if self.needs_key(path) and not self._authorized(authorization):
            raise ScoreError("a valid API key is required: send 'Authorization: Bearer KEY'",
                             status=401)
        if path in ADMIN_ROUTES and not self.admin_routes:
            raise ScoreError(f"{path} is an admin route, and admin routes are off "
                             "(--admin-routes on opens them)", status=403)

    def needs_key(self, path: str) -> bool:
        if self.api_key is None or path in OPEN_ROUTES:
            return False
        return not (path == "/metrics" and self.metrics_without_key)

    def _authorized(self, authorization: str | None) -> bool:
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # RFC 9110 11.1: the scheme is case-insensitive
            return False
        return hmac.compare_digest(token.strip().encode("latin-1"), self.api_key.encode())

    def describe(self, routes) -> str:
        """For the start-up log: which routes are open, which need the key, which are off."""
        served = [r for r in routes if r not in ADMIN_ROUTES or self.admin_routes]
        keyed = [r for r in served if self.needs_key(r)]
        open_ = [r for r in served if not self.needs_key(r)]
        parts = ([f"open: {' '.join(open_)}"] if open_ else []) + (
            [f"with the API key: {' '.join(keyed)}"] if keyed else [])
        if not self.admin_routes:
            parts.append(f"off: {' '.join(ADMIN_ROUTES)} (--admin-routes on opens them)")
        return "routes " + "; ".join(parts)


def admin_routes_open(setting: str, host: str, api_key: str | None) -> bool:
    """`--admin-routes`: on, off, or auto: open on a loopback address or with an API key."""
    if setting not in ADMIN_SETTINGS:
        raise ValueError(f"--admin-routes must be one of {ADMIN_SETTINGS}, got {setting!r}")
    if setting != "auto":
        return setting == "on"
    return api_key is not None or is_loopback(host)


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only; a name other than localhost counts
    as reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
