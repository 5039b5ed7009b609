"""Secrets the egress proxy adds to requests, so that their values never enter a sandbox.

``SANDBOX_SECRETS_FILE`` is a TOML file (read by the standard library's ``tomllib``; one
table per secret, the table's name is the environment variable the sandbox sees)::

    [secrets.EXAMPLE_API_KEY]
    value = "sk-live-..."                          # the real value: only the proxy sees it
    hosts = ["api.example.com", "*.example.net"]   # names as in SANDBOX_NETWORK_ALLOW
    header = "Authorization: Bearer {value}"       # optional; this is the default

Inside the sandbox ``EXAMPLE_API_KEY`` holds a placeholder (:func:`placeholder`). On a
connection to one of the secret's hosts the proxy terminates TLS and, in every request,
sets the template's header from the template when the request lacks that header or
carries the placeholder in it; a header the code set to something else is left alone.
The value goes nowhere else: not to other hosts (their traffic is never decrypted),
not into other headers, bodies or URLs, not into logs (only names are logged).

The file should be readable by the server's user only; a file others may read is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets as random
import stat
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mcp_code_sandbox.errors import InvalidArgument

from .policy import normalize_host

__all__ = [
    "DEFAULT_HEADER",
    "Secret",
    "SecretsFileError",
    "load_secrets",
    "parse_secrets",
    "placeholder",
    "placeholder_env",
    "secrets_for",
]

DEFAULT_HEADER = "Authorization: Bearer {value}"
MAX_FILE_BYTES = 1024 * 1024
MAX_VALUE_BYTES = 16 * 1024
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}")
#: The key placeholders are derived with when the caller gives none: random per process.
_PROCESS_KEY = random.token_bytes(32)


class SecretsFileError(InvalidArgument):
    """The secrets file is missing, unreadable, too open or not of the documented form.
    The message names the file and the secret, never a value."""


@dataclass(frozen=True)
class Secret:
    """One secret. ``repr`` never shows ``value``. ``placeholder`` is what the sandbox
    sees in the environment variable ``name``."""

    name: str
    value: str = field(repr=False)
    hosts: tuple[str, ...]
    header: str = DEFAULT_HEADER
    placeholder: str = ""

    @property
    def header_name(self) -> str:
        """``Authorization`` of ``Authorization: Bearer {value}``."""
        return self.header.split(":", 1)[0].strip()

    def header_value(self) -> str:
        """The header's value with the secret in it (only the proxy calls this)."""
        return self.header.split(":", 1)[1].strip().replace("{value}", self.value)

    def is_for(self, host: str) -> bool:
        """Whether requests to ``host`` (normalized) get this secret."""
        return any(
            pattern == host or (pattern.startswith("*.") and host.endswith(pattern[1:]))
            for pattern in self.hosts
        )


def placeholder(secret: Secret) -> str:
    """The stand-in the sandbox sees for ``secret``: random-looking, stable for this
    server (derived with the key :func:`load_secrets` was given), unique per name."""
    return secret.placeholder


def placeholder_env(secrets: Iterable[Secret]) -> dict[str, str]:
    """The sandbox's environment entries for ``secrets``: name -> placeholder."""
    return {secret.name: secret.placeholder for secret in secrets}


def secrets_for(secrets: Iterable[Secret], host: str) -> list[Secret]:
    """The secrets whose hosts include ``host`` (normalized)."""
    return [secret for secret in secrets if secret.is_for(host)]


def load_secrets(path: Path, *, key: bytes | None = None) -> tuple[Secret, ...]:
    """Read and check the secrets file (blocking: call it at start or in a thread).

    ``key``: what placeholders are derived from; give a key kept across restarts (the
    state dir's) so that a sandbox that outlives a restart keeps working placeholders.
    None: a random key of this process. Raises :class:`SecretsFileError`.
    """
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise SecretsFileError(f"secrets file {path} is not a regular file")
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretsFileError(
                f"secrets file {path} may be read by others (mode {stat.S_IMODE(info.st_mode):o}); "
                f"chmod 600 {path}"
            )
        if info.st_size > MAX_FILE_BYTES:
            raise SecretsFileError(f"secrets file {path} is larger than {MAX_FILE_BYTES} bytes")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SecretsFileError(f"secrets file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        # The decoder's message names a line and column, never the text there.
        raise SecretsFileError(f"secrets file {path} is not valid TOML: {exc}") from None
    return parse_secrets(data, key=key, source=str(path))


def parse_secrets(
    data: Mapping[str, object], *, key: bytes | None = None, source: str = "secrets"
) -> tuple[Secret, ...]:
    """Check a parsed secrets file (``{"secrets": {NAME: {value, hosts, header?}}}``)."""
    unknown = set(data) - {"secrets"}
    if unknown:
        raise SecretsFileError(
            f"{source}: unknown top-level keys {sorted(unknown)}; expected [secrets.NAME] tables"
        )
    tables = data.get("secrets", {})
    if not isinstance(tables, dict):
        raise SecretsFileError(f"{source}: 'secrets' must be a table of [secrets.NAME] tables")
    found = [_one(name, table, key or _PROCESS_KEY, source) for name, table in tables.items()]
    return tuple(found)


def _one(name: str, table: object, key: bytes, source: str) -> Secret:
    where = f"{source}: secret {name}"
    if not _ENV_NAME.fullmatch(name):
        raise SecretsFileError(f"{where}: the name must be an environment variable name")
    if not isinstance(table, dict):
        raise SecretsFileError(f"{where}: must be a table with value, hosts and header")
    unknown = set(table) - {"value", "hosts", "header"}
    if unknown:
        raise SecretsFileError(f"{where}: unknown keys {sorted(unknown)} (value, hosts, header)")
    value = table.get("value")
    if not isinstance(value, str) or not value:
        raise SecretsFileError(f"{where}: 'value' must be a non-empty string")
    if len(value.encode()) > MAX_VALUE_BYTES or any(c in value for c in "\r\n\0"):
        raise SecretsFileError(
            f"{where}: 'value' must be one line of at most {MAX_VALUE_BYTES} bytes"
        )
    return Secret(
        name=name,
        value=value,
        hosts=_hosts(table.get("hosts"), where),
        header=_header(table.get("header", DEFAULT_HEADER), where),
        placeholder=_derive(name, key),
    )


def _hosts(hosts: object, where: str) -> tuple[str, ...]:
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise SecretsFileError(f"{where}: 'hosts' must be a non-empty list of host names")
    checked: list[str] = []
    for host in hosts:
        wildcard = host.strip().startswith("*.")
        try:
            name = normalize_host(host.strip()[2:] if wildcard else host)
        except ValueError:
            raise SecretsFileError(f"{where}: {host!r} is not a host name or *.name") from None
        checked.append(f"*.{name}" if wildcard else name)
    return tuple(checked)


def _header(header: object, where: str) -> str:
    if not isinstance(header, str) or ":" not in header or "{value}" not in header:
        raise SecretsFileError(
            f"{where}: 'header' must look like 'Name: text with {{value}}', e.g. {DEFAULT_HEADER!r}"
        )
    name, _, rest = header.partition(":")
    if not _HEADER_NAME.fullmatch(name.strip()) or any(c in rest for c in "\r\n\0"):
        raise SecretsFileError(f"{where}: 'header' has an invalid header name or a line break")
    return f"{name.strip()}: {rest.strip()}"


def _derive(name: str, key: bytes) -> str:
    digest = hmac.new(key, b"mcs-secret-placeholder:" + name.encode(), hashlib.sha256)
    return "mcsph_" + digest.hexdigest()[:40]
