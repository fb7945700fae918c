"""What a job listens on: read from /proc for every process of its process group (launcher and ranks)."""

import os
import socket


def listening_addresses() -> set[str]:
    """The addresses every TCP socket in this job's process group (the launcher and its ranks) listens on."""
    group = os.getpgid(0)
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != group:
                continue
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue  # a process that ended meanwhile
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # /proc writes each 32-bit word in host (little-endian) order
                packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(family, packed))
    return found
