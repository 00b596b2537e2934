"""Test certificates made with the `cryptography` package: a CA, certificates it signs, and
self-signed ones, as PEM files. Imported where a test needs them (it needs the package)."""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

Issued = tuple[x509.Certificate, ec.EllipticCurvePrivateKey]


def issue(cn: str, sans: list[x509.GeneralName], issuer: Issued | None, *, ca: bool = False) -> Issued:
    """A certificate for `cn` valid from 5 minutes ago for a day, signed by `issuer` (itself where
    None), with basic constraints and, where `sans` names any, a subject alternative name: no key
    identifier extensions, as a minimal private CA makes them."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    issuer_name, signing_key = (issuer[0].subject, issuer[1]) if issuer else (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signing_key, hashes.SHA256()), key


def write_pem(directory: Path, name: str, issued: Issued) -> tuple[Path, Path]:
    """`name`.crt and `name`.key (PKCS8, unencrypted) in `directory`."""
    cert, key = issued
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path
