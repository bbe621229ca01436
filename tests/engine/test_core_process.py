"""What the engine process sends back about an error, in this process (no process is started).

Proves: an error that survives pickling is sent as it is; one that cannot be pickled becomes a
``RuntimeError`` with its message, or with its type's name when it has no message, so the front
end can always say what failed.
Run: pytest tests/engine/test_core_process.py
"""

from __future__ import annotations

from pieceworks.engine.core_process import _portable


class UnpicklableError(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle this error")


def test_an_error_is_sent_as_it_is_or_as_its_message():
    error = ValueError("bad checkpoint")
    assert _portable(error) is error
    for unpicklable, message in [
        (UnpicklableError("out of memory"), "out of memory"),
        (UnpicklableError(), "UnpicklableError"),
    ]:
        portable = _portable(unpicklable)
        assert type(portable) is RuntimeError and str(portable) == message
