"""The suite's fixtures live in pytest plugins (modules of ratelimit_service.testing),
which test modules never import for fixtures: they name them as parameters."""

pytest_plugins = [
    "ratelimit_service.testing.fixtures",
    "ratelimit_service.testing.envoy_fixtures",
]
