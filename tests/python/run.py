#!/usr/bin/python3
"""Runs the Python package's pytest suite (what ctest's python.pytest calls). Exits 77
(ctest: skipped) when pytest is not installed; tests that need numpy or torch skip
themselves when those are missing."""
import os
import sys

try:
    import pytest
except ImportError:
    print("python.pytest: skipped: pytest is not installed (Debian: python3-pytest)")
    sys.exit(77)

here = os.path.dirname(os.path.abspath(__file__))
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", here] + sys.argv[1:]))
