#!/bin/sh
# Regenerate rls_conf_pb2.py and rls_conf_pb2.pyi from rls_conf.proto.
#
# grpcio-tools is a build-time tool, not a dependency: install it anywhere, e.g.
#   python -m venv /tmp/protoc && /tmp/protoc/bin/pip install grpcio-tools==1.75.0
#   PYTHON=/tmp/protoc/bin/python sh ratelimit_service/config/regenerate_rls_conf.sh
# 1.75.0 bundles protoc 31.1, whose gencode needs protobuf >= 6.31.1 at run time,
# the same floor as xds-protos; a newer grpcio-tools would raise that floor.
#
# The proto is compiled from the repository root so its descriptor-pool file name is
# ratelimit_service/config/rls_conf.proto and the module is
# ratelimit_service.config.rls_conf_pb2 (no clash with the envoy namespace).
set -eu
cd "$(dirname "$0")/../.."
"${PYTHON:-python}" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
    ratelimit_service/config/rls_conf.proto
