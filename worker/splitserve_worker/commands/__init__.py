"""Subcommands of the ``splitserve`` command, one module each, and :mod:`.tls_flags`, the
TLS flags that ``worker``, ``router`` and ``up`` share."""
