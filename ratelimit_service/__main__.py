"""Allow ``python -m ratelimit_service``."""

from ratelimit_service.cli import main

raise SystemExit(main())
