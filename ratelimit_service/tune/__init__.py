"""``ratelimit-service tune``: limits proposed from the traffic Prometheus observed."""
