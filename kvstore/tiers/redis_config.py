"""The Redis tier's settings (--redis and the --redis-* flags): a validated dataclass,
so that a bad URL or value is refused, naming its flag, before anything connects."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from kvstore.errors import InvalidArgument

from . import resp

MAX_READ_CONNECTIONS = 64        # RedisConfig.read_connections (0: by the server, Node.server_lanes)
# What a rediss:// URL may add (redis-py and resp.tls_context pass them to the TLS connection).
TLS_OPTIONS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """url: redis://[user:password@]host:port/db (rediss:// for TLS, which may
    add TLS_OPTIONS); ttl_s: expiry of each block (0: none, maxmemory-policy
    alone evicts); timeout_s: connect and socket timeout; backoff_s: the
    longest a failed Redis is skipped; queue_bytes: puts waiting for the
    writer before new ones are dropped; read_connections: connections a
    lookup reads over from one Redis (0: as many as its server serves
    fastest, redis_nodes.Node.server_lanes)."""
    url: str
    ttl_s: int = 0
    timeout_s: float = 0.25
    backoff_s: float = 10.0
    queue_bytes: int = 64 << 20
    read_connections: int = 0

    def __post_init__(self) -> None:
        try:
            u = urlsplit(self.url)
            u.port                      # raises on a port that is not a number in range
        except ValueError as e:
            raise InvalidArgument("redis", f"{self.redacted()}: {e}") from None
        db = u.path.strip("/")
        if u.scheme not in ("redis", "rediss"):
            raise InvalidArgument("redis", f"{self.redacted()}: scheme must be redis:// or rediss:// (TLS)")
        if not u.hostname:
            raise InvalidArgument("redis", f"{self.redacted()}: no host (redis://[user:password@]host:port/db)")
        if db and not db.isdigit():
            raise InvalidArgument("redis", f"{self.redacted()}: the path must be a database number, got {db!r}")
        opts = parse_qs(u.query, keep_blank_values=True)
        bad = sorted(set(opts) - set(TLS_OPTIONS)) if u.scheme == "rediss" else sorted(opts)
        if bad or u.fragment:
            raise InvalidArgument("redis", f"{self.redacted()}: unexpected {bad or u.fragment!r}: only a rediss:// "
                                  f"(TLS) URL takes options, {', '.join(TLS_OPTIONS)}; timeouts and TTL are flags")
        if opts.get("ssl_cert_reqs", [""])[-1] not in ("", "none", "optional", "required"):
            raise InvalidArgument("redis", f"{self.redacted()}: ssl_cert_reqs must be none, optional or required")
        if self.ttl_s < 0:
            raise InvalidArgument("redis-ttl", f"must be >= 0, got {self.ttl_s}")
        if not 0 < self.timeout_s <= 60:
            raise InvalidArgument("redis-timeout", f"must be in (0, 60] seconds, got {self.timeout_s}")
        if not 0 < self.backoff_s <= 3600:
            raise InvalidArgument("redis-backoff", f"must be in (0, 3600] seconds, got {self.backoff_s}")
        if self.queue_bytes <= 0:
            raise InvalidArgument("queue_bytes", f"must be > 0, got {self.queue_bytes}")
        if not 0 <= self.read_connections <= MAX_READ_CONNECTIONS:
            raise InvalidArgument("redis-read-connections", f"must be 0 (by the server) or in "
                                  f"[1, {MAX_READ_CONNECTIONS}], got {self.read_connections}")

    def redacted(self) -> str:
        """The URL without its password (for logs and errors)."""
        try:
            u = urlsplit(self.url)
            if u.password is None:
                return self.url
            return u._replace(netloc=u.netloc.replace(":" + u.password + "@", ":***@", 1)).geturl()
        except ValueError:
            return "<unparsable URL>"


class CredentialsRefused(Exception):
    """Redis answered, and refused the user (or password) the URL gives."""

    @staticmethod
    def of(cfg: RedisConfig, why: str) -> "CredentialsRefused":
        """Worded for a URL that gives credentials, or for one that gives none."""
        try:
            u = urlsplit(cfg.url)
            given = u.username is not None or u.password is not None
        except ValueError:
            given = True
        return CredentialsRefused(f"{cfg.redacted()} refused the URL's credentials ({why})" if given else
                                  f"{cfg.redacted()} wants credentials the URL does not give ({why}): "
                                  "redis://[user]:password@host:port/db")


def refuses_credentials(e: BaseException | None) -> bool:
    """Whether a failure is Redis refusing who we are: no password where it wants one,
    a wrong one, one where it wants none (a plain ERR), or an ACL user without the
    commands the tier runs (through redis-py, whose error classes strip the reply's code,
    or resp.py, whose messages keep it)."""
    import redis.exceptions as rx
    refused = (rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError, rx.NoPermissionError)
    while e is not None:
        if isinstance(e, refused) or (isinstance(e, resp.ReplyError) and any(code in str(e) for code in (
                "NOAUTH", "WRONGPASS", "NOPERM", "without any password configured", "no password is set"))):
            return True
        e = e.__cause__
    return False
