"""`nnd pull` and `nnd list`: the Hugging Face cache on this machine, as Ollama's pull/list.

Both work without a daemon: `pull` downloads a model's files into this user's
Hugging Face cache (HF_HUB_CACHE / HF_HOME, as transformers reads them) with
huggingface_hub's progress bars; `list` shows what that cache holds, with sizes.
A daemon running as the same user loads a pulled model by its repo id without
touching the network.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise SystemExit("nnd: pull and list need huggingface_hub: pip install huggingface_hub") from None
    return huggingface_hub


def cmd_pull(ns: argparse.Namespace) -> int:
    hub = _hub()
    from huggingface_hub import constants
    from huggingface_hub.utils import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        print(
            f"nnd: cannot pull {ns.model}: Hugging Face downloads are off in this environment "
            "(HF_HUB_OFFLINE=1); unset it (and TRANSFORMERS_OFFLINE) to download, or copy the model's folder "
            "here and load it by its path",
            file=sys.stderr,
        )
        return 1
    try:
        path = hub.snapshot_download(repo_id=ns.model, revision=ns.revision, token=ns.hf_token)
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as exc:
        print(f"nnd: {ns.model}{'@' + ns.revision if ns.revision else ''} is not on the Hub: {_first_line(exc)}",
              file=sys.stderr)
        return 1
    except hub.errors.LocalEntryNotFoundError as exc:
        # huggingface_hub's word for "the Hub could not be reached and nothing is cached".
        print(f"nnd: cannot pull {ns.model}: the Hugging Face Hub cannot be reached from here "
              f"({_first_line(exc)})", file=sys.stderr)
        return 1
    except HfHubHTTPError as exc:
        print(f"nnd: cannot pull {ns.model}: {_first_line(exc)}", file=sys.stderr)
        return 1
    print(f"{ns.model}: pulled into {path}")
    return 0


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def cmd_list(ns: argparse.Namespace) -> int:
    hub = _hub()
    try:
        cache = hub.scan_cache_dir()
    except hub.CacheNotFound as exc:
        if ns.json:
            print("[]")
        else:
            print(f"no models in the Hugging Face cache ({exc.cache_dir} does not exist); `nnd pull MODEL` fills it")
        return 0
    repos = sorted((r for r in cache.repos if r.repo_type == "model"), key=lambda r: r.repo_id)
    rows = [
        {
            "model": r.repo_id,
            "size_bytes": r.size_on_disk,
            "revisions": sorted({ref for rev in r.revisions for ref in rev.refs} or {rev.commit_hash[:12] for rev in r.revisions}),
            "files": r.nb_files,
            "modified": r.last_modified,
            "path": str(r.repo_path),
        }
        for r in repos
    ]
    if ns.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no models in the Hugging Face cache; `nnd pull MODEL` fills it")
        return 0
    import time

    table = [["NAME", "SIZE", "REVISIONS", "FILES", "MODIFIED"]]
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["modified"])) if r["modified"] else "-"
        table.append([r["model"], _size(r["size_bytes"]), ",".join(r["revisions"]), str(r["files"]), when])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return 0


def add_commands(add: Any) -> None:
    """The two subcommands, on the parser's `add(name, fn, help)`."""
    p = add("pull", cmd_pull, "download a model from the Hugging Face Hub into the local cache (shows progress)")
    p.add_argument("model", help="a Hub repo id, e.g. openai-community/gpt2")
    p.add_argument("--revision", help="a branch, tag or commit (default: the repo's main branch)")
    p.add_argument("--hf-token", default=None, help="a Hugging Face token for gated models (default: $HF_TOKEN)")

    p = add("list", cmd_list, "list the models in the local Hugging Face cache, with their sizes")
    p.add_argument("--json", action="store_true", help="print them as JSON")
