"""Where an in-step Compressor step's time goes (issue 14): the codec's own kernels against the exchange.

Two local gloo processes, three 2048 x 2048 float32 gradients (the configuration of
``gradcompress bench --in-step``), median of 8 rounds, rank 0's figures:

* ``dense``: ``all_reduce`` + divide of the gradients (the in-step baseline);
* per scheme, the codec alone in the same two processes, no communication: ``encode_feedback``
  (the error feedback fused into the encode) of every gradient, then ``decode_into`` of each
  payload — the work a step cannot avoid, with both processes sharing the machine as in a step;
* ``add+copy``: r = g + r; g = r — the memory traffic of error feedback alone.

    python benchmarks/step_floor.py [--schemes "sign;int8;topk"]
"""

from __future__ import annotations

import argparse
import statistics
import time


def worker(rank: int, world: int, specs: list[str]) -> dict:
    import torch
    import torch.distributed as dist

    from gradcompress import make

    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(2048, 2048, generator=g) * 1e-3 for _ in range(3)]
    residuals = [torch.zeros(2048, 2048) for _ in range(3)]
    work = [t.clone() for t in grads]

    def timed(fn) -> float:
        times = []
        for i in range(8):
            for w, t in zip(work, grads):
                w.copy_(t)
            dist.barrier()
            start = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    def dense(_):
        for w in work:
            dist.all_reduce(w)
            w.div_(world)

    out = {"dense": timed(dense)}
    for spec in specs:
        codec = make(spec)

        def codec_only(i, codec=codec):
            payloads = [codec.encode_feedback(w, r, seed=i, out=r) for w, r in zip(work, residuals)]
            for p, w in zip(payloads, work):
                codec.decode_into(p, w)

        out[spec] = timed(codec_only)

    def add_copy(_):
        for w, r in zip(work, residuals):
            torch.add(w, r, out=r)
            w.copy_(r)

    out["add+copy (r = g + r; g = r)"] = timed(add_copy)
    return out


def main() -> None:
    from gradcompress.testbed import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="sign;int8;topk", help="';'-separated codec specs")
    args = p.parse_args()
    r = launch.run(worker, 2, args.schemes.split(";"), timeout=600)[0]
    for name, ms in r.items():
        print(f"{name:30s} {ms:7.1f} ms   x dense {ms / r['dense']:.2f}")


if __name__ == "__main__":
    main()
