# The rate-limit service. Build: docker build -t ratelimit-service:0.1.0 .
# Run:   docker run -p 8081:8081 -p 6070:6070 ratelimit-service:0.1.0
#        (the example rules in config/ are baked in at /etc/ratelimit; mount your own there)
# As envoyproxy/ratelimit: the command /bin/ratelimit reads the Go service's environment
# (RUNTIME_ROOT, REDIS_URL, PORT, ...; docs/settings.md), so Envoy Gateway's
# rateLimitDeployment or a Go service's pod spec runs it unchanged.

# Build the wheels in a throw-away stage so the runtime image has no compiler caches or
# source tree, only the installed package.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ratelimit_service ./ratelimit_service
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && ln -s "$(command -v ratelimit)" /bin/ratelimit \
    && useradd --system --uid 10001 --no-create-home ratelimit
COPY config/ /etc/ratelimit/
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
EXPOSE 8081 6070 8080
# Our default command's admin port (6070), else the Go command's HTTP port (8080).
HEALTHCHECK --interval=5s --timeout=3s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u\nfor p in (6070, 8080):\n  try: u.urlopen(f'http://127.0.0.1:{p}/healthcheck', timeout=2); break\n  except OSError: pass\nelse: raise SystemExit(1)"]
# Flags, not ENV, so that /bin/ratelimit (which takes its settings from the Go service's
# variables, ours winning) is not steered by them. Listen on every interface: in a
# container the admin port must be reachable by probes.
ENTRYPOINT ["ratelimit-service"]
CMD ["serve", "--config", "/etc/ratelimit", "--grpc-addr", "0.0.0.0:8081", "--admin-addr", "0.0.0.0:6070"]
