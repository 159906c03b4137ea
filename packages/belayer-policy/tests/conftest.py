"""Hypothesis without its per-example deadline: the tests run beside other suites on a loaded
machine, where one example may take far longer than on an idle one (nothing here measures speed)."""

from hypothesis import settings

settings.register_profile("loaded-machine", deadline=None)
settings.load_profile("loaded-machine")
