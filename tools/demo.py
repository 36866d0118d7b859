"""make demo: Qwen3-VL answers about an image, end to end, with ``amxopt.optimize(model)``.

The model is ``Qwen3VLForConditionalGeneration`` with the real Qwen3-VL-2B vision tower and a small
4-layer language model at the 2B width and a 512-token vocabulary (the released one has 151,936;
random weights: no hub access). The prompt holds one
generated 448x448 image (784 patches, 196 image tokens). The demo

1. answers with the original model in bf16 (eager), timing ``generate``;
2. runs ``model = amxopt.optimize(model)`` and answers again: the first call captures, rewrites and
   packs the vision tower (timed apart), later calls run the rewritten graph;
3. prints the report, both answers, the error of each answer's first-token logits against the
   fp32 original, and the median times of interleaved calls within ``--budget`` seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import amxopt
from amxopt import pipelines
from amxopt.ops import native


def generate(model, inputs, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(answer tokens, first-token logits, seconds) of one greedy ``generate``."""
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    secs = time.perf_counter() - t
    return out.sequences[0, inputs["input_ids"].shape[1] :], out.logits[0][0].float(), secs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=448, help="image side in pixels")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--budget", type=float, default=40.0, help="seconds of extra interleaved timing rounds")
    args = parser.parse_args()
    start = time.perf_counter()

    print("building Qwen3-VL: 2B vision tower + 4-layer language model (random weights, real configs) ...")
    model = pipelines.build_qwen3_vl("small", torch.bfloat16)
    inputs = pipelines.qwen3_vl_prompt(model, images=[(args.size, args.size)])
    grid = inputs["image_grid_thw"].tolist()
    print(f"prompt: {inputs['input_ids'].shape[1]} tokens with one {args.size}x{args.size} image (grid_thw {grid})\n")

    with torch.no_grad():  # the fp32 original's first-token logits: the same weights before rounding
        fp32 = pipelines.build_qwen3_vl("small", torch.float32)
        ref = fp32(**pipelines.qwen3_vl_prompt(fp32, images=[(args.size, args.size)])).logits[0, -1].float()
        del fp32

    generate(model, inputs, args.new_tokens)  # a warm-up, untimed, as amxopt's first call is below
    eager_tokens, eager_logits, eager_s = generate(model, inputs, args.new_tokens)
    times = {"eager bf16": [eager_s], "amxopt bf16": []}

    source = model.model.visual
    # The vision tower is replaced in place (the rest is untouched); its source is kept for the eager rounds.
    model = amxopt.optimize(model, config=amxopt.AmxConfig(keep_source=True))
    optimized = model.model.visual
    _, _, first_s = generate(model, inputs, args.new_tokens)  # capture + rewrite + pack + run
    opt_tokens, opt_logits, opt_s = generate(model, inputs, args.new_tokens)
    times["amxopt bf16"].append(opt_s)
    print(model.amxopt_report, "\n")

    deadline = time.perf_counter() + args.budget
    while time.perf_counter() + eager_s + opt_s < deadline:  # interleaved: drift hits both alike
        for name, visual in (("eager bf16", source), ("amxopt bf16", optimized)):
            model.model.visual = visual
            times[name].append(generate(model, inputs, args.new_tokens)[2])

    err_eager = (eager_logits - ref).abs().max().item()
    err_opt = (opt_logits - ref).abs().max().item()
    same = "the same answer" if torch.equal(eager_tokens, opt_tokens) else "answers differ"
    print(f"answer (token ids; random weights make no words): eager {eager_tokens.tolist()}")
    print(f"                                                 amxopt {opt_tokens.tolist()}  ({same})")
    print("first-token logits, max abs error against the fp32 original:")
    print(f"  eager bf16   {err_eager:.3e}\n  amxopt bf16  {err_opt:.3e}   ({err_opt / err_eager:.2f}x eager's)\n")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tier = native.active_tier() if optimized.amx_config.provider == "native" else "-"
    print(
        f"generate({args.new_tokens} tokens), median of {len(times['eager bf16'])}/{len(times['amxopt bf16'])} calls "
        f"on {native.cpu_model()} ({torch.get_num_threads()} threads, amxopt tier {tier}):"
    )
    for name, secs in med.items():
        print(f"  {name:<12} {secs:8.2f} s")
    print(f"  speed-up     {med['eager bf16'] / med['amxopt bf16']:8.2f}x")
    print(f"  (amxopt's first call, with capture, rewrite and packing: {first_s:.1f} s)")
    print(f"demo took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
