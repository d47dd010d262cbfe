"""Transport security both ends share: TLS material for the gRPC port and the bulk lanes, and
the bearer token a client sends.

A shard with ``--tls-cert/--tls-key`` serves gRPC over TLS (``server_credentials``) and wraps
its bulk lanes in the matching ``ssl.SSLContext`` (``ServerTLS.ssl_context``); with
``--tls-client-ca`` both demand a client certificate signed by that CA (mutual TLS). A client
describes its side in one ``ClientSecurity``: the CA that signed the shards' certificates, its
own certificate and key for mutual TLS, and the token it sends as ``authorization: Bearer <token>``
metadata on every call. Every file is read once, when the object is built; a missing or
unreadable file is a ``ValueError`` naming the flag and the path.

``make_dev_pki`` writes a throwaway CA with a server and a client certificate (``pscluster --tls``
and the tests use it); production deployments bring their own.
"""

from __future__ import annotations

import ipaddress
import secrets
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

__all__ = [
    "AUTH_METADATA_KEY", "ClientSecurity", "DevPKI", "MIN_TOKEN_CHARS", "ROLES", "ServerTLS", "TOKEN_ENV",
    "check_token", "client_security", "host_of", "make_dev_pki", "read_file", "read_token", "write_private_file",
    "write_token_files",
]

TOKEN_ENV = "PSGRPC_TOKEN"
"""The environment variable a worker or psctl reads its token from when no ``--token-file`` is
given. Never a flag value: a command line is visible to every user of the machine."""
AUTH_METADATA_KEY = "authorization"
MIN_TOKEN_CHARS = 16
"""Shortest token a shard accepts (``secrets.token_urlsafe(32)`` makes 43 characters)."""


def read_file(path: str, flag: str) -> bytes:
    """The bytes of ``path``; raises ``ValueError`` naming ``flag`` and the path if it cannot be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from None


def check_token(token: str, source: str) -> str:
    """``token`` with surrounding whitespace removed; raises ``ValueError`` (naming ``source``,
    never the token) when it is empty or holds characters a gRPC metadata value cannot carry."""
    token = token.strip()
    if not token:
        raise ValueError(f"{source}: the token is empty")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError(f"{source}: the token must be printable ASCII without spaces")
    return token


def read_token(path: str, flag: str = "--token-file") -> str:
    """The token a client file holds: its whole content, surrounding whitespace ignored."""
    raw = read_file(path, flag)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: the token must be printable ASCII without spaces") from None
    return check_token(text, f"{flag} {path}")


def host_of(address: str) -> str:
    """The host of ``HOST:PORT`` (``[v6]:PORT`` too), as certificates name it."""
    return address.rpartition(":")[0].strip("[]")


def _ssl_error(flag: str, path: str, exc: Exception) -> ValueError:
    return ValueError(f"{flag} {path}: not a usable PEM file ({exc})")


@dataclass(frozen=True, kw_only=True)
class ClientSecurity:
    """A client's credentials: TLS when ``ca_file`` is set (mutual TLS with ``cert_file`` and
    ``key_file``), and a bearer token. Raises ``ValueError`` for an inconsistent combination
    or a file that cannot be read or parsed."""

    ca_file: str | None = None
    """PEM bundle of the CA(s) that signed the shards' certificates (``--tls-ca``): turns TLS on."""
    cert_file: str | None = None
    """This client's certificate chain, PEM, for shards that require one (``--tls-cert``)."""
    key_file: str | None = None
    """The private key of ``cert_file``, PEM (``--tls-key``)."""
    token: str | None = field(default=None, repr=False)
    """Sent as ``authorization: Bearer <token>`` on every call. Kept out of ``repr``."""
    _ca: bytes = field(init=False, repr=False, compare=False, default=b"")
    _cert: bytes | None = field(init=False, repr=False, compare=False, default=None)
    _key: bytes | None = field(init=False, repr=False, compare=False, default=None)
    _context: ssl.SSLContext | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key go together: give both or neither")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("--tls-cert needs --tls-ca (the CA that signed the shards' certificates)")
        if self.token is not None:
            object.__setattr__(self, "token", check_token(self.token, "the token"))
        if self.ca_file is None:
            return
        ca = read_file(self.ca_file, "--tls-ca")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise _ssl_error("--tls-ca", self.ca_file, exc) from None
        if self.cert_file is not None:
            object.__setattr__(self, "_cert", read_file(self.cert_file, "--tls-cert"))
            object.__setattr__(self, "_key", read_file(self.key_file, "--tls-key"))
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise _ssl_error("--tls-cert/--tls-key", f"{self.cert_file} {self.key_file}", exc) from None
        object.__setattr__(self, "_ca", ca)
        object.__setattr__(self, "_context", context)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for ``grpc.secure_channel``; None without TLS (an insecure channel)."""
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self._ca, private_key=self._key,
                                            certificate_chain=self._cert)

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The metadata every call carries (None without a token). Sent per call rather than as
        call credentials, which gRPC refuses on an insecure channel."""
        return ((AUTH_METADATA_KEY, f"Bearer {self.token}"),) if self.token else None

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client context of the bulk lanes (verifies the shard's certificate and host name,
        presents the client certificate); None without TLS."""
        return self._context


def client_security(
    *, tls_ca: str | None, tls_cert: str | None, tls_key: str | None, token_file: str | None,
    env_token: str | None,
) -> ClientSecurity | None:
    """What a CLI's flags and environment ask for; None when nothing is set. The token comes
    from ``token_file`` if given, else from ``env_token`` (``PSGRPC_TOKEN``). Raises ``ValueError``."""
    token = read_token(token_file) if token_file else (
        check_token(env_token, TOKEN_ENV) if env_token is not None and env_token.strip() else None
    )
    if tls_ca is None and tls_cert is None and tls_key is None and token is None:
        return None
    return ClientSecurity(ca_file=tls_ca, cert_file=tls_cert, key_file=tls_key, token=token)


@dataclass(frozen=True, kw_only=True)
class ServerTLS:
    """A shard's TLS material, read once: its certificate chain and key, and optionally the CA
    whose client certificates it requires. Raises ``ValueError`` naming the flag and path of a
    file that cannot be read or parsed."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    _cert: bytes = field(init=False, repr=False, compare=False, default=b"")
    _key: bytes = field(init=False, repr=False, compare=False, default=b"")
    _client_ca: bytes | None = field(init=False, repr=False, compare=False, default=None)
    _context: ssl.SSLContext | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_cert", read_file(self.cert_file, "--tls-cert"))
        object.__setattr__(self, "_key", read_file(self.key_file, "--tls-key"))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.options |= ssl.OP_NO_RENEGOTIATION  # a lane's TLS 1.2 peer cannot renegotiate mid-transfer
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise _ssl_error("--tls-cert/--tls-key", f"{self.cert_file} {self.key_file}", exc) from None
        if self.client_ca_file is not None:
            ca = read_file(self.client_ca_file, "--tls-client-ca")
            try:
                context.load_verify_locations(cadata=ca.decode("ascii", errors="replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise _ssl_error("--tls-client-ca", self.client_ca_file, exc) from None
            context.verify_mode = ssl.CERT_REQUIRED
            object.__setattr__(self, "_client_ca", ca)
        object.__setattr__(self, "_context", context)

    @property
    def mutual(self) -> bool:
        return self.client_ca_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """For ``server.add_secure_port``; requires client certificates when ``mutual``."""
        return grpc.ssl_server_credentials(
            [(self._key, self._cert)], root_certificates=self._client_ca, require_client_auth=self.mutual,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The server context of the bulk lanes, with the same certificate and client CA."""
        assert self._context is not None
        return self._context


# -- a throwaway PKI for pscluster --tls and the tests ----------------------------------------


def write_private_file(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` readable by its owner alone (mode 0600 from the start)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
    with os.fdopen(fd, "wb") as f:
        f.write(data)


ROLES = ("reader", "worker", "admin")
"""The roles a shard's token file grants (``psserver.auth``), lowest first."""


def write_token_files(directory: str | os.PathLike, *, keep: bool = False) -> dict[str, Path]:
    """Fresh tokens, one per role: ``DIRECTORY/tokens`` (the shards' ``--auth-token-file``, one
    ``ROLE TOKEN`` line each) and ``DIRECTORY/ROLE.token`` (a client's ``--token-file``), all
    mode 0600. With ``keep``, a directory that already holds every file is left as it is (a
    container that runs this at each start keeps the tokens its shards and workers have). Returns
    the paths by name ("tokens", "worker", "reader", "admin"). Raises ``OSError``."""
    directory = Path(directory)
    paths = {"tokens": directory / "tokens", **{role: directory / f"{role}.token" for role in ROLES}}
    if keep and all(path.is_file() for path in paths.values()):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    tokens = {role: secrets.token_urlsafe(32) for role in ROLES}
    for role in ROLES:
        write_private_file(paths[role], f"{tokens[role]}\n".encode())
    # The shards' file last: a reader that finds it finds every client file too.
    write_private_file(paths["tokens"], "".join(f"{role} {tokens[role]}\n" for role in ROLES).encode())
    return paths


@dataclass(frozen=True)
class DevPKI:
    """Paths of what ``make_dev_pki`` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def shard_flags(self) -> list[str]:
        """``psserver`` flags for mutual TLS with these files."""
        return ["--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key),
                "--tls-client-ca", str(self.ca)]

    def client_flags(self) -> list[str]:
        """``psworker``/``psctl`` flags for mutual TLS with these files."""
        return ["--tls-ca", str(self.ca), "--tls-cert", str(self.client_cert), "--tls-key", str(self.client_key)]

    def client(self, token: str | None = None) -> ClientSecurity:
        return ClientSecurity(ca_file=str(self.ca), cert_file=str(self.client_cert), key_file=str(self.client_key),
                              token=token)


def make_dev_pki(directory: str | os.PathLike, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                 *, days: int = 30) -> DevPKI:
    """Write a new CA, a server certificate whose subject alternative names are ``hosts`` (IP
    addresses and DNS names), and a client certificate, all signed by that CA, into
    ``directory`` (keys mode 0600; the CA's key is never written, so nothing else can be signed
    by it). Needs the ``cryptography`` package."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def write_key(path: Path, key) -> None:
        write_private_file(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))

    def builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=days)))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("psgrpc throwaway CA")
    ca_cert = (builder(ca_name, ca_name, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
               .sign(ca_key, hashes.SHA256()))

    def leaf(common: str, usage, sans: list[x509.GeneralName]) -> tuple[x509.Certificate, object]:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (builder(name(common), ca_name, key.public_key())
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return b.sign(ca_key, hashes.SHA256()), key

    sans: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # in order, once each
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(host))
    server_cert, server_key = leaf("psserver", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_cert, client_key = leaf("psgrpc client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    pki = DevPKI(out / "ca.pem", out / "server.pem", out / "server.key", out / "client.pem", out / "client.key")
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    pki.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    write_key(pki.server_key, server_key)
    write_key(pki.client_key, client_key)
    return pki
