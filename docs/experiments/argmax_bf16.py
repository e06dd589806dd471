"""What a greedy pick costs on this CPU: ``Tensor.argmax`` over bf16 logits against the float32 compare of
:func:`accept_head.core.sampling.argmax` (the same indices), for the row counts decoding meets — one row (a draft
step, an autoregressive token), a chain's verification rows, a tree's — over the embedded target's 49,152 ids and
the feature draft's 16,384 kept ids; medians of 200 calls, 2 threads.

    python docs/experiments/argmax_bf16.py
"""

import torch
from cpu_decode_profile import median_ms

from accept_head.core.records import machine_info
from accept_head.core.sampling import argmax


def main() -> None:
    torch.set_num_threads(2)
    machine = machine_info()
    print(f"{machine['cpu']} ({machine['cpu_capability']}), torch {machine['torch']}")
    generator = torch.Generator().manual_seed(0)
    for vocab in (16384, 49152):
        for rows in (1, 4, 9, 16):
            logits = torch.randn(rows, vocab, generator=generator).to(torch.bfloat16)
            assert torch.equal(argmax(logits), logits.argmax(-1))
            bf16 = 1e3 * median_ms(lambda: logits.argmax(-1), 200)
            f32 = 1e3 * median_ms(lambda: argmax(logits), 200)
            print(
                f"V={vocab:>6} rows={rows:>2}: argmax over bf16 {bf16:7.1f} us, float32 compare {f32:6.1f} us "
                f"({bf16 / f32:.1f}x)"
            )


if __name__ == "__main__":
    main()
