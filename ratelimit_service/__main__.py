"""Allow ``python -m ratelimit_service``."""

from ratelimit_service.cli.main import main

raise SystemExit(main())
