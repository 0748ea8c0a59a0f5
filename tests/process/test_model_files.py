"""Files a local model is read from (issue #26, critical): links out of a model's folder, files
outside the model roots or the allow-list, and paths named inside its JSON are refused with
PERMISSION_DENIED naming the file, by a real daemon, before anything of them is read; a Hugging
Face cache layout (snapshots linking to blobs) still loads and computes what transformers does."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import grpc
import pytest
import tinymodels
from daemonproc import Daemon, start_daemon

from nnd.v1 import nnd_pb2, nnd_pb2_grpc
from nnd_daemon import errors, modelfiles

SECRET_WORDS = ["root-only-line-one", "root-only-line-two", "root-only-line-three"]
OTHER_UID = 4105


def _secret(path: pathlib.Path) -> pathlib.Path:
    """A 0600 file of another user (when we are root), shaped as a vocab.txt."""
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *SECRET_WORDS]) + "\n")
    path.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(path, OTHER_UID, OTHER_UID)
    return path


def _evil_bert(folder: pathlib.Path, secret: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True)
    config = {
        "model_type": "bert",
        "architectures": ["BertModel"],
        "vocab_size": 16,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "max_position_embeddings": 32,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    (folder / "vocab.txt").symlink_to(secret)
    return folder


def _hub_layout(src: str, repo: pathlib.Path) -> pathlib.Path:
    """`src` laid out as huggingface_hub caches it: snapshots/<rev>/f -> ../../blobs/<name>."""
    snap = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(src):
        blob = repo / "blobs" / f"blob-{name}"
        shutil.copy(os.path.join(src, name), blob)
        (snap / name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    return snap


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models) -> tuple[Daemon, dict[str, pathlib.Path]]:
    base = tmp_path_factory.mktemp("modelfiles")
    pub, other = base / "pub", base / "other"
    pub.mkdir()
    other.mkdir()
    paths: dict[str, pathlib.Path] = {}
    paths["secret"] = _secret(base / "secret.txt")
    paths["evil"] = _evil_bert(pub / "evil-bert", paths["secret"])
    paths["disallowed"] = tinymodels.build("gpt2", other / "disallowed", seed=7)
    allowed = pathlib.Path(shutil.copytree(tiny_models["gpt2"], pub / "allowed"))
    (allowed / "model.safetensors").unlink()
    (allowed / "model.safetensors").symlink_to(paths["disallowed"] / "model.safetensors")
    paths["allowed"] = allowed
    paths["hub"] = _hub_layout(tiny_models["gpt2"], pub / "hub" / "models--org--tiny")
    index = pathlib.Path(shutil.copytree(tiny_models["gpt2"], pub / "indexed"))
    weight_map = {"transformer.wte.weight": str(paths["disallowed"] / "model.safetensors")}
    (index / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    paths["indexed"] = index
    fifo = pathlib.Path(shutil.copytree(tiny_models["gpt2"], pub / "fifo"))
    os.mkfifo(fifo / "special_tokens_map.json")
    paths["fifo"] = fifo
    d = start_daemon(base / "d", "--model-root", str(pub), "--allow-model", f"{base}/*")
    yield d, paths
    d.stop()


def _stub(d: Daemon) -> nnd_pb2_grpc.NndStub:
    return nnd_pb2_grpc.NndStub(grpc.insecure_channel(d.address))


def _refused(d: Daemon, folder: pathlib.Path, *names: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        _stub(d).LoadModel(nnd_pb2.LoadModelRequest(model=str(folder)), timeout=120)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    details = info.value.details()
    for name in names:
        assert name in details, details
    return details


def test_a_vocab_linked_to_another_users_file_is_never_read(world):
    d, paths = world
    details = _refused(d, paths["evil"], "vocab.txt", "outside the model's folder")
    assert not any(w in details for w in SECRET_WORDS)
    stub = _stub(d)
    with pytest.raises(grpc.RpcError) as info:
        ids = [nnd_pb2.TokenIds(ids=[i]) for i in (5, 6, 7)]
        stub.Decode(nnd_pb2.DecodeRequest(model=str(paths["evil"]), ids=ids), timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stub.GetTokenizerFiles(nnd_pb2.GetModelRequest(model=str(paths["evil"])), timeout=60)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert not any(w in d.log() for w in SECRET_WORDS)


def test_an_allowed_folder_linking_to_disallowed_weights_is_refused(world):
    d, paths = world
    _refused(d, paths["allowed"], "model.safetensors", str(paths["disallowed"]))


def test_an_index_naming_a_path_and_a_fifo_are_refused(world):
    d, paths = world
    _refused(d, paths["indexed"], "model.safetensors.index.json", "plain name")
    _refused(d, paths["fifo"], "special_tokens_map.json", "not a regular file")


def test_a_folder_outside_the_model_roots_is_refused(world):
    d, paths = world
    _refused(d, paths["disallowed"], "model roots")


def test_a_hub_cache_layout_loads_and_computes_what_transformers_does(world, tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    import nnd

    d, paths = world
    model = nnd.TransformersModel(str(paths["hub"]), address=d.address, device="cpu", dispatch=True)
    ids = [5, 17, 42, 99]
    with model.trace(torch.tensor([ids])):
        logits = model.lm_head.output.save()
    want = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"])(torch.tensor([ids])).logits
    assert torch.equal(torch.as_tensor(logits), want)
    from transformers import AutoTokenizer

    text = "The Eiffel Tower is in the city of"
    assert model.tokenizer(text)["input_ids"] == AutoTokenizer.from_pretrained(tiny_models["gpt2"])(text)["input_ids"]


# ---------------------------------------------------------------- the policy, in process


def test_a_daemon_others_can_call_reads_only_files_everyone_may_read(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "config.json").chmod(0o600)
    with pytest.raises(errors.PermissionDenied, match="not readable by every user"):
        modelfiles.vet(str(folder), modelfiles.Policy(public=True))
    modelfiles.vet(str(folder), modelfiles.Policy())  # the daemon's own user alone: allowed


def test_a_file_swapped_after_the_check_is_not_opened(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (tmp_path / "elsewhere.json").write_text('{"secret": 1}')
    entries = modelfiles.vet(str(folder), modelfiles.Policy())
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(errors.PermissionDenied, match="config.json"):
        modelfiles._pin(str(folder), entries[0])


def test_a_daemon_for_a_group_reads_only_what_every_user_may(tmp_path, tiny_models):
    """--socket-group without --model-root: the caller's uid is unknown, so a file is read only if
    every user could read it (the file o+r, every folder above it o+x)."""
    import grp
    import tempfile

    others = [g.gr_name for g in grp.getgrall() if g.gr_gid != os.getgid()] if os.geteuid() == 0 else []
    group = others[0] if others else grp.getgrgid(os.getgid()).gr_name
    base = pathlib.Path(tempfile.mkdtemp(prefix="nnd-public-"))
    try:
        base.chmod(0o755)
        public = pathlib.Path(shutil.copytree(tiny_models["gpt2"], base / "public"))
        for p in [public, *public.iterdir()]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        private = pathlib.Path(shutil.copytree(public, base / "private"))
        (private / "tokenizer.json").chmod(0o600)
        d = start_daemon(tmp_path / "d", "--socket-group", group)
        try:
            assert _stub(d).LoadModel(nnd_pb2.LoadModelRequest(model=str(public)), timeout=120).name == str(public)
            details = _refused(d, private, "tokenizer.json", "not readable by every user")
            assert "--model-root" in details
        finally:
            d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)
