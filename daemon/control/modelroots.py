"""Where this daemon lets local models be read from (`--model-root`, `--allow-model`), as the
policy its helper and workers apply to every file (daemon/modelfiles.py)."""

from __future__ import annotations

import os

from nnd_daemon import errors, modelfiles
from nnd_daemon.control.auth import Access
from nnd_daemon.control.settings import Settings


def policy(settings: Settings, access: Access) -> modelfiles.Policy:
    roots = tuple(os.path.realpath(r) for r in settings.model_roots)
    return modelfiles.Policy(
        roots=roots,
        allow=tuple(settings.allow_models),
        public=not roots and others_can_call(settings, access),
        store=os.path.realpath(os.path.join(settings.state_dir, "uploads")),
    )


def others_can_call(settings: Settings, access: Access) -> bool:
    """Whether the daemon is set up for users other than its own: a TCP listener, or a socket group
    named for them (gRPC does not tell a server its caller's uid). The default socket belongs to
    the daemon's own primary group; counting that group's members instead would depend on what
    /etc/passwd happens to list (gid 0 has `operator` on some systems)."""
    return bool(access.listen) or bool(settings.socket_group)


def check_folder(settings: Settings, name: str) -> None:
    """Refuse a local folder outside the model roots before anything of it is read (the helper and
    the workers check each file again, with links resolved)."""
    if not settings.model_roots or not os.path.isabs(name):
        return
    roots = [os.path.realpath(r) for r in settings.model_roots]
    if not any(modelfiles.inside(name, r) for r in roots):
        raise errors.PermissionDenied(f"{name} is outside this daemon's model roots ({', '.join(roots)})")
