"""transfer: a ~256 MiB saved tensor from the worker to the client over the unix socket.

The graph saves `h[0, 0, 0].expand(N).clone()` of a layer output of the tiny
model: N float32 values computed in the worker, shipped worker → daemon → client
(streamed in chunks) and made a torch tensor there. The figure is bytes ÷ the
trace's end-to-end wall time; in brackets, bytes ÷ (that time − the same trace
saving one value), i.e. the rate of the transfer itself. The ceiling is a plain
in-process `torch.clone` of a tensor of the same size (a memcpy into fresh memory,
page faults included, as every copy on nnd's path pays them too); in brackets a
`copy_` into memory already touched, the bare memcpy rate.

The second row is the same trace with `shm=True`: the worker writes the tensor
into a POSIX shared-memory segment and the client maps it (worker/shm.py,
nnd/_shm.py); no byte crosses a socket.
"""

from __future__ import annotations

import harness
from harness import PROMPT, Row

NAME = "transfer"


def gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


def run(quick: bool) -> list[Row]:
    harness.one_thread()
    import torch

    import nnd

    n = (8 if quick else 64) * 2**20  # float32 values: 32 MiB / 256 MiB
    nbytes = n * 4
    warmup, repeats = (1, 3) if quick else (1, 5)
    path = harness.model("gpt2")
    src = torch.randn(n)
    dst = torch.empty_like(src)

    def memcpy() -> torch.Tensor:
        return src.clone()

    def warm_copy() -> torch.Tensor:
        return dst.copy_(src)

    with harness.daemon(NAME) as d:
        model = nnd.TransformersModel(path, address=d.address, device="cpu", dispatch=True)

        def big() -> torch.Tensor:
            with model.trace(PROMPT):
                h = model.transformer.h[0].output
                out = h[0, 0, 0].expand(n).clone().save()
            return out

        def big_shm() -> torch.Tensor:
            with model.trace(PROMPT, shm=True):
                h = model.transformer.h[0].output
                out = h[0, 0, 0].expand(n).clone().save()
            return out

        def small() -> torch.Tensor:
            with model.trace(PROMPT):
                h = model.transformer.h[0].output
                out = h[0, 0, 0].clone().save()
            return out

        got = big()
        if got.shape != (n,) or got.dtype != torch.float32:
            raise RuntimeError(f"unexpected saved tensor {tuple(got.shape)} {got.dtype}")
        if not torch.equal(big_shm(), got):
            raise RuntimeError("the shared-memory result differs from the streamed one")
        del got
        t = harness.interleaved(
            {"memcpy": memcpy, "warm_copy": warm_copy, "big": big, "big_shm": big_shm, "small": small},
            warmup=warmup,
            repeats=repeats,
        )
        model.release()

    transfer_only = max(t["big"] - t["small"], 1e-9)
    shm_only = max(t["big_shm"] - t["small"], 1e-9)
    raw = {k + "_s": v for k, v in t.items()} | {"bytes": nbytes, "repeats": repeats}
    return [
        Row(
            f"transfer: saved tensor of {nbytes / 2**20:.0f} MiB to the client",
            "torch clone in-process (ceiling)",
            f"{gbps(nbytes, t['memcpy'])} ({gbps(nbytes, t['warm_copy'])} into memory already touched)",
            f"{gbps(nbytes, t['big'])} ({gbps(nbytes, transfer_only)} beyond a plain trace)",
            t["memcpy"] / t["big"],
            target=harness.target("≥ 1.5 GB/s", nbytes / t["big"] >= 1.5e9),
            raw=raw,
        ),
        Row(
            f"transfer: saved tensor of {nbytes / 2**20:.0f} MiB through shared memory (shm=True)",
            "torch clone in-process (ceiling)",
            f"{gbps(nbytes, t['memcpy'])}",
            f"{gbps(nbytes, t['big_shm'])} ({gbps(nbytes, shm_only)} beyond a plain trace)",
            t["memcpy"] / t["big_shm"],
            target=harness.target("≥ 4 GB/s", nbytes / t["big_shm"] >= 4e9),
        ),
    ]
