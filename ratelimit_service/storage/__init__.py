"""Storage backends behind one small seam (:class:`~ratelimit_service.storage.base.Store`)."""
