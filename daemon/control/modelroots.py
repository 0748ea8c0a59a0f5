"""Where this daemon lets local models be read from (`--model-root`, `--allow-model`), as the
policy its helper and workers apply to every file (daemon/modelfiles.py)."""

from __future__ import annotations

import grp
import os
import pwd

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
    """Whether a user other than the daemon's own may call it: over TCP, or through a socket group
    that has other members (gRPC does not tell a server its caller's uid)."""
    if access.listen:
        return True
    try:
        group = grp.getgrnam(settings.socket_group) if settings.socket_group else grp.getgrgid(os.getegid())
    except KeyError:
        return False  # a gid without a name has no members by name
    me = os.geteuid()
    members = {m for m in group.gr_mem}
    try:
        members |= {p.pw_name for p in pwd.getpwall() if p.pw_gid == group.gr_gid}
        members.discard(pwd.getpwuid(me).pw_name)
    except KeyError:
        pass
    return bool(members)


def check_folder(settings: Settings, name: str) -> None:
    """Refuse a local folder outside the model roots before anything of it is read (the helper and
    the workers check each file again, with links resolved)."""
    if not settings.model_roots or not os.path.isabs(name):
        return
    roots = [os.path.realpath(r) for r in settings.model_roots]
    if not any(modelfiles.inside(name, r) for r in roots):
        raise errors.PermissionDenied(f"{name} is outside this daemon's model roots ({', '.join(roots)})")
