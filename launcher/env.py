"""Rank discovery lives in the library (`vescale_engine.launch.env`); this name stays for
scripts that imported it from here."""
from vescale_engine.launch.env import LaunchError, Placement, discover  # noqa: F401
