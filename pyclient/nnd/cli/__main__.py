"""`python -m nnd.cli`: the `nnd` command."""

from nnd.cli import main

raise SystemExit(main())
