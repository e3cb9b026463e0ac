"""Real processes for tests and benchmarks: Redis, service fleets, Envoy, a TCP forwarder,
an xDS server, OTLP receivers, Prometheus, a browser, certificates; and the suite's pytest
plugins. A distribution of its own (harness/pyproject.toml): the service never imports it
and its wheel does not carry it.
"""
