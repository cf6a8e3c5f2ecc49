"""TLS for the gRPC control plane: --grpc-ssl-certfile and --grpc-ssl-keyfile serve it over
TLS only (no plaintext port beside it), --grpc-ssl-ca-certs also requires each client to
present a certificate those CAs sign (mutual TLS). The API key is checked either way: TLS
says who the server is (and with client certificates who may connect), the key which caller
may run the model.

The files are checked with the standard library's ssl module before grpc gets them, so a
key that does not match its certificate, or a file that is not PEM, fails at start-up with
the flag's name rather than at each client's handshake."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from shoal.entrypoints.openai.server_settings import ServerSettings


@dataclass(frozen=True)
class TlsFiles:
    certfile: str
    keyfile: str
    ca_certs: str | None = None  # set: mutual TLS

    @classmethod
    def of(cls, settings: ServerSettings) -> TlsFiles | None:
        """The settings' TLS files (None: plaintext); ServerSettings checked they come as a
        set."""
        if settings.grpc_ssl_certfile is None or settings.grpc_ssl_keyfile is None:
            return None
        return cls(settings.grpc_ssl_certfile, settings.grpc_ssl_keyfile,
                   settings.grpc_ssl_ca_certs)

    def describe(self) -> str:
        return "TLS, client certificates required" if self.ca_certs else "TLS"


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path!r}: {e.strerror or e}") from None


def _check(files: TlsFiles) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(files.certfile, files.keyfile)
    except ssl.SSLError as e:
        raise ValueError(f"--grpc-ssl-certfile {files.certfile!r} and --grpc-ssl-keyfile "
                         f"{files.keyfile!r} are not a PEM certificate chain and its "
                         f"private key: {e}") from None
    if files.ca_certs is not None:
        try:
            context.load_verify_locations(cafile=files.ca_certs)
        except ssl.SSLError as e:
            raise ValueError(f"--grpc-ssl-ca-certs {files.ca_certs!r} holds no PEM CA "
                             f"certificate: {e}") from None


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """grpc's credentials for `files`; ValueError naming the flag for a file that cannot be
    read or does not fit."""
    cert = _read(files.certfile, "--grpc-ssl-certfile")
    key = _read(files.keyfile, "--grpc-ssl-keyfile")
    ca = _read(files.ca_certs, "--grpc-ssl-ca-certs") if files.ca_certs else None
    _check(files)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)
