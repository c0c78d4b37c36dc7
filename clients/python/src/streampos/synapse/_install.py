"""``install()``: make Synapse construct ``StreamposIdGenerator``.

Every store module of ``synapse.storage.databases.main`` imports
``MultiWriterIdGenerator`` by name and constructs it in its ``__init__``;
``install()`` imports them all and rebinds that name, in every module of
Synapse that binds Synapse's class, to ``StreamposIdGenerator``. Synapse
checks generators with ``isinstance(…, MultiWriterIdGenerator)`` (the to-device
replication handler, some of its tests), so the replacement is also registered
as a virtual subclass of Synapse's class. The class's own module keeps
Synapse's class: it is what the replacement falls back to on SQLite, and what
Synapse's unit tests of the class itself test.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import threading
from typing import List

_EXPECTED_PARAMETERS = (
    "db_conn",
    "db",
    "notifier",
    "stream_name",
    "server_name",
    "instance_name",
    "tables",
    "sequence_name",
    "writers",
    "positive",
)

_lock = threading.Lock()
_installed: List[str] = []


def _check_signature(cls: type) -> None:
    params = inspect.signature(cls.__init__).parameters
    names = tuple(name for name in params if name != "self")
    keyword_only = all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names)
    if names != _EXPECTED_PARAMETERS or not keyword_only:
        raise RuntimeError(
            "this Synapse's MultiWriterIdGenerator takes "
            f"{names} (keyword-only: {keyword_only}); streampos.synapse replaces the one of "
            f"matrix-synapse 1.163.2, which takes {_EXPECTED_PARAMETERS}"
        )


def install() -> List[str]:
    """Replace Synapse's ``MultiWriterIdGenerator`` with
    ``StreamposIdGenerator`` wherever Synapse binds it. Call it before the
    homeserver is built (the launcher ``python -m streampos.synapse`` does).
    Idempotent. Returns the modules whose binding it replaced."""
    with _lock:
        if _installed:
            return list(_installed)
        from synapse.storage.util import id_generators

        from .generator import SYNAPSE_MULTI_WRITER_ID_GENERATOR, StreamposIdGenerator

        stock = SYNAPSE_MULTI_WRITER_ID_GENERATOR
        _check_signature(stock)
        stock.register(StreamposIdGenerator)

        import synapse.storage.databases.main as main

        for info in pkgutil.walk_packages(main.__path__, main.__name__ + "."):
            importlib.import_module(info.name)

        replaced = []
        for name, module in list(sys.modules.items()):
            if module is None or module is id_generators:
                continue
            if name != "synapse" and not name.startswith("synapse."):
                continue
            if getattr(module, "MultiWriterIdGenerator", None) is stock:
                setattr(module, "MultiWriterIdGenerator", StreamposIdGenerator)
                replaced.append(name)
        if not any(name.startswith(main.__name__ + ".") for name in replaced):
            raise RuntimeError("no module of synapse.storage.databases.main binds MultiWriterIdGenerator")
        _installed.extend(sorted(replaced))
        return list(_installed)


def installed() -> List[str]:
    """The modules ``install()`` rebound (empty before it ran)."""
    return list(_installed)
