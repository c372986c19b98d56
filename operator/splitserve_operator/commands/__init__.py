"""The operator side's ``splitserve`` subcommands, thin: ``splitserve operator``
(:mod:`.operator`, also ``python -m splitserve_operator``) and ``splitserve advise``
(:mod:`.advise`). Each module has ``add_arguments(parser)`` and ``run(args)``; the
contract's dispatcher (:mod:`splitserve.cli`) finds them by entry point.

May import every room of the operator; ``advise`` only the simulator (it must run
without kopf), ``operator`` the control room only when it runs.
"""
