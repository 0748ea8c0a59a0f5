"""The README's promises that can be checked mechanically."""

from __future__ import annotations

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
