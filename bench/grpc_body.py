"""Write a gRPC-framed ShouldRateLimit request body for h2load (-d FILE).

python bench/grpc_body.py out.bin --domain edge --descriptor remote_address=10.0.0.1
"""

from __future__ import annotations

import argparse
import struct

from ratelimit_service.client import build_request


def framed(domain: str, descriptors: list[str], hits_addend: int = 0) -> bytes:
    message = build_request(domain, descriptors, hits_addend).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--domain", required=True)
    parser.add_argument("--descriptor", action="append", required=True)
    args = parser.parse_args()
    with open(args.out, "wb") as handle:
        handle.write(framed(args.domain, args.descriptor))
