"""Hostfiles: read the formats people already have, check them before any launcher sees them,
and write them back in the format `mpirun` and the `deepspeed` launcher read.

Accepted lines (one host each; `#` starts a comment):
    node1 slots=8            DeepSpeed and Open MPI (Open MPI's max_slots=M is accepted too)
    node1:8                  MPICH/Intel MPI
    node1                    one slot
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_OPEN_MPI_OR_DEEPSPEED = re.compile(r"^(\S+?)((?:\s+\w+=\S+)*)$")
_MPICH = re.compile(r"^([^\s:]+):(\S+)$")


class HostfileError(ValueError):
    """A hostfile that cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def read_hostfile(path: str) -> list:
    """Hosts in file order; a one-line error naming the file and line for anything else."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise HostfileError(f"hostfile {path} not found") from None
    except (OSError, UnicodeDecodeError) as err:
        raise HostfileError(f"hostfile {path} cannot be read: {err}") from None
    hosts = {}
    for number, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{number}"
        host = _parse_line(line, where)
        if host.name in hosts:
            raise HostfileError(f"{where}: host {host.name!r} is listed twice "
                                f"(first on line {hosts[host.name][0]})")
        hosts[host.name] = (number, host)
    if not hosts:
        raise HostfileError(f"hostfile {path} lists no hosts")
    return [host for _, host in hosts.values()]


def _parse_line(line: str, where: str) -> Host:
    mpich = _MPICH.match(line)
    if mpich:
        return Host(mpich.group(1), _slots(mpich.group(2), where, line))
    match = _OPEN_MPI_OR_DEEPSPEED.match(line)
    if not match:
        raise HostfileError(f"{where}: cannot read {line!r}: expected 'HOST slots=N', "
                            "'HOST:N' or 'HOST'")
    name, slots = match.group(1), 1
    if "=" in name:
        raise HostfileError(f"{where}: {line!r} starts with a field, not a host name")
    for field in match.group(2).split():
        key, value = field.split("=", 1)
        if key == "slots":
            slots = _slots(value, where, line)
        elif key == "max_slots":  # Open MPI's cap on oversubscription: checked, not needed
            _slots(value, where, line)
        else:
            raise HostfileError(f"{where}: unknown field {key!r} in {line!r}: expected "
                                "slots=N (or Open MPI's max_slots=M)")
    return Host(name, slots)


def _slots(text: str, where: str, line: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise HostfileError(f"{where}: slots must be a positive integer, got {text!r} in "
                            f"{line!r}")
    return int(text)


def write_hostfile(hosts: list, path: str) -> None:
    """`HOST slots=N` per line: the one format both Open MPI and DeepSpeed read."""
    with open(path, "w", encoding="utf-8") as f:
        for host in hosts:
            f.write(f"{host.name} slots={host.slots}\n")


def is_local(name: str) -> bool:
    """A name that always means this machine."""
    import socket
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname())
