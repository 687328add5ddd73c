"""Bit-for-bit check of the codecs a speed change touches: record their outputs, then compare exactly.

    python benchmarks/codec_bits.py record /tmp/before.pt     # on the tree before the change
    python benchmarks/codec_bits.py compare /tmp/before.pt    # on the tree after it: exit 1 on any difference

Recorded per case (seeded inputs: contiguous, transposed, sliced, odd shapes, float16/bfloat16/float64, and a
large tensor on the fused kernels' path): the payload tensors of ``encode``, ``decode``, ``decode_into`` /
``accumulate_into`` into a buffer, the fused error feedback (``encode_feedback``, ``encode_piece``) for the bucketed
quantisers, and PowerSGD's exchange helpers (``product``, ``orthonormalize_``, ``transposed_product``, the decode
``matmul`` into a buffer and the residual ``addmm_``) for ranks 1, 2, 4 and alternate=true; at 1 and at 2 torch
threads (MKL's small products depend on the thread count). Compared with ``torch.equal`` (NaN positions alike).
"""

from __future__ import annotations

import sys

import torch

import gradcompress
from gradcompress.codecs.lowrank import initial_q, orthonormalize_, product, transposed_product

LOWRANK = ["powersgd:rank=1", "powersgd:rank=2", "powersgd:rank=4", "powersgd:rank=4,alternate=true"]
QUANT = ["int8", "int4", "int8:stochastic=true", "int4:stochastic=true", "qsgd", "terngrad", "sign",
         "int8:bucket=100", "int4:bucket=64"]


def inputs(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g) * 1e-3

    big = randn(1536, 1031)
    return {
        "small 37x53": randn(37, 53),
        "odd 301x257": randn(301, 257),
        "transposed 300x700": randn(700, 300).T,
        "sliced rows": randn(400, 900)[::2],
        "sliced cols": randn(500, 1200)[:, 100:1100],
        "4d 64x32x3x3": randn(64, 32, 3, 3),
        "big 1536x1031": big,
        "big sliced": big[:, 7:1000],
        "fp16 300x500": randn(300, 500).half(),
        "bf16 300x500": randn(300, 500).bfloat16(),
        "fp64 200x300": randn(200, 300).double(),
        "nonfinite 512x300": torch.where(torch.rand(512, 300, generator=g) < 1e-3, torch.tensor(float("nan")),
                                         randn(512, 300)),
        "flat 200003": randn(200003),
        "flat 70000": randn(70000),
    }


def record_all() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for seed in (0, 1):
            for name, x in inputs(seed).items():
                tag = f"t{threads}/s{seed}/{name}"
                for spec in LOWRANK + QUANT:
                    codec = gradcompress.make(spec)
                    if spec.startswith("powersgd") and x.dim() < 2:
                        continue
                    try:
                        p = codec.encode(x, seed=seed + 11)
                    except (TypeError, ValueError) as err:  # an input dtype a codec refuses
                        out[f"{tag}/{spec}/refused"] = torch.tensor([len(str(err))])
                        continue
                    for i, t in enumerate(p.tensors):
                        out[f"{tag}/{spec}/payload{i}"] = t.clone()
                    out[f"{tag}/{spec}/decode"] = codec.decode(p).clone()
                    if spec.startswith("powersgd") or x.dtype != torch.float32:
                        continue
                    buf = torch.full(x.shape, 0.5)
                    codec.decode_into(p, buf)
                    out[f"{tag}/{spec}/decode_into"] = buf.clone()
                    codec.accumulate_into(p, buf)
                    out[f"{tag}/{spec}/accumulate_into"] = buf.clone()
                    shifted = torch.full((x.numel() + 5,), 0.25)  # an output 12 bytes off any vector alignment
                    codec.decode_into(p, shifted[3 : 3 + x.numel()].view(x.shape))
                    out[f"{tag}/{spec}/decode_into shifted"] = shifted.clone()
                    xc = x.contiguous()
                    res = torch.randn(xc.shape, generator=torch.Generator().manual_seed(5)) * 1e-4
                    new = torch.empty_like(xc)
                    q = codec.encode_feedback(xc, res, seed=seed + 3, out=new)
                    for i, t in enumerate(q.tensors):
                        out[f"{tag}/{spec}/feedback payload{i}"] = t.clone()
                    out[f"{tag}/{spec}/feedback residual"] = new.clone()
                    inplace = res.clone()
                    codec.encode_feedback(xc, inplace, seed=seed + 3, out=inplace)
                    out[f"{tag}/{spec}/feedback in place"] = inplace.clone()
                    if getattr(codec, "slices_by_bucket", None) and hasattr(codec, "code_layout") \
                            and codec.slices_by_bucket():
                        dt, count = codec.code_layout(xc.numel())
                        codes = torch.zeros(count, dtype=dt)
                        scales = torch.zeros(-(-xc.numel() // codec.bucket))
                        new2 = torch.empty_like(xc)
                        codec.encode_piece(xc, res, new2, codes, scales, seed + 5)
                        out[f"{tag}/{spec}/piece codes"] = codes.clone()
                        out[f"{tag}/{spec}/piece scales"] = scales.clone()
                        out[f"{tag}/{spec}/piece residual"] = new2.clone()
                        shifted = torch.zeros(xc.numel() + 3)  # a residual output 4 bytes off alignment
                        codec.encode_piece(xc, res, shifted[1 : 1 + xc.numel()], codes, scales, seed + 5)
                        out[f"{tag}/{spec}/piece shifted residual"] = shifted.clone()
                        codec.encode_piece(xc, None, None, codes, scales, seed + 5, offset=codec.bucket * 3)
                        out[f"{tag}/{spec}/piece plain codes"] = codes.clone()
                        out[f"{tag}/{spec}/piece plain scales"] = scales.clone()
                        res16, new16 = res.bfloat16(), torch.empty(xc.shape, dtype=torch.bfloat16)
                        codec.encode_piece(xc, res16, new16, codes, scales, seed + 5)
                        out[f"{tag}/{spec}/piece bf16 codes"] = codes.clone()
                        out[f"{tag}/{spec}/piece bf16 residual"] = new16.clone()
                if x.dim() >= 2 and x.dtype == torch.float32:  # PowerSGD's exchange helpers
                    mat = x.reshape(x.shape[0], -1)
                    for r in (1, 2, 4):
                        q0 = initial_q(mat.shape[1], r, seed + 7, mat.device)
                        p = product(mat, q0)
                        out[f"{tag}/lowrank r{r}/product"] = p.clone()
                        orthonormalize_(p)
                        out[f"{tag}/lowrank r{r}/orthonormal"] = p.clone()
                        qq = transposed_product(mat, p)
                        out[f"{tag}/lowrank r{r}/transposed"] = qq.clone()
                        dec = torch.empty(mat.shape)
                        torch.matmul(p, qq.T, out=dec)
                        out[f"{tag}/lowrank r{r}/matmul out"] = dec.clone()
                        resid = mat.contiguous().clone()
                        resid.addmm_(p, qq.T, alpha=-1)
                        out[f"{tag}/lowrank r{r}/addmm"] = resid
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (so -0.0 differs from 0.0, and NaNs compare by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
        a, b = a.contiguous().view(ints), b.contiguous().view(ints)
    return torch.equal(a, b)


def compare(path: str) -> int:
    before = torch.load(path)
    now = record_all()
    missing = sorted(set(before) - set(now))
    extra = sorted(set(now) - set(before))
    diff = [k for k in before if k in now and not same_bits(before[k], now[k])]
    print(f"{len(before)} recorded outputs, {len(now)} now; missing {len(missing)}, new {len(extra)}, "
          f"different {len(diff)}")
    for k in (missing + diff)[:30]:
        print("  ", k)
    return 1 if missing or diff else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compare"):
        sys.exit(__doc__)
    if sys.argv[1] == "record":
        torch.save(record_all(), sys.argv[2])
        print("recorded", sys.argv[2])
    else:
        sys.exit(compare(sys.argv[2]))
