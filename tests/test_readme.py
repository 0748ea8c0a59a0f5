"""The README's promises that can be checked mechanically."""

from __future__ import annotations

import os
import pathlib
import re

from google.protobuf import text_format

from nnd.v1 import nnd_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    block = re.search(r"## Install and run the whole test suite\s+```bash\n(.+?)\n```", README, re.S)
    assert block, "README lost its test command"
    command = block.group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"exec {command}" in ci


def test_worked_example_is_a_valid_trace_request():
    block = re.search(r"```protobuf\n(.+?)\n```", README, re.S)
    assert block
    request = text_format.Parse(block.group(1), nnd_pb2.TraceRequest())
    kinds = [n.WhichOneof("kind") for n in request.graph.nodes]
    assert kinds == ["module", "op", "constant", "op", "op", "module", "save"]
    assert [n.op.name for n in request.graph.nodes if n.HasField("op")] == ["getitem", "iadd", "setitem"]
    assert request.graph.nodes[0].module.path == "transformer.h.5"


def test_every_cli_command_in_the_table_exists():
    from nnd.cli import build_parser

    commands = set(re.findall(r"^\| `nnd (\w+)", README, re.M))
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert commands and commands <= set(sub.choices)


def test_grpcurl_commands_are_plaintext():
    """grpcurl assumes TLS unless told -plaintext; the daemon's unix socket has none."""
    docs = README + (ROOT / "docs" / "protocol.md").read_text()
    commands = re.findall(r"grpcurl -[^`\n]*", docs)
    assert commands, "the docs lost their grpcurl examples"
    for command in commands:
        assert "-plaintext" in command, command


# Every ```python block of the README runs, in order and in one namespace, against a tiny GPT-2 (12
# layers, as the blocks' indices need) in a real daemon. The only substitutions, each the least that
# lets a block run here: the hub name becomes the tiny model's path, and the names the README leaves
# to the reader (a checkpoint `path`, prompts, token ids, a matrix of directions) are bound first.
_PRELUDE = """
import torch
from transformers import AutoModelForCausalLM
path = {path!r}
prompt = clean = "The Eiffel Tower is in the city of"
corrupt = "The Colosseum is in the city of"
paris_id, rome_id = 5, 7
"""
_AFTER_FIRST_BLOCK = "directions = torch.randn(3, hidden)\n"
# What the blocks promise comes back as real values (not proxies).
_CHECKS = """
real = torch.Tensor
assert isinstance(patched, real) and isinstance(lens, real)
assert len(h5) == 20 and all(isinstance(h, real) and h.shape[-1] == steering.shape[0] for h in h5), h5
assert isinstance(tokens, real) and tokens.shape[-1] >= 20
assert len(attribution) == 12 and all(isinstance(a, real) for a in attribution)
assert all(isinstance(v, real) for v in (norms, ids, scores, mean, proj)) and proj.shape[-1] == 3
"""
_DONE = "print('README-OK')\n"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.+?)\n```", README, re.S)


def test_every_python_block_of_the_readme_runs(daemon, tmp_path_factory):
    import subprocess
    import sys

    import tinymodels

    path = str(tinymodels.build("gpt2", tmp_path_factory.mktemp("readme") / "gpt2", layers=12))
    blocks = python_blocks()
    assert len(blocks) >= 6, "the README lost python blocks"
    assert blocks[0].count('"openai-community/gpt2"') == 1
    first = blocks[0].replace('"openai-community/gpt2"', "path")
    script = "\n".join([_PRELUDE.format(path=path), first, _AFTER_FIRST_BLOCK, *blocks[1:], _CHECKS, _DONE])
    env = {**os.environ, "NND_ADDRESS": daemon.address}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0 and "README-OK" in out.stdout, out.stderr[-4000:]


def test_every_repository_file_the_docs_name_exists():
    """Paths the README, CONTRIBUTING and docs/ point readers to (tests, daemon, client, bench, scripts
    files) are where they say: moving a module without its mentions leaves readers at a dead end."""
    docs = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {
        (doc.name, path)
        for doc in docs
        for path in re.findall(r"\b((?:tests|daemon|pyclient|bench|scripts)/[\w/.-]+\.(?:py|proto|md|sh))\b", doc.read_text())
    }
    assert named, "the pattern found no paths at all"
    missing = sorted(f"{doc}: {path}" for doc, path in named if not (ROOT / path).exists())
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)
