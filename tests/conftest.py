"""pytest configuration shared by all tests: hypothesis profiles and the ``provider`` fixture."""

import os

import pytest
from hypothesis import settings

import tests.strategies  # noqa: F401  (registers the hypothesis profiles)
from amxopt.ops import native

# "ci" by default: derandomized, 25 examples, no deadline. HYPOTHESIS_PROFILE=dev for a deeper run.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Every kernel family a test using ``provider`` runs on: the reference, and each tier of the native
# kernels. A tier this CPU cannot run is a skip that names the missing instructions.
KERNELS = ("reference", *(f"native-{tier}" for tier in native.TIERS))


@pytest.fixture(autouse=True, scope="session")
def _own_cache_dir(tmp_path_factory):
    """amxopt's on-disk caches (kernel choices, graphs) in a directory of this test session: tests
    neither read a user's cache nor leave entries in it."""
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if previous is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(params=KERNELS)
def provider(request):
    """The provider name to pass to the ops, with the native tier capped as the param says."""
    if request.param == "reference":
        yield "reference"
        return
    loaded, why = native.available()
    assert loaded, f"the native kernels must build on this machine: {why}"
    tier = request.param.removeprefix("native-")
    ok, why = native.tier_supported(tier)
    if not ok:
        pytest.skip(f"tier {tier} cannot run here: {why}")
    with native.max_tier(tier):
        assert native.active_tier() == tier
        yield "native"
