# SPDX-License-Identifier: Apache-2.0
"""Run the tests from the source tree without installing: python/ goes on
sys.path; libkvwire is $KVWIRE_LIB (make python-test sets it to the build
directory's), else the loader's usual search."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
