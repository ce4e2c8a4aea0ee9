import os
import sys

# Test helpers (paged_case.py) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
