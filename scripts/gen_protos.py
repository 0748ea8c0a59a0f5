"""Generate the Python gRPC stubs in pyclient/nnd/v1 from protos/.

Run after changing any .proto; `--check` (run by CI) fails if the committed
stubs differ from what the protos generate.
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "pyclient"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc  # build-time tool only

    files = sorted(PROTOS.glob("nnd/v1/*.proto"))
    args = ["protoc", f"-I{PROTOS}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main(args + [str(f) for f in files]) != 0:
        sys.exit("protoc failed")
    return sorted((out / "nnd" / "v1").glob("*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(pathlib.Path(tmp))
        target = OUT / "nnd" / "v1"
        if ns.check:
            stale = [
                f.name
                for f in fresh
                if not (target / f.name).exists() or not filecmp.cmp(f, target / f.name, shallow=False)
            ]
            if stale:
                sys.exit(f"stubs out of date with protos/: {', '.join(stale)}; run python scripts/gen_protos.py")
            print("stubs match protos/")
            return
        target.mkdir(parents=True, exist_ok=True)
        for f in fresh:
            shutil.copy(f, target / f.name)
        # __init__.py, address.py, contract.py and shm.py beside them are written by hand.
        print(f"wrote {len(fresh)} files to {target}")


if __name__ == "__main__":
    main()
