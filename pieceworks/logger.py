"""The ``pieceworks`` logger: one handler on the package's root logger, level from the environment.

``init_logger(__name__)`` is what every module calls. Configuration happens on the first call, not
at import, and only touches the ``pieceworks`` logger (never the root logger of the application).
"""

from __future__ import annotations

import logging

from pieceworks import envs

_ROOT_NAME = "pieceworks"
_configured = False


def _configure_root() -> None:
    global _configured
    root = logging.getLogger(_ROOT_NAME)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter(
                "%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%H:%M:%S"
            )
        )
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(envs.PIECEWORKS_LOGGING_LEVEL)
    _configured = True


def init_logger(name: str) -> logging.Logger:
    """Return the logger for module ``name``, configuring the package logger once."""
    if not _configured:
        _configure_root()
    return logging.getLogger(name)
