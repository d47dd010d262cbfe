"""Who may call what, and how many calls of each kind a shard serves at once: two gRPC server
interceptors, each around a pure decision function.

``TokenAuth`` checks the bearer token of every call (``authorization: Bearer <token>``) against
the shard's token file (``--auth-token-file``), in constant time, and the role it carries
against the role the method needs (``required_role``). The standard health service is open to
all. ``Admission`` caps the calls in flight per class (``call_class``, ``AdmissionCaps``) so that
data calls, which may hold a handler thread for long (a stream that stalls, a pull waiting on the
staleness bound, a checkpoint), always leave threads for heartbeats, registrations and health
checks; a call beyond its cap is refused at once as retryable (``RESOURCE_EXHAUSTED``, details
``overloaded: ...``, trailing metadata ``ps-retryable: 1``).

Token file format (``--auth-token-file``)::

    # comment lines start with '#'; blank lines are ignored
    ROLE TOKEN        one per line; ROLE is worker, reader or admin

``reader`` may call Status, Pull, PullInline and PullRows (read the model); ``worker`` also Register,
Initialize, Push, PushInline, PushPull, Heartbeat, Leave and Data (the data queue); ``admin`` may call everything,
Checkpoint and any administrative call to come included. Tokens are at least 16 printable
ASCII characters; a malformed line is refused with its number, never its token.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from pswire import errors
from pswire.security import AUTH_METADATA_KEY, MIN_TOKEN_CHARS, read_file
from psserver.servicer import RETRYABLE, SERVICE, STATUS_CODES

__all__ = [
    "Admission", "AdmissionCaps", "CallClass", "Role", "TokenAuth", "TokenTable", "admit", "authorize",
    "call_class", "load_token_file", "parse_token_file", "required_role",
]

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"


class Role(enum.IntEnum):
    """Roles in increasing power: each may do what the ones below it may."""

    READER = 1
    WORKER = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()


_READER_METHODS = frozenset({"Status", "Pull", "PullInline", "PullRows"})
_WORKER_METHODS = frozenset({"Register", "Initialize", "Push", "PushInline", "PushPull", "Heartbeat", "Leave",
                             "Data"})


def _split(method: str) -> tuple[str, str]:
    """``/pkg.Service/Method`` -> (service, method)."""
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


def required_role(method: str) -> Role | None:
    """The least role that may call ``method`` (a full ``/service/Method`` path); None for the
    health service, which is open. Anything not named here (a new administrative call, another
    service) needs ``admin``: new calls are closed until someone opens them."""
    service, name = _split(method)
    if service == HEALTH_SERVICE:
        return None
    if service == SERVICE and name in _READER_METHODS:
        return Role.READER
    if service == SERVICE and name in _WORKER_METHODS:
        return Role.WORKER
    return Role.ADMIN


def authorize(method: str, presented: bool, role: Role | None) -> errors.PSError | None:
    """The refusal of a call to ``method`` (None: allowed). ``presented``: the call carried a
    bearer token; ``role``: the role of that token, None if the shard does not know it. The
    messages name the method and the role it needs, never the token."""
    needed = required_role(method)
    if needed is None:
        return None
    _, name = _split(method)
    if not presented:
        return errors.UnauthenticatedError(
            f"{name} needs a token with the {needed.label} role (metadata 'authorization: Bearer <token>'); "
            "the call carried none"
        )
    if role is None:
        return errors.UnauthenticatedError(f"{name} needs a token with the {needed.label} role; "
                                           "the token sent is not one this shard accepts")
    if role < needed:
        return errors.PermissionDeniedError(f"{name} needs the {needed.label} role; the token sent has "
                                            f"the {role.label} role")
    return None


class TokenTable:
    """The tokens a shard accepts, kept as SHA-256 digests with their roles."""

    def __init__(self, entries: Sequence[tuple[str, Role]]) -> None:
        if not entries:
            raise ValueError("no tokens given")
        self._entries = [(hashlib.sha256(t.encode()).digest(), role) for t, role in entries]

    def __len__(self) -> int:
        return len(self._entries)

    def role_of(self, token: str) -> Role | None:
        """The role of ``token``, None if unknown. Compares the token's digest with every entry,
        each in constant time and without stopping at a match, so the time taken tells nothing
        about which token (or how much of one) was right."""
        digest = hashlib.sha256(token.encode("utf-8", errors="surrogateescape")).digest()
        found: Role | None = None
        for known, role in self._entries:
            if hmac.compare_digest(known, digest):
                found = role
        return found


def parse_token_file(text: str, source: str = "--auth-token-file") -> TokenTable:
    """Parse the token file format (module docstring). Raises ``ValueError`` naming ``source``
    and the line of the first problem: not ``ROLE TOKEN``, an unknown role, a token shorter
    than ``MIN_TOKEN_CHARS`` or not printable ASCII, a token listed twice, or no token at all."""
    entries: list[tuple[str, Role]] = []
    seen: dict[str, int] = {}
    roles = {r.label: r for r in Role}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        fields = stripped.split()
        where = f"{source} line {number}"
        if len(fields) != 2:
            raise ValueError(f"{where}: expected 'ROLE TOKEN' (role: worker, reader or admin), "
                             f"got {len(fields)} field(s)")
        role_name, token = fields
        role = roles.get(role_name.lower())
        if role is None:
            raise ValueError(f"{where}: unknown role {role_name[:20]!r} (worker, reader or admin)")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters")
        if not all(33 <= ord(c) <= 126 for c in token):
            raise ValueError(f"{where}: the token must be printable ASCII")
        if token in seen:
            raise ValueError(f"{where}: the token of line {seen[token]} again (one role per token)")
        seen[token] = number
        entries.append((token, role))
    if not entries:
        raise ValueError(f"{source}: no tokens (lines 'ROLE TOKEN', role worker, reader or admin)")
    return TokenTable(entries)


def load_token_file(path: str) -> TokenTable:
    """Read and parse ``path`` (``--auth-token-file``); raises ``ValueError`` naming the flag
    and path. Warns when the file is readable by others than its owner."""
    raw = read_file(path, "--auth-token-file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--auth-token-file {path}: not UTF-8 text") from None
    table = parse_token_file(text, f"--auth-token-file {path}")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("--auth-token-file %s can be read by other users (mode %o): chmod 600 it", path, mode & 0o777)
    return table


def _bearer(metadata) -> str | None:
    """The token of an ``authorization: Bearer <token>`` entry, None if there is none (an entry
    in another scheme gives "", which no table holds)."""
    for key, value in metadata or ():
        if key == AUTH_METADATA_KEY:
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


class _Refusals:
    """Logs refused calls at most once per ``every`` seconds, with the count in between."""

    def __init__(self, what: str, every: float = 10.0) -> None:
        self._what, self._every = what, every
        self._lock = threading.Lock()  # guards _count and _logged_at
        self._count = 0
        self._logged_at = float("-inf")

    def note(self, reason: str) -> None:
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._logged_at < self._every:
                return
            count, self._count, self._logged_at = self._count, 0, now
        log.warning("%s %d call(s) since the last such line (one at most every %.0fs), e.g.: %s", self._what, count,
                    self._every, reason)


def _refusal_handler(code: grpc.StatusCode, details: str, trailing=None) -> grpc.RpcMethodHandler:
    """A handler that ends the call with ``code`` before reading any request message (a
    request stream handler serves every kind of call on the wire)."""

    def refuse(request_iterator, context: grpc.ServicerContext):
        if trailing:
            context.set_trailing_metadata(trailing)
        context.abort(code, details)

    return grpc.stream_unary_rpc_method_handler(refuse)


class TokenAuth(grpc.ServerInterceptor):
    """Refuses calls without a known token (``UNAUTHENTICATED``) and calls whose token's role
    is below the method's (``PERMISSION_DENIED``). Runs on gRPC's polling thread, before the call
    takes a handler thread: a refusal costs a digest and a few compares."""

    def __init__(self, tokens: TokenTable) -> None:
        self._tokens = tokens
        self._refusals = _Refusals("refused (authentication)")

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if required_role(method) is None:
            return continuation(handler_call_details)
        token = _bearer(handler_call_details.invocation_metadata)
        role = self._tokens.role_of(token) if token else None
        refusal = authorize(method, token is not None, role)
        if refusal is None:
            return continuation(handler_call_details)
        self._refusals.note(str(refusal))
        return _refusal_handler(STATUS_CODES[type(refusal)], str(refusal))


# -- admission control ---------------------------------------------------------------------------


class CallClass(enum.Enum):
    CONTROL = "control"
    """Register, Heartbeat, Leave, Data (the data queue), health Check: short, and what keeps
    workers alive and fed. Not capped."""
    STATUS = "status"
    """Status: read-only, but a loop of them must not crowd out the rest."""
    WATCH = "watch"
    """Health Watch streams: each holds a thread for as long as it watches, and the health
    service needs no token, so anyone may open them."""
    DATA = "data"
    """Everything that moves or waits on the model's bytes, or writes a checkpoint."""


_CONTROL_METHODS = frozenset({"Register", "Heartbeat", "Leave", "Data"})
_STATUS_METHODS = frozenset({"Status"})


def call_class(method: str) -> CallClass:
    """The class of a full ``/service/Method`` path: any call of the service not named here,
    known or new, is data; health Check is control."""
    service, name = _split(method)
    if service == HEALTH_SERVICE:
        return CallClass.WATCH if name == "Watch" else CallClass.CONTROL
    if service == SERVICE and name in _CONTROL_METHODS:
        return CallClass.CONTROL
    if service == SERVICE and name in _STATUS_METHODS:
        return CallClass.STATUS
    return CallClass.DATA


RESERVED_THREADS = 8
"""Handler threads data calls may never take. With 2 status calls and 2 health watches, at least
4 stay for heartbeats, registrations, leaves and health checks: each is short, so one of them
waits for a thread about as long as one such call takes, however many data calls stall."""
WATCH_CALLS = 2
"""Health Watch streams served at once."""


@dataclass(frozen=True)
class AdmissionCaps:
    """Calls of each capped class a shard serves at once (control calls are not capped)."""

    data: int
    status: int
    watch: int = WATCH_CALLS

    @classmethod
    def for_threads(cls, threads: int, *, max_data_calls: int = 0, max_status_calls: int = 2) -> "AdmissionCaps":
        """The caps of a shard with ``threads`` handler threads. ``max_data_calls`` 0: all threads
        but ``RESERVED_THREADS``, and never fewer than 2 (one pull may wait on the staleness bound
        while a push that releases it is served), so shards with very few threads reserve less."""
        data = max_data_calls or max(2, threads - RESERVED_THREADS)
        return cls(data=data, status=max_status_calls)

    def waiting_pulls(self) -> int:
        """How many pulls may wait on the staleness bound at once: a quarter of the data slots
        (at least one) stays free for the pushes and the Initialize that release them."""
        return max(1, self.data - max(1, self.data // 4))

    def cap(self, kind: CallClass) -> int | None:
        return {CallClass.DATA: self.data, CallClass.STATUS: self.status, CallClass.WATCH: self.watch}.get(kind)


def admit(kind: CallClass, in_flight: int, caps: AdmissionCaps) -> str | None:
    """Why a call of ``kind`` is refused when ``in_flight`` calls of its class already run, or
    None to admit it."""
    cap = caps.cap(kind)
    if cap is None or in_flight < cap:
        return None
    return (f"overloaded: {in_flight} {kind.value} calls already in flight on this shard (the most it serves at "
            f"once, so that heartbeats and health checks always find a thread); retry after a backoff")


class Admission(grpc.ServerInterceptor):
    """Counts the calls of each capped class from the moment a handler thread starts one until
    its handler returns (for a streamed response: until the stream ends, is cancelled, or fails),
    and refuses a call beyond its class's cap at once, before reading its request stream. A call
    whose caller is already gone when a thread takes it is ended at once, uncounted."""

    def __init__(self, caps: AdmissionCaps) -> None:
        self.caps = caps
        self._lock = threading.Lock()  # guards _in_flight
        self._in_flight = {kind: 0 for kind in CallClass if caps.cap(kind) is not None}
        self._refusals = _Refusals("admission control turned away")

    def in_flight(self) -> dict[CallClass, int]:
        with self._lock:
            return dict(self._in_flight)

    def data_slots_scarce(self) -> bool:
        """Whether a quarter of the data slots (at least one) is no longer free, counting the
        caller's own call: then a pull must not park in one to wait (for the shard's
        initialisation or the staleness bound), as the rest are kept for the pushes and the
        Initialize that would end such waits. Stalled streams that hold slots make this true."""
        with self._lock:
            in_flight = self._in_flight.get(CallClass.DATA, 0)
        return in_flight > self.caps.data - max(1, self.caps.data // 4)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        kind = call_class(handler_call_details.method)
        if self.caps.cap(kind) is None:
            return handler
        if handler.request_streaming and handler.response_streaming:
            return handler._replace(stream_stream=self._streaming(kind, handler.stream_stream))
        if handler.request_streaming:
            return handler._replace(stream_unary=self._unary(kind, handler.stream_unary))
        if handler.response_streaming:
            return handler._replace(unary_stream=self._streaming(kind, handler.unary_stream))
        return handler._replace(unary_unary=self._unary(kind, handler.unary_unary))

    def _enter(self, kind: CallClass, context: grpc.ServicerContext) -> None:
        if not context.is_active():
            # The caller gave up (cancelled, or its deadline passed) while the call waited for a
            # handler thread, as calls do behind an overload: serving it would only hold a slot
            # and delay the calls that are still wanted.
            context.abort(grpc.StatusCode.CANCELLED, "the caller gave up before a handler thread took the call")
        with self._lock:
            refusal = admit(kind, self._in_flight[kind], self.caps)
            if refusal is None:
                self._in_flight[kind] += 1
                return
        self._refusals.note(refusal)
        context.set_trailing_metadata((RETRYABLE,))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

    def _leave(self, kind: CallClass) -> None:
        with self._lock:
            self._in_flight[kind] -= 1

    def _unary(self, kind: CallClass, behavior: Callable) -> Callable:
        def admitted(request, context):
            self._enter(kind, context)
            try:
                return behavior(request, context)
            finally:
                self._leave(kind)

        return admitted

    def _streaming(self, kind: CallClass, behavior: Callable) -> Callable:
        # A generator: gRPC closes it when the call ends early (cancelled, deadline, broken
        # connection), which runs the finally; a handler blocked inside still holds its thread,
        # so it still counts until it returns.
        def admitted(request, context):
            self._enter(kind, context)
            try:
                yield from behavior(request, context)
            finally:
                self._leave(kind)

        return admitted

