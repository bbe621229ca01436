"""A request's id is what ``uuid.uuid4().hex`` gives: 32 hex digits of a version-4 RFC 4122
UUID, a new one each time.

Run: ``pytest tests/entrypoints/test_serve_request_id.py -q``
"""

from __future__ import annotations

import uuid

from pieceworks.entrypoints.serve.generation import random_request_id


def test_request_ids_are_uuid4_hex():
    ids = {random_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    for request_id in ids:
        parsed = uuid.UUID(hex=request_id)
        assert parsed.hex == request_id and len(request_id) == 32
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
