"""Who is calling: an API key's tenant, whether the key is listed, whether it is an admin's.

A key is never stored or logged: only its SHA-256 (admission/tenant.py names the tenant by it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from admission.tenant import ANONYMOUS, key_hash, owner_of_hash
from configs.schemas import AuthConfig
from ingress.errors import APIError

_HASH = re.compile(r"^sha256:([0-9a-f]{64})$")


def bearer_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return None


@dataclass(frozen=True, slots=True)
class Caller:
    owner: str  # key-<hash prefix>, or anonymous
    admin: bool


def _hashes(entries: Iterable[str]) -> set[str]:
    out = set()
    for entry in entries:
        entry = entry.strip()
        if entry:
            match = _HASH.match(entry.lower())
            out.add(match.group(1) if match else key_hash(entry))
    return out


class KeyRing:
    """The configured keys, loaded once per ingress replica (YAML, environment, file)."""

    def __init__(self, config: AuthConfig, tenants: Iterable[str] = (), environ: Mapping[str, str] = os.environ) -> None:
        self.required = config.required
        keys = list(config.api_keys) + environ.get(config.keys_env, "").split(",")
        admins = list(config.admin_keys) + environ.get(config.admin_keys_env, "").split(",")
        if config.keys_file:
            for line in Path(config.keys_file).read_text().splitlines():
                words = line.split("#", 1)[0].split()
                if words:
                    (admins if words[1:] == ["admin"] else keys).append(words[0])
        self._admins = _hashes(admins)
        self._keys = _hashes(keys) | self._admins
        # Tenants named in admission.tenants are listed too: they have limits of their own.
        self._listed_owners = {owner_of_hash(h) for h in self._keys} | {t for t in tenants if t != "default"}
        if self.required and not self._keys:
            raise ValueError(
                f"auth.required is on but no key is configured: set auth.api_keys, auth.keys_file or ${config.keys_env}"
            )

    def identify(self, headers: Mapping[str, str]) -> Caller:
        """The caller, or a 401 where keys are required and this one is missing or unknown."""
        key = bearer_key(headers)
        digest = key_hash(key) if key is not None else None
        if self.required and digest not in self._keys:
            raise APIError(
                401,
                "missing API key: send `Authorization: Bearer <key>`" if key is None else "incorrect API key provided",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if digest is None:
            return Caller(ANONYMOUS, False)
        return Caller(owner_of_hash(digest), digest in self._admins)

    def owners(self) -> set[str]:
        """Tenant ids with rate limits of their own (every other caller shares one bucket)."""
        return set(self._listed_owners)
