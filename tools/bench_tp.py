"""Tensor-parallel benchmark: tp=2 (one core per rank) against tp=1 (both cores) and eager, one run.

Reports the median call time of each, the share of rank 0's call spent in the all-reduces (from
torch.profiler: ``all_reduce`` + ``wait_tensor``, which includes waiting for the other rank), and
gloo's all-reduce cost at the sizes and dtypes rank 0's graph reduces (a two-process
microbenchmark), the inputs of the scaling model in README.md.

    .venv/bin/python tools/bench_tp.py [--model qwen3-vl-2b-vision] [--repeat 5] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import os
import statistics
import time

import torch
from torch.fx.experimental.symbolic_shapes import optimization_hint

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


def _median_s(fn, repeat: int) -> float:
    with torch.no_grad():
        fn()  # warm-up (and the first call's capture, where there is one)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _collective_share(module, inputs) -> tuple[float, float, list[tuple[int, torch.dtype]]]:
    """Rank 0's seconds in the graph's collectives during one call, the call's seconds, and the size
    in bytes and dtype of each all-reduce of the graph (at the capture's example sizes: these inputs)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        module(**inputs)
        total = time.perf_counter() - t
    keys = ("_c10d_functional::all_reduce", "_c10d_functional::wait_tensor")
    comm = sum(e.cpu_time_total for e in prof.key_averages() if e.key in keys) / 1e6
    graph = module.module.graph_module.graph
    reduced = [n.meta["val"] for n in graph.find_nodes(op="call_function", target=_ALL_REDUCE)]
    sizes = [(optimization_hint(v.numel()) * v.element_size(), v.dtype) for v in reduced]
    return comm, total, sizes


def _allreduce_worker(rank: int, port: int, sizes: list[tuple[int, torch.dtype]], repeat: int, queue) -> None:
    import torch.distributed as dist

    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(60)
    )
    out = {}
    for n, dtype in sizes:
        x = torch.ones(n // dtype.itemsize, dtype=dtype)
        for _ in range(3):
            dist.all_reduce(x)
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t)
        out[n, dtype] = statistics.median(times)
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def allreduce_costs(sizes: list[tuple[int, torch.dtype]], repeat: int = 50) -> dict[tuple[int, torch.dtype], float]:
    import torch.multiprocessing as mp

    from amxopt.runtime.tp import _free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, port, sizes, repeat, queue)) for r in range(2)]
    for p in procs:
        p.start()
    result = queue.get(timeout=300)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-vl-2b-vision")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    import amxopt
    from amxopt import models
    from amxopt.cli import check_run_options
    from amxopt.ops import native

    check_run_options(parser, args.repeat, None, "--repeat")
    if args.model not in models.ZOO:
        parser.error(f"--model: unknown {args.model!r}; known: {list(models.ZOO)}")

    native.refuse_software_tiles("bench_tp")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {native.cpu_model()}, tier {native.active_tier()}"
    )
    model = models.build_model(args.model, dtype)
    inputs = models.example_inputs(args.model, dtype)
    config = amxopt.AmxConfig(keep_source=True, autotune=False, graph_cache=False)
    rows = {"eager": _median_s(lambda: model(**inputs), args.repeat)}
    one = amxopt.optimize(model, inputs, config)
    single = f"amxopt tp=1 ({torch.get_num_threads()} threads)"
    rows[single] = _median_s(lambda: one(**inputs), args.repeat)
    two = amxopt.optimize(model, inputs, dataclasses.replace(config, tp=2))
    try:
        rows["amxopt tp=2 (1 core per rank)"] = _median_s(lambda: two(**inputs), args.repeat)
        comm, total, reduced = _collective_share(two, inputs)
    finally:
        two.close()
    base = rows[single]
    print(f"\n## {args.model} ({args.dtype}), median of {args.repeat}\n")
    print("| run | median s | vs eager | vs tp=1 |")
    print("|---|---|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {s:.3f} | {rows['eager'] / s:.2f}x | {base / s:.2f}x |")
    print(
        f"\nrank 0 of tp=2: {len(reduced)} all-reduces per call, {comm:.3f} s of a {total:.3f} s profiled call in "
        f"all_reduce + wait_tensor ({100 * comm / total:.0f}%, including waiting for rank 1)"
    )
    counts = collections.Counter(reduced)
    costs = allreduce_costs(sorted(counts, key=lambda size: size[0]))
    print("\ngloo all-reduce at the graph's sizes, 2 processes bound to one core each (median of 50):")
    for (n, dtype), s in costs.items():
        print(
            f"  {n / 2**20:8.3f} MB {str(dtype).removeprefix('torch.')} x{counts[n, dtype]} per call: "
            f"{s * 1e3:8.3f} ms ({n / s / 2**30:.2f} GB/s)"
        )


if __name__ == "__main__":
    main()
