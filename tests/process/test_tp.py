"""Tensor parallel through a real daemon: a tiny Llama split over two torchrun ranks (gloo, CPU)
gives what the same weights give in one process, for reads, edits across the shard boundary,
steering, skips, seeded sampling and sync points (real values mid-forward); bad degrees are
refused before anything starts; a rank that dies takes its group down cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time

import grpc
import psutil
import pytest
import torch
from daemonproc import start_daemon

import nnd
from nnd.v1 import nnd_pb2, nnd_pb2_grpc
from nnd_daemon import errors
from nnd_daemon.control import tplaunch

PROMPT = "Hello world, this is"
ATOL = 1e-5
MAX_DIFF: dict[str, float] = {}  # what each comparison measured, printed at the end (-s)


@pytest.fixture(scope="module")
def paths(tiny_models, tmp_path_factory):
    """Three copies of the tiny Llama (one per daemon entry: tp=2, tp=1, refusals)."""
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for name in ("tp2", "tp1", "tp3"):
        out[name] = str(root / name)
        shutil.copytree(tiny_models["llama"], out[name])
    return out


@pytest.fixture(scope="module")
def tpd(tmp_path_factory):
    """A daemon of this module's own: its groups get killed here. Hangs count after 30 s."""
    old = os.environ.get("NND_TP_TIMEOUT_S")
    os.environ["NND_TP_TIMEOUT_S"] = "30"
    try:
        d = start_daemon(tmp_path_factory.mktemp("tpd"))
    finally:
        if old is None:
            del os.environ["NND_TP_TIMEOUT_S"]
        else:
            os.environ["NND_TP_TIMEOUT_S"] = old
    yield d
    d.stop()
    if MAX_DIFF:
        print("\nmax |tp=2 - tp=1|: " + ", ".join(f"{k} {v:.2e}" for k, v in MAX_DIFF.items()))


@pytest.fixture(scope="module")
def tp2(tpd, paths):
    m = nnd.TransformersModel(paths["tp2"], address=tpd.address, tp_size=2, keep_alive=-1)
    m.dispatch()
    yield m


@pytest.fixture(scope="module")
def tp1(tpd, paths):
    m = nnd.TransformersModel(paths["tp1"], address=tpd.address, keep_alive=-1)
    m.dispatch()
    yield m
    m.release()


def _ps(d) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(d.cli("ps", "--json").stdout)}


def _same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape, (name, a.shape, b.shape)
    diff = float((a - b).abs().max())
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), diff)
    assert diff <= ATOL, f"{name}: tp=2 differs from tp=1 by {diff}"


def _both(tp2, tp1, block):
    """Run `block(model)` (a trace returning a dict of saved values) on both models."""
    return block(tp2), block(tp1)


def test_group_is_two_ranks_and_an_agent(tpd, tp2, paths):
    info = _ps(tpd)[paths["tp2"]]
    assert info["state"] == "DISPATCHED" and info["dispatched_placement"]["tp_size"] == 2
    pids = info["worker_pids"]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    agent = psutil.Process(pids[-1])
    assert "torch.distributed.run" in " ".join(agent.cmdline())
    assert {c.pid for c in agent.children()} == set(pids[:2])
    # `nnd ps` shows the degree and each rank: its pid, device and memory (the group's RSS is their sum).
    assert info["tp_size"] == 2
    ranks = info["ranks"]
    assert [(r.get("rank", 0), r["pid"], r["device"]) for r in ranks] == [(0, pids[0], "cpu"), (1, pids[1], "cpu")]
    assert all(int(r["rss_bytes"]) > 0 for r in ranks)
    assert sum(int(r["rss_bytes"]) for r in ranks) == int(info["worker_rss_bytes"])
    table = _columns(tpd.cli("ps").stdout)
    (row,) = [r for r in table if r["NAME"] == paths["tp2"]]
    assert row["TP"] == "2" and row["PID"] == str(pids[2])  # the agent
    rank_rows = [r for r in table if r["NAME"].startswith("rank ")]
    assert [(r["NAME"], r["DEVICES"], r["PID"]) for r in rank_rows] == [
        ("rank 0", "cpu", str(pids[0])),
        ("rank 1", "cpu", str(pids[1])),
    ]
    assert all(r["RSS"].endswith("iB") for r in rank_rows)


def _info(m) -> nnd_pb2.ModelInfo:
    return m._conn.call("GetModel", nnd_pb2.GetModelRequest(model=m._name), timeout=60)


def test_the_group_has_a_route_and_rank_0_serves_it(tpd, tp2, paths):
    """Traces go to rank 0's own socket (one hop); it checks the epoch, limits and token like a worker."""
    conn = tp2._conn
    route = _info(tp2).route
    assert route.address.startswith("unix://") and route.epoch
    sock = route.address[len("unix://") :]
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660  # the daemon's group, as the daemon's socket
    before, direct = _info(tp2).worker_requests, conn.router.direct_calls
    with tp2.trace(PROMPT):
        logits = tp2.lm_head.output.save()
    assert logits.shape[-1] == 320
    assert conn.router.direct_calls == direct + 1 and _info(tp2).worker_requests == before + 1
    assert f"of {paths['tp2']} for" not in tpd.log()  # the daemon forwarded nothing of this model
    channel = grpc.insecure_channel(route.address)
    try:
        stub = nnd_pb2_grpc.NndStub(channel)
        request = nnd_pb2.TraceRequest(model=paths["tp2"], invokes=[nnd_pb2.Invoke(text=PROMPT)])
        with pytest.raises(grpc.RpcError) as stale:
            list(stub.Trace(request, metadata=[("nnd-epoch", str(route.epoch - 1))], timeout=60))
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("nnd-route", "stale") in tuple(stale.value.trailing_metadata())
        too_many = nnd_pb2.TraceRequest(model=paths["tp2"], invokes=[nnd_pb2.Invoke(text="x")] * 5000)
        with pytest.raises(grpc.RpcError) as limit:
            list(stub.Trace(too_many, metadata=[("nnd-epoch", str(route.epoch))], timeout=60))
        assert limit.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_invokes" in limit.value.details()
    finally:
        channel.close()
    assert _info(tp2).worker_requests == before + 1  # neither refused call reached the group


def _columns(table: str) -> list[dict[str, str]]:
    """`nnd ps`'s rows as {column: text}, cut where the header's columns start (cells may hold spaces)."""
    header, *lines = table.splitlines()
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    names = [header[a:b].strip() for a, b in bounds]
    return [{n: line[a:b].strip() for n, (a, b) in zip(names, bounds, strict=True)} for line in lines]


def test_reads_match_one_process(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            gate = m.model.layers[0].mlp.gate_proj.output.save()
            o_in = m.model.layers[0].self_attn.o_proj.input.save()
            act = m.model.layers[1].mlp.act_fn.output.save()
            logits = m.lm_head.output.save()
        return gate, o_in, act, logits

    (g2, o2, a2, l2), (g1, o1, a1, l1) = _both(tp2, tp1, block)
    assert g2.shape[-1] == 128 and o2.shape[-1] == 64  # whole widths, not one rank's half
    _same("gate_proj.output", g2, g1)
    _same("o_proj.input", o2, o1)
    _same("act_fn.output", a2, a1)
    _same("logits", l2, l1)


@pytest.mark.parametrize("k", [10, 100], ids=["inside-shard", "across-boundary"])
def test_edit_gate_output(tp2, tp1, k):
    def block(m):
        with m.trace(PROMPT):
            m.model.layers[0].mlp.gate_proj.output[..., :k] = 0
            gate = m.model.layers[0].mlp.gate_proj.output.save()
            down_in = m.model.layers[0].mlp.down_proj.input.save()
            logits = m.lm_head.output.save()
        return gate, down_in, logits

    (g2, d2, l2), (g1, d1, l1) = _both(tp2, tp1, block)
    assert torch.all(g2[..., :k] == 0) and torch.all(g2[..., k:] != 0)
    _same(f"edited gate (k={k})", g2, g1)
    _same(f"down_proj.input after edit (k={k})", d2, d1)
    _same(f"logits after edit (k={k})", l2, l1)
    # and the edit reached both ranks' halves of the forward: without it the logits differ
    with tp2.trace(PROMPT):
        plain = tp2.lm_head.output.save()
    assert not torch.allclose(plain, l2, atol=1e-4)


def test_edit_row_parallel_input(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            o_in = m.model.layers[0].self_attn.o_proj.input
            o_in[:, -1, 20:40] = 3.0  # spans the two ranks' halves (32 each)
            logits = m.lm_head.output.save()
        return logits

    l2, l1 = _both(tp2, tp1, block)
    _same("logits after o_proj.input edit", l2, l1)


def test_steering_a_decoder_layer(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            h = m.model.layers[0].output
            h[:, -1, :] += 4 * torch.ones(64)
            steered = m.model.layers[1].output.save()
            logits = m.lm_head.output.save()
        return steered, logits

    (s2, l2), (s1, l1) = _both(tp2, tp1, block)
    _same("steered layer 1", s2, s1)
    _same("logits after steering", l2, l1)


def test_skip_a_layers_mlp(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            x = m.model.layers[0].mlp.input
            m.model.layers[0].mlp.skip(x * 0)
            logits = m.lm_head.output.save()
        return logits

    l2, l1 = _both(tp2, tp1, block)
    _same("logits with layer 0's mlp skipped", l2, l1)


def test_skip_a_column_parallel_module(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            x = m.model.layers[0].mlp.gate_proj.input
            m.model.layers[0].mlp.gate_proj.skip(torch.cat([x, -x], dim=-1))  # whole width 128
            logits = m.lm_head.output.save()
        return logits

    l2, l1 = _both(tp2, tp1, block)
    _same("logits with gate_proj skipped", l2, l1)


def test_logit_lens_calls_a_sharded_module(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            h = m.model.layers[0].mlp.up_proj.input
            g = m.model.layers[0].mlp.gate_proj(h).save()  # column-parallel, called out of place
            o = m.model.layers[0].self_attn.o_proj(torch.ones(1, 1, 64)).save()  # row-parallel
        return g, o

    (g2, o2), (g1, o1) = _both(tp2, tp1, block)
    _same("gate_proj(h) out of place", g2, g1)
    _same("o_proj(ones) out of place", o2, o1)


def test_weights_come_back_whole(tp2, tp1):
    # A column-parallel and a row-parallel weight (DTensors on the ranks), gathered on every rank,
    # and computing with one gives what one process gives.
    def block(m):
        with m.trace(PROMPT):
            gate = m.model.layers[0].mlp.gate_proj.weight.save()
            down = m.model.layers[0].mlp.down_proj.weight.save()
            q = m.model.layers[1].self_attn.q_proj.weight.save()
            vocab = nnd.save(m.model.embed_tokens.weight.shape[0])
            lens = (m.model.norm(m.model.layers[0].output) @ m.lm_head.weight.T).save()
        return gate, down, q, vocab, lens

    (g2, d2, q2, v2, l2), (g1, d1, q1, v1, l1) = _both(tp2, tp1, block)
    assert g2.shape == (128, 64) and d2.shape == (64, 128) and v2 == v1
    _same("gate_proj.weight", g2, g1)
    _same("down_proj.weight", d2, d1)
    _same("q_proj.weight", q2, q1)
    _same("lens through lm_head.weight", l2, l1)


def test_seeded_sampling_matches(tp2, tp1):
    def sample(m, seed):
        with m.generate(PROMPT, max_new_tokens=8, do_sample=True, temperature=1.5, seed=seed) as tracer:
            ids = tracer.result.save()
        return ids[0].tolist()

    assert sample(tp2, 11) == sample(tp1, 11)
    assert sample(tp2, 12) == sample(tp1, 12)
    # unseeded: rank 0 picks one seed for all ranks, so the ranks agree and nothing hangs
    with tp2.generate(PROMPT, max_new_tokens=4, do_sample=True, temperature=1.5) as tracer:
        ids = tracer.result.save()
    prompt = len(tp2.tokenizer(PROMPT)["input_ids"])
    new = ids[0, prompt:].tolist()
    # Unseeded, a sampled end-of-sequence token may end it early (random weights, temperature 1.5): then
    # that is its last token. Four steps otherwise.
    assert 1 <= len(new) <= 4 and (len(new) == 4 or new[-1] == tp2.tokenizer.eos_token_id), new


def test_generation_with_per_step_reads(tp2, tp1):
    def block(m):
        with m.generate(PROMPT, max_new_tokens=3) as tracer:
            gate = [].save()  # made in the block: saved, or (as in nnsight) its name does not outlive it
            for _ in tracer.iter[:]:
                gate.append(m.model.layers[1].mlp.gate_proj.output[:, -1].save())
            ids = tracer.result.save()
        return gate, ids

    (g2, i2), (g1, i1) = _both(tp2, tp1, block)
    assert i2.tolist() == i1.tolist() and len(g2) == 3
    for step, (a, b) in enumerate(zip(g2, g1, strict=True)):
        _same(f"gate_proj per step {step}", a, b)


def test_gradients_of_whole_values_work_and_split_ones_are_refused(tp2, tp1):
    def block(m):
        with m.trace(PROMPT):
            h0 = m.model.layers[0].output
            loss = m.lm_head.output[0, -1].sum()
            with loss.backward():
                g0 = h0.grad.save()
        return g0

    g2, g1 = _both(tp2, tp1, block)
    assert float((g2 - g1).abs().max()) <= 1e-4 * max(1.0, float(g1.abs().max()))
    with pytest.raises(nnd.NndError, match="split across the tensor-parallel ranks") as info:
        with tp2.trace(PROMPT):
            gate = tp2.model.layers[0].mlp.gate_proj.output
            loss = tp2.lm_head.output[0, -1].sum()
            with loss.backward():
                gate.grad.save()
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    with tp2.trace(PROMPT):  # the group is still in lockstep
        tp2.lm_head.output.save()


def test_sync_points_match_one_process(tp2, tp1):
    """Real values mid-forward: every rank pauses at the same hook, the client gets the whole (gathered)
    value, and the edit it then records at a later hook reaches both ranks' halves of the forward."""

    def block(m):
        with m.trace(PROMPT):
            gate = m.model.layers[0].mlp.gate_proj.output  # column-parallel: each rank holds 64 of 128
            row = nnd.save(gate[0, -1].tolist())
            total = nnd.save(gate.sum().item())
            if gate.sum() > -1e9:  # always: the branch runs, as in one process
                m.model.layers[1].mlp.gate_proj.output[..., 60:70] = 0  # across the shard boundary
            if total > 1e9:  # never
                m.model.layers[1].output[:] = 0
            logits = m.lm_head.output.save()
        with m.generate(PROMPT, max_new_tokens=3) as tracer:
            norms = [].save()
            for _ in tracer.iter[:]:  # a pause inside each step
                norms.append(m.model.layers[1].mlp.act_fn.output[0, -1].norm().item())
            ids = tracer.result.save()
        # A session that turns interactive at its first block; the next names a stored edit (the same one).
        with m.edit() as (_, edited):
            edited.model.layers[1].mlp.gate_proj.output[..., 60:70] = 0
        try:
            with m.session():
                with m.trace(PROMPT):
                    m.model.layers[0].output.sum().item()
                with edited.trace(PROMPT):
                    stored = edited.lm_head.output.save()
        finally:
            edited.clear_edits()
        return row, total, logits, norms, ids, stored

    (r2, t2, l2, n2, i2, s2), (r1, t1, l1, n1, i1, s1) = _both(tp2, tp1, block)
    assert len(r2) == 128  # the whole width, not rank 0's half
    _same("gate_proj.output at a sync", torch.tensor(r2), torch.tensor(r1))
    assert t2 == pytest.approx(t1, rel=1e-5, abs=ATOL)
    _same("logits after an edit recorded at a sync", l2, l1)
    with tp2.trace(PROMPT):
        plain = tp2.lm_head.output.save()
    assert not torch.allclose(plain, l2, atol=1e-4)  # the edit took effect on the sharded forward
    assert len(n2) == 3 and n2 == pytest.approx(n1, rel=1e-5)
    assert i2.tolist() == i1.tolist()
    _same("logits of a session block naming a stored edit", s2, s1)
    _same("the stored edit and the edit recorded at a sync", s2, l2)


def test_a_failed_or_abandoned_sync_frees_every_rank(tpd, tp2, tp1, paths):
    """An out-of-order node, a pause past its timeout and a client killed while paused each end the run
    on every rank together: the same group (no restart) serves the next trace."""
    import subprocess
    import sys
    import textwrap

    pids = _ps(tpd)[paths["tp2"]]["worker_pids"]
    with pytest.raises(nnd.OutOfOrderError):
        with tp2.trace(PROMPT):
            tp2.model.layers[1].output[0].sum().item()
            tp2.model.layers[0].output.save()  # layer 0 already ran, on both ranks
    with pytest.raises(nnd.DeadlineExceeded, match="paused at a sync point"):
        with tp2.trace(PROMPT, pause_timeout=0.5):
            tp2.model.layers[0].output.sum().item()  # rank 0 starts waiting for the next message here
            time.sleep(3)  # longer than the pause timeout, which began before the value was sent
            tp2.model.layers[1].output.sum().item()
    script = textwrap.dedent(
        f"""
        import sys, nnd
        model = nnd.TransformersModel({paths["tp2"]!r}, address={tpd.address!r}, tp_size=2, keep_alive=-1)
        with model.trace({PROMPT!r}, pause_timeout=600):
            model.model.layers[0].output.sum().item()
            print("paused", flush=True)
            sys.stdin.readline()  # held here until killed
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "paused"
    finally:
        proc.kill()
        proc.wait()

    def block(m):
        with m.trace(PROMPT, timeout=120):  # with the 600 s pause still holding the group, this would time out
            logits = m.lm_head.output.save()
        return logits

    _same("after failed and abandoned syncs", *_both(tp2, tp1, block))
    assert _ps(tpd)[paths["tp2"]]["worker_pids"] == pids


def test_degree_that_does_not_divide_is_refused_before_starting(tpd, paths):
    path = paths["tp3"]
    tpd.cli("load", path)
    before = {p.pid for p in psutil.Process(tpd.proc.pid).children(recursive=True)}
    res = tpd.cli("dispatch", path, "--tp", "3", check=False)
    assert res.returncode != 0
    assert "INVALID_ARGUMENT" in res.stderr or "does not divide" in res.stderr
    assert "num_attention_heads=4" in res.stderr and "num_key_value_heads=2" in res.stderr
    assert "intermediate_size=128" in res.stderr
    info = _ps(tpd)[path]
    assert info["state"] == "META" and not info.get("worker_pids")
    after = {p.pid for p in psutil.Process(tpd.proc.pid).children(recursive=True)}
    assert after <= before  # no torchrun, no rank


def test_refusals_without_a_daemon(tmp_path):
    from transformers import GPT2Config, LlamaConfig, MixtralConfig

    llama = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, hidden_size=64)
    with pytest.raises(errors.InvalidArgument, match="does not divide num_attention_heads=4"):
        tplaunch.check(llama, nnd_pb2.Placement(tp_size=3), gpus=0)
    tplaunch.check(llama, nnd_pb2.Placement(tp_size=2), gpus=0)  # fine on CPU
    wide = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, intermediate_size=128, hidden_size=64)
    tplaunch.check(wide, nnd_pb2.Placement(tp_size=4, device="cpu"), gpus=2)
    with pytest.raises(errors.InvalidArgument, match="needs 4 GPUs, but this machine has 2"):
        tplaunch.check(wide, nnd_pb2.Placement(tp_size=4, device="cuda"), gpus=2)
    with pytest.raises(errors.InvalidArgument, match="needs 4 GPUs"):
        tplaunch.check(wide, nnd_pb2.Placement(tp_size=4), gpus=2)  # GPUs present: the default is GPU
    with pytest.raises(errors.Unimplemented, match="mixture-of-experts.*num_local_experts=8"):
        tplaunch.check(MixtralConfig(), nnd_pb2.Placement(tp_size=2), gpus=0)
    with pytest.raises(errors.Unimplemented, match="no tensor-parallel plan for gpt2"):
        tplaunch.check(GPT2Config(), nnd_pb2.Placement(tp_size=2), gpus=0)
    with pytest.raises(errors.Unimplemented, match="quantized"):
        tplaunch.check(llama, nnd_pb2.Placement(tp_size=2, dtype="nf4"), gpus=0)
    with pytest.raises(errors.InvalidArgument, match="device_map"):
        tplaunch.check(llama, nnd_pb2.Placement(tp_size=2, device_map='{"": 0}'), gpus=0)


def test_moe_refused_through_the_daemon(tpd, tmp_path):
    import tinymodels

    path = tinymodels.write_config_only(
        tmp_path / "moe",
        {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "vocab_size": 320,
        },
    )
    tpd.cli("load", str(path))
    res = tpd.cli("dispatch", str(path), "--tp", "2", check=False)
    assert res.returncode != 0 and "mixture-of-experts" in res.stderr and "num_local_experts=4" in res.stderr
    assert not _ps(tpd)[str(path)].get("worker_pids")


def test_a_cancelled_stream_leaves_the_group_up(tpd, tp2, paths):
    pids = _ps(tpd)[paths["tp2"]]["worker_pids"]
    stream = tp2.stream(PROMPT, max_new_tokens=1000)
    next(stream)
    stream.close()  # the client goes away: every rank stops at its next step, together
    with tp2.trace(PROMPT):
        logits = tp2.lm_head.output.save()
    assert logits.shape[-1] == 320
    assert _ps(tpd)[paths["tp2"]]["worker_pids"] == pids


def test_a_killed_rank_takes_the_group_down_cleanly(tpd, tp2, paths):
    """Last: it ends the shared group."""
    path = paths["tp2"]
    pids = _ps(tpd)[path]["worker_pids"]
    epoch = _info(tp2).route.epoch
    procs = [psutil.Process(p) for p in pids]
    stream = tp2.stream(PROMPT, max_new_tokens=1000)
    next(stream)  # the request is running on both ranks
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(nnd.NndError) as info:
        for _ in stream:
            pass
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
    assert "rank 1" in str(info.value) and "SIGKILL" in str(info.value)
    psutil.wait_procs(procs, timeout=20)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in procs)
    deadline = time.monotonic() + 20
    while (model := _ps(tpd)[path])["state"] != "META" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert model["state"] == "META" and "rank 1" in model["last_error"] and "SIGKILL" in model["last_error"]
    assert not model.get("worker_pids")
    assert tpd.proc.poll() is None  # the daemon stays up
    # and a later dispatch works again: the client's cached route is dead, it re-routes to the new group
    tpd.cli("dispatch", path)
    direct = tp2._conn.router.direct_calls
    with tp2.trace(PROMPT):
        logits = tp2.lm_head.output.save()
    assert logits.shape[-1] == 320 and len(_ps(tpd)[path]["worker_pids"]) == 3
    info = _info(tp2)
    assert info.route.epoch != epoch and info.worker_requests == 1
    assert tp2._conn.router.direct_calls == direct + 1  # sent to the new group directly
    assert f"of {path} for" not in tpd.log()
    tp2.release()
