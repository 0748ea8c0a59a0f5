"""`nnd serve` with the in-process engine (nnd_daemon/inprocess.py): the daemon's workers and
helper serve from threads of this one process. Run as `python inprocess_daemon.py serve ARGS`
(the arguments of `nnd serve`); tests start it through tests/support/daemonproc.py."""

from __future__ import annotations

import sys

from nnd.cli import build_parser
from nnd_daemon.control import cli_serve
from nnd_daemon.inprocess import PROCESSES

if __name__ == "__main__":
    sys.exit(cli_serve.run(build_parser().parse_args(sys.argv[1:]), processes=PROCESSES))
