"""Tools to run real service fleets against a real Redis, for tests and benchmarks.

Not used by the service itself.
"""
