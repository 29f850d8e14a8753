# SPDX-License-Identifier: Apache-2.0
"""The package's version: the C library's (include/kvwire.h's
KVW_VERSION_MAJOR/MINOR/PATCH; python/tests/test_config.py checks they
agree). pyproject.toml reads it from here."""

__version__ = "1.5.0"
