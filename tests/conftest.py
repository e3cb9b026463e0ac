"""The suite's fixtures live in pytest plugins (modules of ratelimit_harness),
which test modules never import for fixtures: they name them as parameters."""

pytest_plugins = [
    "ratelimit_harness.fixtures",
    "ratelimit_harness.envoy_fixtures",
]
