# SPDX-License-Identifier: Apache-2.0
"""The package's version: the C library's (include/kvwire.h's
KVW_VERSION_MAJOR/MINOR/PATCH) and pyproject.toml's: python/tests/test_config.py
and test_binding.py check the three agree."""

__version__ = "1.5.0"
