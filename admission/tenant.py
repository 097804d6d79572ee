"""A tenant is named by its API key's hash, never by the key.

    python -m admission.tenant sk-...   ->  tenant key-0123456789abcdef
                                            auth    sha256:0123456789abcdef...

The tenant id goes under `admission.tenants` in serve_config.yaml (limits, tier); the hash goes
under `auth.api_keys` / `auth.admin_keys`.
"""

from __future__ import annotations

import hashlib
import sys

ANONYMOUS = "anonymous"  # the tenant of requests without a key (where keys are not required)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def owner_of_hash(digest: str) -> str:
    """The tenant id of a key's hash: its first 16 hex digits."""
    return "key-" + digest[:16]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    digest = key_hash(argv[0])
    print(f"tenant {owner_of_hash(digest)}\nauth    sha256:{digest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
