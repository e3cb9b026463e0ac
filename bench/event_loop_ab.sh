#!/usr/bin/env bash
# Side-by-side req/s of the null server on asyncio's loop, the null server on uvloop, and
# the service (probabilistic, one descriptor, default event loop = uvloop when installed),
# 3 rotated rounds of h2load each. Run from the repository root:
#     bash bench/event_loop_ab.sh
set -euo pipefail
PY=${PYTHON:-python}
U=/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$tmp"' EXIT
printf 'domain: bench\ndescriptors:\n  - key: p\n    mode: probabilistic\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n' > "$tmp/rules.yaml"
$PY bench/grpc_body.py "$tmp/body.bin" --domain bench --descriptor p=1
port() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
p1=$(port); p2=$(port); p3=$(port); a3=$(port)
$PY bench/null_server.py --port "$p1" >/dev/null 2>&1 &
$PY bench/null_server.py --port "$p2" --uvloop >/dev/null 2>&1 &
$PY -m ratelimit_service serve --config "$tmp/rules.yaml" --grpc-addr "127.0.0.1:$p3" \
    --admin-addr "127.0.0.1:$a3" >/dev/null 2>&1 &
sleep 3
H=(h2load -c 8 -m 8 -t 1 -D 4 -H 'content-type: application/grpc' -H 'te: trailers' -d "$tmp/body.bin")
rps() { "${H[@]}" "http://127.0.0.1:$1$U" | awk '/finished in/ {print $4}'; }
for p in "$p1" "$p2" "$p3"; do rps "$p" >/dev/null; done  # warm up
for round in 1 2 3; do
    echo "round $round: null(asyncio)=$(rps "$p1") null(uvloop)=$(rps "$p2") service=$(rps "$p3") req/s"
done
