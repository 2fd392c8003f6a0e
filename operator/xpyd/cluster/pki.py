"""Certificates of the local control plane: a CA, the API server's serving certificate, an admin
client certificate and the service-account signing key. Loopback names only."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=30)


@dataclass(frozen=True)
class Files:
    """Where each credential is written inside the cluster's state directory."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path

    @classmethod
    def under(cls, directory: Path) -> Files:
        return cls(*(directory / name for name in (
            "ca.crt", "ca.key", "apiserver.crt", "apiserver.key", "admin.crt", "admin.key", "sa.key", "sa.pub")))


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey,
          signer: ec.EllipticCurvePrivateKey, *, ca: bool, usages: list[x509.ObjectIdentifier],
          sans: list[x509.GeneralName]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attributes)


def generate(directory: Path) -> Files:
    """Write every credential under `directory` (created if needed) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    files = Files.under(directory)
    ca_key = _key()
    ca_name = _name("xpyd-local-ca")
    ca_cert = _cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True, usages=[], sans=[])

    server_key = _key()
    server_sans: list[x509.GeneralName] = [
        x509.DNSName(name) for name in ("localhost", "kubernetes", "kubernetes.default",
                                        "kubernetes.default.svc", "kubernetes.default.svc.cluster.local")
    ] + [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "10.0.0.1")]
    server_cert = _cert(_name("kube-apiserver"), ca_name, server_key.public_key(), ca_key, ca=False,
                        usages=[ExtendedKeyUsageOID.SERVER_AUTH], sans=server_sans)

    admin_key = _key()
    admin_cert = _cert(_name("xpyd-admin", "system:masters"), ca_name, admin_key.public_key(), ca_key,
                       ca=False, usages=[ExtendedKeyUsageOID.CLIENT_AUTH], sans=[])

    # Service-account tokens are signed with RSA (the API server's default algorithm, RS256).
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    for path, data in (
        (files.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM)),
        (files.ca_key, _pem_key(ca_key)),
        (files.server_cert, server_cert.public_bytes(serialization.Encoding.PEM)),
        (files.server_key, _pem_key(server_key)),
        (files.admin_cert, admin_cert.public_bytes(serialization.Encoding.PEM)),
        (files.admin_key, _pem_key(admin_key)),
        (files.sa_key, _pem_key(sa_key)),
        (files.sa_pub, sa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                        serialization.PublicFormat.SubjectPublicKeyInfo)),
    ):
        path.write_bytes(data)
        if path.suffix == ".key":
            path.chmod(0o600)
    return files


def issue_serving_cert(files: Files, directory: Path, common_name: str) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 signed by the cluster's CA, written as `tls.crt` and
    `tls.key` in `directory` (the names controller-runtime's webhook server reads)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate(files.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(files.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = _key()
    cert = _cert(_name(common_name), ca_cert.subject, key.public_key(), ca_key, ca=False,
                 usages=[ExtendedKeyUsageOID.SERVER_AUTH],
                 sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(_pem_key(key))
    key_path.chmod(0o600)
    return cert_path, key_path
