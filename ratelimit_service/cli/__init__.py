"""The command line. gRPC's core logs to stderr on its own (a failed bind, before
our one-line message); the commands speak for themselves, so its log is off unless
GRPC_VERBOSITY asks for it. Set here, before any module imports grpc."""

import os

os.environ.setdefault("GRPC_VERBOSITY", "NONE")
