"""PyTorch on the shapes of benches/kernels.rs, timed the same way (synchronise around 20
launches after a warm-up), run in the same call on the GPU machine as the reference."""
import time

import torch

from torch_timing import timed

MIB = 1 << 20


def main():
    dev = torch.device("cuda")
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    src = torch.zeros(256 * MIB, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = 2 * 256 * MIB / timed(lambda: dst.copy_(src)) / 1e9
    print(f"torch copy_d2d_256MiB          {copy:8.1f} GB/s  100.0% (ceiling)")
    n = 256 * MIB // 4
    a = torch.randn(n, device=dev)
    b = torch.randn(n, device=dev)
    rows = a.view(n // 1024, 1024)

    def report(name, nbytes, secs):
        gbs = nbytes / secs / 1e9
        print(f"torch {name:<24} {gbs:8.1f} GB/s  {100 * gbs / copy:5.1f}% of copy  ({secs * 1e3:.3f} ms)")

    report("add_f32", 3 * 256 * MIB, timed(lambda: a + b))
    report("cast_f32_to_bf16", 256 * MIB + 128 * MIB, timed(lambda: a.to(torch.bfloat16)))
    report("sum_last_dim_f32", 256 * MIB, timed(lambda: rows.sum(-1, keepdim=True)))
    report("softmax_last_dim_f32", 2 * 256 * MIB, timed(lambda: torch.softmax(rows, -1)))
    ah, bh = a.bfloat16(), b.bfloat16()
    report("add_bf16", 3 * 128 * MIB, timed(lambda: ah + bh))
    for m, k, nn in [(4096, 4096, 4096), (4608, 3072, 12288)]:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(k, nn, device=dev, dtype=torch.bfloat16)
        secs = timed(lambda: torch.matmul(x, w))
        print(f"torch matmul_bf16_{m}x{k}x{nn:<8} {2 * m * k * nn / secs / 1e12:8.1f} TFLOP/s ({secs * 1e3:.3f} ms)")
    # The host's cost of a small Linear with a bias (bf16, no gradient), as benches/kernels.rs.
    x = torch.randn(16, 64, device=dev, dtype=torch.bfloat16)
    w = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(64, device=dev, dtype=torch.bfloat16)
    calls, best = 4000, float("inf")
    with torch.no_grad():
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                torch.nn.functional.linear(x, w, bias)
            best = min(best, time.perf_counter() - t)
    torch.cuda.synchronize()
    print(f"torch linear_bias_bf16_16x64x64 host {best * 1e6 / calls:8.2f} us a call")


if __name__ == "__main__":
    main()
