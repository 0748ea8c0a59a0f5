"""Generated gRPC stubs for nnd.v1 (scripts/gen_protos.py); do not edit."""
