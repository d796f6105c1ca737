"""NCCL's own all-reduce bus bandwidth through PyTorch (one process per GPU), for the
figure benches/train_step.rs --allreduce-mib prints: the same buffer size, warm-up and
count, bus bandwidth as nccl-tests counts it (2 (n-1)/n x bytes / time).
    python3 benches/torch_allreduce.py [MiB ...]"""
import os, sys, time
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank, world, sizes, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    for mib in sizes:
        x = torch.ones(mib << 18, dtype=torch.float32, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        s = (time.perf_counter() - t) / 10
        b = float(mib << 20)
        if rank == 0:
            print(f"torch NCCL all-reduce of {mib} MiB f32 over {world} GPUs: {s*1e3:.3f} ms, "
                  f"algorithm bandwidth {b/s/1e9:.1f} GB/s, bus bandwidth "
                  f"{2*(world-1)/world*b/s/1e9:.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]] or [256]
    world = torch.cuda.device_count()
    mp.spawn(work, args=(world, sizes, 29533), nprocs=world)
