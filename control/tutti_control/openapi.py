"""The admin API's OpenAPI schema as committed in docs/openapi.json.

``python -m tutti_control.openapi > docs/openapi.json`` writes it again after a change to the
routes or models; ``tests/test_admin.py`` fails while the committed file differs.
"""

from __future__ import annotations

import json
from typing import Any


def schema() -> dict[str, Any]:
    from tutti_control.app import create_app

    # The schema does not depend on the backend or the token: routes and models make it.
    return create_app(backend=None, token="-").openapi()  # type: ignore[arg-type]


def text() -> str:
    return json.dumps(schema(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(text(), end="")
