"""Hypothesis profiles: a fixed search in CI, a long one on demand.

- ``ci`` (loaded when ``CI`` is set): ``derandomize=True`` and no example database, so
  every run tries exactly the same examples and a landing never depends on what a
  random search happened to find. Cases a search did find belong in the test as
  ``@example(...)``.
- ``long`` (``HYPOTHESIS_PROFILE=long``, what ``make fuzz`` runs): twenty times the
  examples, a fresh random search each run, and the local database (``.hypothesis/``)
  so a failure found once is tried first next time.
- ``default``: Hypothesis's own settings, for the everyday loop.

``HYPOTHESIS_PROFILE`` picks any of them by name and wins over ``CI``. A test that
sets its own ``max_examples`` writes it as ``scaled(n)``: ``n`` under ``default`` and
``ci``, twenty times ``n`` under ``long``.
"""

from __future__ import annotations

import os

from hypothesis import settings

BASE_EXAMPLES = 100
"""Hypothesis's default ``max_examples``: :func:`scaled` is relative to it."""
LONG_FACTOR = 20

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("long", max_examples=BASE_EXAMPLES * LONG_FACTOR, derandomize=False)
settings.register_profile("default")


def profile_name(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    env = os.environ if env is None else env
    chosen = env.get("HYPOTHESIS_PROFILE", "").strip()
    if chosen:
        return chosen
    return "ci" if env.get("CI") else "default"


def load(env: dict[str, str] | os._Environ[str] | None = None) -> str:
    """Loads the profile :func:`profile_name` picks; returns its name."""
    name = profile_name(env)
    settings.load_profile(name)  # an unknown name fails here, naming the known ones
    return name


def scaled(n: int) -> int:
    """``n`` examples under the loaded profile's budget (see the module docstring)."""
    return max(1, n * settings().max_examples // BASE_EXAMPLES)
