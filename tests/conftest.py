import os
import sys

# Make `dist_harness` importable by the test modules and by the spawned ranks.
sys.path.insert(0, os.path.dirname(__file__))
