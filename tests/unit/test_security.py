"""Pure parts of transport security and admission: the token file, role and admission decisions,
the configs' validation, the client's error mapping, and the throwaway PKI."""

from __future__ import annotations

import os
import stat

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pswire import errors
from pswire.security import ClientSecurity, client_security, make_dev_pki, read_token
from psserver.auth import (
    Admission, AdmissionCaps, CallClass, Role, admit, authorize, call_class, parse_token_file,
    required_role,
)
from psserver.config import parse_args as server_args
from psserver.server import exposure_warnings
from psworker.config import build_parser as worker_parser
from psworker.config import parse_args as worker_args
from psworker.ctl import default_checkpoint_id
from psworker.retry import retrying, translate
from psworker.shard import ClientOptions

pytestmark = pytest.mark.timeout(60)

SERVICE = "/pswire.v1.ParameterServer/"
METHODS = ["Register", "Initialize", "Push", "Pull", "PushInline", "PullInline", "PushPull", "Leave", "Heartbeat",
           "Status", "Checkpoint"]
WORKER, READER, ADMIN = "w" * 20, "r" * 24, "A-" * 10


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_dev_pki(tmp_path_factory.mktemp("pki"), ["127.0.0.1", "localhost", "ps0.internal"])


# -- the token file ---------------------------------------------------------------------------


def test_a_token_file_with_comments_and_blank_lines_gives_each_token_its_role():
    table = parse_token_file(f"# tokens\n\nworker {WORKER}\n  reader   {READER}  \nADMIN {ADMIN}\n")
    assert len(table) == 3
    assert [table.role_of(t) for t in (WORKER, READER, ADMIN)] == [Role.WORKER, Role.READER, Role.ADMIN]
    assert table.role_of("x" * 20) is None and table.role_of(WORKER[:-1]) is None and table.role_of("") is None


@pytest.mark.parametrize("text, message", [
    (f"worker {WORKER}\nroot {'s' * 20}\n", "line 2: unknown role 'root'"),
    (f"# a comment\nworker {'s' * 15}\n", "line 2: the token is shorter than 16 characters"),
    (f"worker {WORKER} extra\n", "line 1: expected 'ROLE TOKEN'"),
    (f"{WORKER}\n", "line 1: expected 'ROLE TOKEN'"),
    (f"worker {WORKER}\nadmin {WORKER}\n", "line 2: the token of line 1 again"),
    (f"worker {'s' * 16}\u00e9\n", "line 1: the token must be printable ASCII"),
    ("# nothing but comments\n\n", "no tokens"),
])
def test_a_bad_token_file_is_refused_with_the_line_and_never_the_token(text, message):
    with pytest.raises(ValueError, match="--auth-token-file") as info:
        parse_token_file(text)
    assert message in str(info.value)
    assert WORKER not in str(info.value) and "s" * 15 not in str(info.value)


def test_a_client_token_file_is_its_whole_content_and_an_empty_one_is_refused(tmp_path):
    good, empty = tmp_path / "good", tmp_path / "empty"
    good.write_text(f"  {WORKER}\n")
    empty.write_text("\n")
    assert read_token(str(good)) == WORKER
    with pytest.raises(ValueError, match=f"--token-file {empty}: the token is empty"):
        read_token(str(empty))
    with pytest.raises(ValueError, match=f"--token-file {tmp_path / 'missing'}: cannot read it"):
        read_token(str(tmp_path / "missing"))


# -- role decisions ---------------------------------------------------------------------------


def test_roles_of_every_method():
    assert {m: required_role(SERVICE + m) for m in METHODS} == {
        "Register": Role.WORKER, "Initialize": Role.WORKER, "Push": Role.WORKER, "Pull": Role.READER,
        "PushInline": Role.WORKER, "PullInline": Role.READER, "PushPull": Role.WORKER, "Leave": Role.WORKER,
        "Heartbeat": Role.WORKER, "Status": Role.READER, "Checkpoint": Role.ADMIN,
    }
    assert required_role("/grpc.health.v1.Health/Check") is None
    assert required_role("/grpc.health.v1.Health/Watch") is None
    # Calls nobody listed (an administrative call to come, another service) need admin.
    assert required_role(SERVICE + "Evict") is Role.ADMIN
    assert required_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is Role.ADMIN


@given(method=st.sampled_from(METHODS + ["Evict", "Shutdown"]), role=st.sampled_from(list(Role) + [None]),
       presented=st.booleans())
def test_a_call_is_allowed_exactly_when_its_token_is_known_and_its_role_high_enough(method, role, presented):
    refusal = authorize(SERVICE + method, presented, role if presented else None)
    needed = required_role(SERVICE + method)
    if not presented or role is None:
        assert isinstance(refusal, errors.UnauthenticatedError)
    elif role < needed:
        assert isinstance(refusal, errors.PermissionDeniedError)
        assert f"{method} needs the {needed.name.lower()} role" in str(refusal) and role.name.lower() in str(refusal)
    else:
        assert refusal is None
    if refusal is not None:
        assert method in str(refusal) and needed.name.lower() in str(refusal)


def test_health_needs_no_token():
    assert authorize("/grpc.health.v1.Health/Check", False, None) is None


# -- admission decisions ------------------------------------------------------------------------


def test_call_classes():
    classes = {m: call_class(SERVICE + m) for m in METHODS}
    assert {m for m, c in classes.items() if c is CallClass.CONTROL} == {"Register", "Heartbeat", "Leave"}
    assert {m for m, c in classes.items() if c is CallClass.STATUS} == {"Status"}
    assert call_class("/grpc.health.v1.Health/Check") is CallClass.CONTROL
    assert call_class("/grpc.health.v1.Health/Watch") is CallClass.WATCH
    assert call_class(SERVICE + "Evict") is CallClass.DATA


@given(threads=st.integers(1, 512))
def test_default_caps_leave_threads_for_control_calls_and_waiting_pulls_leave_data_slots(threads):
    caps = AdmissionCaps.for_threads(threads)
    assert (caps.status, caps.watch) == (2, 2) and caps.data >= 2
    if threads >= 10:
        assert threads - caps.data - caps.status - caps.watch >= 4  # heartbeats, registrations, health checks
    assert 1 <= caps.waiting_pulls() < caps.data  # a push that releases a waiting pull finds a slot


def test_the_default_shard_serves_24_data_and_2_status_calls_at_once():
    caps = server_args([], {}).admission_caps()
    assert (caps.data, caps.status, caps.watch, caps.waiting_pulls()) == (24, 2, 2, 18)


@given(data=st.integers(2, 64), in_flight=st.integers(1, 64))
def test_a_pull_may_park_in_a_data_slot_only_while_a_quarter_of_them_stays_free(data, in_flight):
    admission = Admission(AdmissionCaps(data=data, status=2))
    admission._in_flight[CallClass.DATA] = min(in_flight, data)  # the caller's own call counted
    free_after = data - min(in_flight, data)
    assert admission.data_slots_scarce() == (free_after < max(1, data // 4))


@given(kind=st.sampled_from(list(CallClass)), in_flight=st.integers(0, 100), data=st.integers(1, 50),
       status=st.integers(1, 10))
def test_admit_refuses_exactly_beyond_the_cap_and_never_control(kind, in_flight, data, status):
    caps = AdmissionCaps(data=data, status=status, watch=2)
    refusal = admit(kind, in_flight, caps)
    cap = {CallClass.DATA: data, CallClass.STATUS: status, CallClass.WATCH: 2}.get(kind)
    assert (refusal is not None) == (cap is not None and in_flight >= cap)
    if refusal is not None:
        assert refusal.startswith("overloaded:")


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self, active: bool = True):
        self.trailing = None
        self.code = None
        self.active = active

    def is_active(self):
        return self.active

    def set_trailing_metadata(self, md):
        self.trailing = md

    def abort(self, code, details):
        self.code, self.details = code, details
        raise _Aborted(details)


class _Details:
    def __init__(self, method):
        self.method = method
        self.invocation_metadata = ()


def test_admission_counts_calls_until_they_end_however_they_end():
    admission = Admission(AdmissionCaps(data=2, status=1))

    def stream(request, context):
        yield 1
        yield 2

    pull = admission.intercept_service(lambda d: grpc.unary_stream_rpc_method_handler(stream),
                                       _Details(SERVICE + "Pull"))
    first, second = pull.unary_stream(None, _Context()), pull.unary_stream(None, _Context())
    assert next(first) == 1 and next(second) == 1
    assert admission.in_flight()[CallClass.DATA] == 2
    third = _Context()
    with pytest.raises(_Aborted, match="^overloaded:"):
        next(pull.unary_stream(None, third))
    assert third.code is grpc.StatusCode.RESOURCE_EXHAUSTED and third.trailing == (("ps-retryable", "1"),)
    first.close()  # what gRPC does to a cancelled stream
    assert list(second) == [2]
    assert admission.in_flight()[CallClass.DATA] == 0

    def failing(request, context):
        raise RuntimeError("boom")

    status = admission.intercept_service(lambda d: grpc.unary_unary_rpc_method_handler(failing),
                                         _Details(SERVICE + "Status"))
    with pytest.raises(RuntimeError):
        status.unary_unary(None, _Context())
    assert admission.in_flight()[CallClass.STATUS] == 0
    # Control calls are never counted or refused.
    heartbeat = admission.intercept_service(lambda d: grpc.unary_unary_rpc_method_handler(lambda r, c: "ok"),
                                            _Details(SERVICE + "Heartbeat"))
    assert heartbeat.unary_unary(None, _Context()) == "ok"


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-key", "k.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert"),
    (["--threads", "8", "--max-data-calls", "9"], "max_data_calls must be in 0..threads (8)"),
    (["--max-status-calls", "0"], "max_status_calls must be in 1..threads"),
    (["--stream-idle-timeout", "-1"], "stream_idle_timeout must be >= 0"),
    (["--auth-token-file", ""], "--auth-token-file is empty"),
])
def test_server_security_settings_are_validated(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        server_args(argv, {})
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_worker_token_comes_from_its_file_else_the_environment_and_never_shows(tmp_path):
    env = {"PSGRPC_TOKEN": f"  {READER}\n"}
    config = worker_args(["--ps", "h:1"], env)
    assert config.security.token == READER and not config.security.tls
    assert READER not in repr(config) and READER not in repr(config.security)
    token_file = tmp_path / "token"
    token_file.write_text(WORKER)
    assert worker_args(["--ps", "h:1", "--token-file", str(token_file)], env).security.token == WORKER
    assert worker_args(["--ps", "h:1"], {}).security is None
    assert "--token" not in worker_parser().format_help().replace("--token-file", "")


@pytest.mark.parametrize("argv, message", [
    (["--tls-cert", "c.pem", "--tls-key", "k.pem"], "--tls-cert needs --tls-ca"),
    (["--tls-ca", "ca.pem", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: cannot read it"),
    (["--token-file", "/nonexistent/token"], "--token-file /nonexistent/token: cannot read it"),
])
def test_worker_security_settings_are_validated(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        worker_args(["--ps", "h:1", *argv], {})
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_environment_token_is_a_usage_error_that_does_not_echo_it(capsys):
    with pytest.raises(SystemExit):
        worker_args(["--ps", "h:1"], {"PSGRPC_TOKEN": "two words-xxxxxxxx"})
    err = capsys.readouterr().err
    assert "PSGRPC_TOKEN" in err and "words-xxxxxxxx" not in err


def test_client_files_are_read_once_when_built(tmp_path, pki):
    names = ("ca.pem", "client.pem", "client.key")
    for name in names:
        (tmp_path / name).write_bytes((pki.ca.parent / name).read_bytes())
    security = ClientSecurity(ca_file=str(tmp_path / "ca.pem"), cert_file=str(tmp_path / "client.pem"),
                              key_file=str(tmp_path / "client.key"), token=WORKER)
    for name in names:
        (tmp_path / name).unlink()
    assert security.tls and security.channel_credentials() is not None and security.ssl_context() is not None
    assert security.metadata() == (("authorization", f"Bearer {WORKER}"),)
    assert client_security(tls_ca=None, tls_cert=None, tls_key=None, token_file=None, env_token="") is None
    with pytest.raises(ValueError, match="--tls-ca .*: not a usable PEM file"):
        ClientSecurity(ca_file=str(pki.client_key))


def test_the_dev_pki_keys_are_private_and_the_server_certificate_names_its_hosts(pki):
    from cryptography import x509

    for key in (pki.server_key, pki.client_key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert not (pki.ca.parent / "ca.key").exists()
    cert = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert set(sans.get_values_for_type(x509.DNSName)) == {"localhost", "ps0.internal"}


def test_a_non_loopback_shard_says_what_is_unprotected_and_which_flags_fix_it():
    assert exposure_warnings("127.0.0.1", 7000, 7001, tls=False, mutual=False, tokens=False) == []
    assert exposure_warnings("localhost", 7000, 7001, tls=False, mutual=False, tokens=False) == []
    plain = exposure_warnings("0.0.0.0", 7000, 7001, tls=False, mutual=False, tokens=False)
    assert len(plain) == 2
    assert "clear text" in plain[0] and "--tls-cert" in plain[0] and "port 7000 and bulk port 7001" in plain[0]
    assert "--auth-token-file" in plain[1]
    assert exposure_warnings("10.0.0.5", 7000, None, tls=True, mutual=True, tokens=True) == []


# -- the client's side -------------------------------------------------------------------------


class _RpcError(grpc.RpcError):
    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


@pytest.mark.parametrize("exc, cls, text", [
    (_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded: 26 data calls", (("ps-retryable", "1"),)),
     errors.OverloadedError, "overloaded"),
    (_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!"), errors.OverloadedError, "limit"),
    (_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "request carries 9 bytes, above"), errors.TooLargeError, "above"),
    (_RpcError(grpc.StatusCode.UNAUTHENTICATED, "Push needs a token"), errors.UnauthenticatedError,
     "--token-file FILE or the PSGRPC_TOKEN"),
    (_RpcError(grpc.StatusCode.PERMISSION_DENIED, "Checkpoint needs the admin role; the token sent has the worker "
               "role"), errors.PermissionDeniedError, "use a token of the role named"),
    (_RpcError(grpc.StatusCode.UNAUTHENTICATED, "the call does not carry that registration's session secret"),
     errors.UnauthenticatedError, "session secret (UNAUTHENTICATED)"),
])
def test_status_codes_become_domain_errors(exc, cls, text):
    error = translate(exc, "h:1")
    assert type(error) is cls and text in str(error)
    # Only a refused token is answered with where to give one.
    assert ("PSGRPC_TOKEN" in str(error)) == ("token" in exc.details())


def test_overloaded_calls_are_retried_and_refusals_are_not():
    options = ClientOptions(retry_timeout=10.0)
    outcomes = iter([errors.OverloadedError("busy"), errors.OverloadedError("busy"), "done"])

    def call():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert retrying(call, options, "h:1", "push") == "done"
    attempts = []

    def refused():
        attempts.append(1)
        raise errors.UnauthenticatedError("no token")

    with pytest.raises(errors.UnauthenticatedError):
        retrying(refused, options, "h:1", "push")
    assert len(attempts) == 1


def test_the_default_checkpoint_id_is_the_clock_in_seconds_or_past_the_newest():
    assert default_checkpoint_id(1_700_000_000.7, []) == 1_700_000_000
    assert default_checkpoint_id(1_700_000_000.7, [0, 5]) == 1_700_000_000
    assert default_checkpoint_id(1_700_000_000.7, [1_700_000_000, 3]) == 1_700_000_001


def test_a_call_whose_caller_is_gone_is_not_served_and_takes_no_slot():
    admission = Admission(AdmissionCaps(data=1, status=1))
    served = []

    def pull(request, context):
        served.append(request)
        return request

    handler = admission.intercept_service(lambda d: grpc.unary_unary_rpc_method_handler(pull),
                                          _Details(SERVICE + "PullInline"))
    gone = _Context(active=False)  # its deadline passed while it waited behind an overload
    with pytest.raises(_Aborted, match="gave up"):
        handler.unary_unary("late", gone)
    assert gone.code is grpc.StatusCode.CANCELLED and served == []
    assert admission.in_flight()[CallClass.DATA] == 0
    assert handler.unary_unary("wanted", _Context()) == "wanted" and served == ["wanted"]
    assert admission.in_flight()[CallClass.DATA] == 0
