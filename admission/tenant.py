"""Print the tenant id of an API key, for `admission.tenants` in serve_config.yaml.

    python -m admission.tenant sk-...        ->  key-0123456789abcdef

Only a hash of the key is ever stored or logged.
"""

from __future__ import annotations

import sys

from ingress.context import tenant_from_headers


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(tenant_from_headers({"authorization": f"Bearer {argv[0]}"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
