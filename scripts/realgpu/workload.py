"""GPU workloads for the real-hardware check (scripts/realgpu/run.sh), run with the GPU machine's
own PyTorch. Each phase is NAME:SECONDS, run in order in one process:

  hold:S   allocate --gib of device memory, touch it, and do nothing with the GPU for S seconds
  full:S   back-to-back 8192^3 bf16 matrix products: every SM busy, NVML utilization ~100%
  duty:S   the same products half of each second, nothing the other half: utilization ~50%
  tiny:S   a stream of 64x64 products: a kernel is always running, so NVML utilization reads
           ~100%, while almost every SM is idle (what GPM's SM activity shows)

Each phase prints its start and end (wall time) so the comparison can line readings up with it.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _mark(what: str) -> None:
    print(f"{time.time():.3f} {what}", flush=True)


def _products(a: torch.Tensor, b: torch.Tensor, until: float) -> int:
    n = 0
    while time.time() < until:
        for _ in range(8):
            torch.mm(a, b)
        torch.cuda.synchronize()
        n += 8
    return n


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phases", nargs="+", help="NAME:SECONDS")
    parser.add_argument("--gib", type=float, default=4.0, help="device memory the hold phase keeps")
    args = parser.parse_args()
    dev = torch.device("cuda")
    big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    small = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    held: list[torch.Tensor] = []
    for phase in args.phases:
        name, _, seconds = phase.partition(":")
        until = time.time() + float(seconds)
        _mark(f"start {name}")
        if name == "hold":
            held.append(torch.ones(int(args.gib * 2**30) // 4, device=dev, dtype=torch.float32))
            torch.cuda.synchronize()
            time.sleep(max(0.0, until - time.time()))
        elif name == "full":
            _mark(f"products {_products(big, big, until)}")
        elif name == "duty":
            n = 0
            while time.time() < until:
                second = time.time()
                n += _products(big, big, min(until, second + 0.5))
                time.sleep(max(0.0, min(until, second + 1.0) - time.time()))
            _mark(f"products {n}")
        elif name == "tiny":
            n = 0
            while time.time() < until:
                for _ in range(256):
                    torch.mm(small, small)
                n += 256
            torch.cuda.synchronize()
            _mark(f"products {n}")
        else:
            print(f"workload: unknown phase {name!r}", file=sys.stderr)
            return 2
        _mark(f"end {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
