"""Subcommands of the ``splitserve`` command, one module each."""
