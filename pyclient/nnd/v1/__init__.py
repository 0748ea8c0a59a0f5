"""nnd.v1, the wire contract: the gRPC stubs generated from protos/nnd/v1 (`*_pb2*.py`, `*.pyi`:
scripts/gen_protos.py writes them; do not edit) and, beside them, the hand-written parts of the
contract that are not messages: contract.py (metadata keys, data methods, message size, trailers,
step selectors), address.py (where the daemon listens) and shm.py (shared-memory result regions)."""
