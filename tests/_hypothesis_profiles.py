"""Hypothesis profiles of the property-based tests.

``default``: a short, derandomised run (the same examples every time), for CI.
``fuzz``: a long randomised run, for ``nox -s fuzz``. Chosen by the
environment variable ``POLYATTN_HYPOTHESIS_PROFILE`` (default ``default``).
Import this module at the top of a test module that uses hypothesis.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_VARIABLE = "POLYATTN_HYPOTHESIS_PROFILE"

# Backend fixtures are function-scoped but hold no per-example state.
_SUPPRESSED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
               HealthCheck.data_too_large]

settings.register_profile("default", max_examples=15, deadline=None, derandomize=True,
                          database=None, print_blob=True, suppress_health_check=_SUPPRESSED)
settings.register_profile("fuzz", max_examples=500, deadline=None, print_blob=True,
                          suppress_health_check=_SUPPRESSED)
settings.load_profile(os.environ.get(PROFILE_VARIABLE, "default"))
