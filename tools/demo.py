"""make demo: the real-size Qwen3-VL-2B vision encoder on a generated 448x448 image.

Prints the rewrite report, the max abs error of the optimized model against the original
(fp32: optimized fp32 vs original fp32; bf16: optimized bf16 and original bf16, each vs original
fp32), and eager vs optimized time (medians, interleaved in one process).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import amxopt
from amxopt import models
from amxopt.ops import native
from amxopt.runtime import max_abs_error


def median_times(fns: dict, inputs: dict, repeats: int, budget_s: float) -> tuple[dict[str, float], int]:
    """Medians of interleaved calls: ``repeats`` rounds, fewer if a round would overrun ``budget_s``."""
    times = {name: [] for name in fns}
    with torch.no_grad():
        t = time.perf_counter()
        for name, fn in fns.items():  # warm-up
            fn(**inputs)
        repeats = max(1, min(repeats, int(budget_s / (time.perf_counter() - t))))
        for _ in range(repeats):
            for name, fn in fns.items():  # interleaved, so drift on a shared machine hits all alike
                t = time.perf_counter()
                fn(**inputs)
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}, repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-vl-2b-vision")
    parser.add_argument("--size", type=int, default=448, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds for the timed rounds (fewer if slow)")
    args = parser.parse_args()

    print(f"building {args.model} (random weights, real config) ...", flush=True)
    fp32 = models.build_model(args.model, torch.float32)
    bf16 = models.build_model(args.model, torch.bfloat16)
    x32 = models.example_inputs(args.model, torch.float32, size=args.size)
    x16 = models.example_inputs(args.model, torch.bfloat16, size=args.size)
    print(
        f"input: {args.size}x{args.size} image -> {x32['hidden_states'].shape[0]} patches, "
        f"grid_thw {x32['grid_thw'].tolist()}\n",
        flush=True,
    )

    t = time.perf_counter()
    opt32 = amxopt.optimize(fp32, x32)
    opt16 = amxopt.optimize(bf16, x16)
    took = time.perf_counter() - t
    print(opt16.report)
    print(f"\n(capture + rewrite + packing of both models: {took:.1f} s)\n")

    with torch.no_grad():
        ref32 = fp32(**x32)
        err32 = max_abs_error(opt32(**x32), ref32)
        err_eager16 = max_abs_error(bf16(**x16), ref32)
        err_opt16 = max_abs_error(opt16(**x16), ref32)
    print("max abs error against the original fp32 model:")
    print(f"  optimized fp32          {err32:.3e}")
    print(f"  original  bf16 (eager)  {err_eager16:.3e}")
    print(f"  optimized bf16          {err_opt16:.3e}   ({err_opt16 / err_eager16:.2f}x the eager bf16 error)\n")

    t, repeats = median_times({"eager bf16": bf16, "amxopt bf16": opt16}, x16, args.repeats, args.budget)
    print(
        f"time, median of {repeats} on {native.cpu_model()} ({torch.get_num_threads()} threads; provider "
        f"{opt16.amx_config.provider}, tier {native.active_tier() if opt16.amx_config.provider == 'native' else '-'}):"
    )
    for name, secs in t.items():
        print(f"  {name:<12} {secs * 1000:8.1f} ms")
    print(f"  speed-up     {t['eager bf16'] / t['amxopt bf16']:8.2f}x")


if __name__ == "__main__":
    main()
