import os
import sys

# Make `dist_harness` importable by the test modules and by the spawned ranks.
sys.path.insert(0, os.path.dirname(__file__))

# The suite trains CPU models on gloo, also on a GPU machine (where the engine would pick
# NCCL): the engine, `vescale run` and every rank or script started from a test (they inherit
# this environment) use gloo unless the caller says otherwise.
os.environ.setdefault("VESCALE_BACKEND", "gloo")
