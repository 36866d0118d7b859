"""pytest configuration shared by all tests."""

import os

from hypothesis import settings

import tests.strategies  # noqa: F401  (registers the hypothesis profiles)

# "ci" by default: derandomized, 25 examples, no deadline. HYPOTHESIS_PROFILE=dev for a deeper run.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
