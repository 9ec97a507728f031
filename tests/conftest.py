"""Suite-wide settings, applied before any test module imports grpc.

The tests start daemons with subprocess.Popen from a process that also talks
gRPC (test clients).  With gRPC's fork support on, the child forked by Popen
restarts gRPC's poller before exec, finds its epoll fd closed and aborts
(SIGABRT, "epoll_wait error: Bad file descriptor").  This process never needs
gRPC in a forked child, so fork support is off.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
