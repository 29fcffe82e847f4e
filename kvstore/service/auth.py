"""Who is calling: bearer tokens -> tenants, local (Unix socket) vs remote
peers (the tenant-scoped view of registered buffers: buffers.py).

Policy (docs/design.md, Control plane and data planes):
- TCP callers must send `authorization: Bearer <token>`; a missing or unknown
  token is UNAUTHENTICATED. The daemon refuses to listen on TCP without tokens.
- Unix-socket callers are already authenticated by the socket's 0600 mode (same
  uid as the daemon). Without a token they are tenant "default"; a token file
  line `@unix TENANT` names another tenant, and `@unix -` makes local callers
  send a token too. A local caller that sends a token gets the token's tenant.
- The health service answers everyone (probes carry no token; it tells
  nothing). Reflection and KVStore need the token.
- IPC (RegisterBuffer, MapPool) and Reserve only for local callers:
  PERMISSION_DENIED else (the servicer checks MapPool's and Reserve's further rules).

Same-uid local processes can read each other's /dev/shm and memory, so
tenants separate data between *token holders* (remote or local); they are not
a sandbox between processes of one uid.
"""
from __future__ import annotations

import hashlib

import grpc

from kvstore.core.names import NAME_RULE, is_name
from kvstore.errors import KVStoreError, quote

from . import fence

DEFAULT_TENANT = "default"
_HEALTH = "/grpc.health.v1.Health/"


class Unauthenticated(KVStoreError):
    code = "UNAUTHENTICATED"


class PermissionDenied(KVStoreError):
    code = "PERMISSION_DENIED"


MIN_TOKEN = 16


def _digest(token: str) -> bytes:
    # Look tokens up by digest so the dict probe's timing says nothing about
    # how much of a guessed token was right.
    return hashlib.sha256(token.encode()).digest()


def load_token_file(path: str) -> tuple[dict[str, str], str | None | bool]:
    """Lines `TOKEN TENANT` (# comments, blank lines). Returns (token -> tenant,
    unix tenant): the unix tenant is False when the file has no `@unix` line."""
    tokens: dict[str, str] = {}
    unix: str | None | bool = False
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{path}:{n}: expected `TOKEN TENANT`")
            tok, tenant = parts
            if tok == "@unix":
                unix = None if tenant == "-" else tenant
                if unix is not None and not is_name(unix):
                    raise ValueError(f"{path}:{n}: tenant {quote(tenant)} must be {NAME_RULE}")
                continue
            if not is_name(tenant):
                raise ValueError(f"{path}:{n}: tenant {quote(tenant)} must be {NAME_RULE}")
            if len(tok) < MIN_TOKEN:
                raise ValueError(f"{path}:{n}: token shorter than {MIN_TOKEN} characters")
            if tokens.get(tok, tenant) != tenant:       # the later line would take the earlier tenant's data
                raise ValueError(f"{path}:{n}: an earlier line gives this token to tenant {quote(tokens[tok])}; "
                                 "one token names one tenant")
            tokens[tok] = tenant
    return tokens, unix


def is_local(context) -> bool:
    return context.peer().startswith("unix:")


class Authenticator:
    """tokens: token -> tenant. unix_tenant: tenant of local callers without a
    token, None if they must send one."""

    def __init__(self, tokens: dict[str, str] | None = None, unix_tenant: str | None = DEFAULT_TENANT):
        self._tenants = {_digest(t): ten for t, ten in (tokens or {}).items()}
        self.unix_tenant = unix_tenant

    @classmethod
    def from_args(cls, token: str | None, token_file: str | None) -> "Authenticator":
        """ValueError naming the flag (and the file's line) of a token that cannot be used."""
        tokens: dict[str, str] = {}
        unix: str | None = DEFAULT_TENANT
        if token_file:
            try:
                tokens, u = load_token_file(token_file)
            except (OSError, ValueError) as e:
                raise ValueError(f"--token-file: {e}") from e
            if u is not False:
                unix = u
        if token:          # (an empty environment variable: unset)
            # A caller sends the token as `Bearer <token>`, stripped: one with spaces never matches.
            if token != token.strip() or any(ch.isspace() for ch in token):
                raise ValueError("--auth-token: a token has no whitespace")
            if len(token) < MIN_TOKEN:
                raise ValueError(f"--auth-token: token shorter than {MIN_TOKEN} characters")
            if tokens.get(token, DEFAULT_TENANT) != DEFAULT_TENANT:   # it would become the admin tenant's
                raise ValueError(f"--auth-token: --token-file gives the same token to tenant {quote(tokens[token])}; "
                                 f"one token names one tenant ({quote(DEFAULT_TENANT)} for --auth-token)")
            tokens[token] = DEFAULT_TENANT
        return cls(tokens, unix)

    @property
    def has_tokens(self) -> bool:
        return bool(self._tenants)

    def tenant(self, context) -> str:
        """The caller's tenant; Unauthenticated if it has none. Remembered on
        the call's context: the gate and the servicer both ask."""
        tenant = getattr(context, "_kvstore_tenant", None)
        if not isinstance(tenant, str):
            tenant = self._tenant(context)
            try:
                context._kvstore_tenant = tenant
            except AttributeError:     # a context type that takes no attributes
                pass
        return tenant

    def _tenant(self, context) -> str:
        sent = [v for k, v in context.invocation_metadata() or () if k == "authorization"]
        if len(sent) > 1:       # two tokens (two tenants?) in one call: which one acts is not for us to pick
            raise Unauthenticated("authorization", f"sent {len(sent)} times: a call carries one token")
        if sent:
            v = sent[0]
            token = v[7:].strip() if isinstance(v, str) and v[:7].lower() == "bearer " else ""
            if not token:
                raise Unauthenticated("authorization", "expected `Bearer <token>`")
            tenant = self._tenants.get(_digest(token))
            if tenant is None:
                raise Unauthenticated("authorization", "unknown bearer token")
            return tenant
        if is_local(context) and self.unix_tenant is not None:
            return self.unix_tenant
        raise Unauthenticated("authorization", "missing `authorization: Bearer <token>` metadata")


class _Malformed:
    """Stands in for a request whose bytes did not parse, so the call can end
    INVALID_ARGUMENT instead of grpc's own INTERNAL."""
    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


def _safe(deserializer):
    if deserializer is None:
        return None

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as e:  # noqa: BLE001 - any parse failure is the caller's bad bytes
            return _Malformed(f"{type(e).__name__}: {e}"[:200])
    return parse


class GateInterceptor(grpc.ServerInterceptor):
    """Runs before every handler: rejects unparsable requests, unauthenticated
    callers and calls naming sequences of an earlier daemon (fence.py) with the
    documented status codes."""

    def __init__(self, auth: Authenticator, instance: str = ""):
        self.auth = auth
        self.instance = instance
        self._wrapped: dict[str, tuple] = {}     # method -> (handler, wrapped handler)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        hit = self._wrapped.get(method)
        if hit is not None and hit[0] is handler:   # handlers are fixed per method: wrap once
            return hit[1]
        wrapped = self._wrap(handler, not method.startswith(_HEALTH), bool(self.instance) and method in fence.FENCED)
        if len(self._wrapped) < 1024:
            self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler, check_auth: bool, fenced: bool):
        def admit(context):
            if check_auth:
                try:
                    self.auth.tenant(context)
                except Unauthenticated as e:
                    context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
            if fenced:
                fence.check(context, self.instance)

        def parsed(r, context):
            if isinstance(r, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: malformed message ({r.error})")
            return r

        def admit_stream(requests, context):
            for r in requests:
                yield parsed(r, context)

        # A unary handler runs once its request has arrived, and grpc holds a server thread
        # waiting for it: callers that send headers and no body (or a body of up to the
        # message limit, buffered whole) would take every thread before their token was
        # looked at. Taken as a one-message stream, the call is admitted (token, instance)
        # from its headers alone, and only then is its body read.
        def unary_req(fn):
            def call(requests, context):
                admit(context)
                request = next(requests, None)
                if request is None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: no message")
                return fn(parsed(request, context), context)
            return call

        def stream_req(fn):
            def call(requests, context):
                admit(context)
                return fn(admit_stream(requests, context), context)
            return call

        kw = dict(request_deserializer=_safe(handler.request_deserializer), request_streaming=True,
                  unary_unary=None, unary_stream=None)
        if handler.unary_unary:
            kw["stream_unary"] = unary_req(handler.unary_unary)
        elif handler.unary_stream:
            kw["stream_stream"] = unary_req(handler.unary_stream)
        elif handler.stream_unary:
            kw["stream_unary"] = stream_req(handler.stream_unary)
        elif handler.stream_stream:
            kw["stream_stream"] = stream_req(handler.stream_stream)
        return handler._replace(**kw)
