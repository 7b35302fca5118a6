"""Imported at start by every interpreter the test suite runs (tests/conftest.py puts this folder
on PYTHONPATH): see import_cache.py."""

import import_cache  # noqa: F401
