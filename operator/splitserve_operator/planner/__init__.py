"""The SLO-driven planner: a pure function from one tick's observations to prefill and
decode replica counts, each with a reason (:func:`.core.plan`; values in and out in
:mod:`.model`, knobs in :mod:`.config`). No I/O (enforced by ``.importlinter``); time
is passed in. With switchable workers, :func:`.flex.rebalance` adds whether one changes
role instead of a pool scaling up (the policy itself is the contract's
:mod:`splitserve.role_balance`). May import :mod:`splitserve_operator.api` and the
contract package only.
"""
