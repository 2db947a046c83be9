"""Where this process is and how it joins the others: rank discovery from every launcher (env,
torch-free: launcher/ imports it), each rank's backend and device (device), joining and leaving
the process group (process_group) after meeting on the job's store (rendezvous), one failing
rank stopping the others (failfast), one-line collective timeouts (collective_timeout). Must
not know about models, sharding or the config; only the engine and launcher/ import it.
"""
from .env import LaunchError, Placement, discover

__all__ = ["LaunchError", "Placement", "discover"]
