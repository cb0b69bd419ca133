"""What the bench programs share: where the release binary is, free ports, and a
process's resident set and CPU time from /proc."""

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDEMPROXY = os.path.join(ROOT, "target", "release", "idemproxy")
TICK = os.sysconf("SC_CLK_TCK")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_kib(pid):
    """The resident set of process `pid`, in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid):
    """User and system CPU time of process `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK
