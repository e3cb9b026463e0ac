# The rate-limit service. Build: docker build -t ratelimit-service:0.1.0 .
# Run:   docker run -p 8081:8081 -p 6070:6070 ratelimit-service:0.1.0
#        (the example rules in config/ are baked in at /etc/ratelimit; mount your own there)

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
    && useradd --system --uid 10001 --no-create-home ratelimit
COPY config/ /etc/ratelimit/
# Listen on every interface: in a container the admin port must be reachable by probes
# (the service's own default admin address is 127.0.0.1).
ENV RATELIMIT_CONFIG=/etc/ratelimit \
    RATELIMIT_GRPC_ADDR=0.0.0.0:8081 \
    RATELIMIT_ADMIN_ADDR=0.0.0.0:6070 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
EXPOSE 8081 6070
HEALTHCHECK --interval=5s --timeout=3s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:6070/healthcheck', timeout=2)"]
ENTRYPOINT ["ratelimit-service"]
CMD ["serve"]
