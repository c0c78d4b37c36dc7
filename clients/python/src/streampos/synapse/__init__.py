"""Synapse on streampos: a drop-in replacement for Synapse's
``MultiWriterIdGenerator`` (``pip install 'streampos[synapse]'``).

- :class:`StreamposIdGenerator`: the keyword-only constructor of Synapse's
  ``MultiWriterIdGenerator`` (matrix-synapse 1.163.2), allocating with the
  extension in Synapse's own transactions and connections.
- :func:`install`: make every store of Synapse construct it.
- ``python -m streampos.synapse synapse.app.homeserver -c homeserver.yaml``
  (or ``synapse.app.generic_worker``): install, then run Synapse's entry
  point.

See clients/python/README.md, "Synapse".
"""

from ._install import install, installed
from ._sessions import HoldLostError, RegistrationError
from .generator import StreamposIdGenerator

__all__ = ["HoldLostError", "RegistrationError", "StreamposIdGenerator", "install", "installed"]
