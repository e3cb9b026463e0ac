"""Envoy external rate-limit service (envoy.service.ratelimit.v3) in Python.

The decision logic lives in :mod:`ratelimit_service.core` (pure, no I/O); storage
backends sit behind :mod:`ratelimit_service.storage`; gRPC, admin HTTP and CLI are
thin adapters around them.
"""

__version__ = "0.1.0"
