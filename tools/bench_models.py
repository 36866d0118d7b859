"""Whole-model benchmark: eager fp32, eager bf16, torch.compile (freezing, bf16) and amxopt (bf16).

One model at a time, real configs with random weights (amxopt.models), the variants interleaved
(round-robin, every other round in reverse order) and the median of --repeats after a warm-up
call; ratios against eager bf16, both as the ratio of the medians and as the median of each round's
ratio (the two calls of a round run seconds apart, on a machine whose speed moves in phases). Also
the max abs error of every bf16 variant against eager fp32, and the one-time cost of torch.compile's
first call and of amxopt.optimize.

End-to-end rows (``E2E``) run the caller's own code on a whole model or pipeline, optimized with
``amxopt.optimize(model)`` (each part captured at its first call, which is the setup cost):
Qwen3-VL ``generate`` (real 2B vision tower + a 4-layer language model at the 2B width with a
512-token vocabulary, not the released 151,936: its LM head is a stand-in; 448x448 image, 8 new tokens; error on the first-token logits) and one Wan2.1-1.3B ``WanPipeline`` step
(guidance on, so two transformer calls; a 2-layer UMT5 at XXL width; latents out, no VAE decode).
torch.compile is not run on them (it would compile the pipeline's Python, not one module).

    .venv/bin/python tools/bench_models.py [--models qwen3-vl-2b-vision,...,wan2.1-pipeline-step] [--repeats 5]
        [--pinned-schedules]   # on AMX: amxopt again with each GEMM schedule pinned (autotune picks per linear)
        [--pool-off]           # amxopt again with its output pool switched off (model rows only)

Real sizes, where every activation is tens of MB or more: ``--size`` replaces the input size and
``--config`` values of the real config, e.g. one block of Wan2.1-1.3B at 480p x 81 frames (32,760 tokens):

    .venv/bin/python tools/bench_models.py --models wan2.1-t2v-1.3b --size 21,60,104,512 --config num_layers=1 \
        --no-compile --pool-off --repeats 2
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import pathlib
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import amxopt
from amxopt import models, pipelines
from amxopt.cli import check_run_options
from amxopt.ops import native
from amxopt.ops.providers import available_providers
from amxopt.passes import DEFAULT_PASSES
from amxopt.runtime import max_abs_error

# model -> (input size, what it is)
DEFAULT_MODELS = {
    "qwen3-vl-2b-vision": (448, "one 448x448 image (784 patches)"),
    "qwen3-omni-audio": (30.0, "30 s of audio"),
    "wan2.1-t2v-1.3b": ((5, 32, 32, 512), "one step, latent 16x5x32x32 + 512 text tokens"),
}


_VL_PROMPT = dict(images=[(448, 448)])
_WAN_STEP = pipelines.wan_call(256, 256, 17, steps=1, output_type="latent")


def _vl_generate(model):
    inputs = pipelines.qwen3_vl_prompt(model, **_VL_PROMPT)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.logits[0].float()


def _wan_step(pipe):
    return pipe(**_WAN_STEP, generator=torch.Generator().manual_seed(0)).frames.float()


# name -> (build(dtype), run(model or pipeline) -> output compared against fp32, what it is)
E2E = {
    "qwen3-vl-2b-generate": (
        lambda dtype: pipelines.build_qwen3_vl("small", dtype),
        _vl_generate,
        "Qwen3-VL generate: 2B vision + 4-layer LM, one 448x448 image, 8 new tokens",
    ),
    "wan2.1-pipeline-step": (
        lambda dtype: pipelines.build_wan_pipeline("wan2.1-t2v-1.3b", dtype, text_encoder="xxl-2"),
        _wan_step,
        "WanPipeline, Wan2.1-1.3B, one step with guidance, 17x256x256 video (latent 5x32x32), 512 text tokens",
    ),
}


def bench_e2e(name: str, repeats: int) -> dict:
    build, run, what = E2E[name]
    print(f"\n## {name}: {what}", flush=True)
    variants = {
        "eager fp32": build(torch.float32),
        "eager bf16": build(torch.bfloat16),
        "amxopt bf16": amxopt.optimize(build(torch.bfloat16)),
    }
    outputs, setup = {}, {}
    with torch.no_grad():
        for label, obj in variants.items():  # warm-up; amxopt's first call captures, rewrites and packs
            outputs[label], secs = timed(lambda: run(obj), {})
            if label.startswith("amxopt"):
                setup["amxopt first call (capture + rewrite + pack + run)"] = secs
        times = {label: [] for label in variants}
        for label, obj in rounds(variants, repeats):
            times[label].append(timed(lambda: run(obj), {})[1])
    report = variants["amxopt bf16"].amxopt_report
    print(report)
    return _summarize(
        name,
        what,
        next(iter(report.optimized.values())).amx_config.provider,
        times,
        outputs,
        setup,
        {"graphs_per_part": {k: len(v.graphs) for k, v in report.optimized.items()}},  # not replaced-node counts
        repeats,
    )


def rounds(variants: dict, repeats: int):
    """(label, variant) for ``repeats`` rounds of every variant, every other round in reverse order, so
    that what one call leaves behind for the next (caches, the allocator's state) falls on all alike."""
    items = list(variants.items())
    for r in range(repeats):
        yield from items if r % 2 == 0 else reversed(items)


def page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(fn, inputs) -> tuple[object, float]:
    t = time.perf_counter()
    out = fn(**inputs)
    return out, time.perf_counter() - t


def within(fn, context):
    """``fn`` run inside ``context()``, a fresh context manager per call (``native.use_amx_schedule``,
    ``native.use_output_pool``)."""

    def run(**inputs):
        with context():
            return fn(**inputs)

    return run


def compile_baseline(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` with freezing, with dynamo's recompile limits raised above ``model``'s module
    count, so that every block compiles. Qwen's vision blocks and Omni's audio layers each compile as a
    frame of their own (a data-dependent ``repeat_interleave`` breaks the graph above them), guarded on
    that block's parameters: at dynamo's default limit of 8, the 9th block on ran eager (16 of Qwen3-VL-2B's
    24 vision blocks, 24 of Omni's 32 audio layers) in the baseline labelled torch.compile."""
    torch._inductor.config.freezing = True
    count = sum(1 for _ in model.modules())
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, count)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 8 * count)
    return torch.compile(model)


def bench_model(
    name: str,
    size,
    repeats: int,
    with_compile: bool = True,
    without: tuple[str, ...] = (),
    autotune_off: bool = False,
    pinned_schedules: bool = False,
    config: dict | None = None,
    pool_off: bool = False,
) -> dict:
    default_size, default_what = DEFAULT_MODELS.get(name, (None, ""))
    if size is None:  # a zoo model without a benchmark default: the zoo's own
        size = models.ZOO[name].default_size
    what = default_what if size == default_size else f"size {size}"
    print(f"\n## {name}: {what}{f', config {config}' if config else ''}", flush=True)
    fp32 = models.build_model(name, torch.float32, **(config or {}))
    bf16 = models.build_model(name, torch.bfloat16, **(config or {}))
    x32 = models.example_inputs(name, torch.float32, size=size, config=config)
    x16 = models.example_inputs(name, torch.bfloat16, size=size, config=config)
    setup = {}
    with torch.no_grad():
        t = time.perf_counter()
        opt = amxopt.optimize(bf16, x16, amxopt.AmxConfig(keep_source=True))  # eager bf16 runs too
        setup["amxopt.optimize"] = time.perf_counter() - t
        compiled = compile_baseline(bf16)
        variants = {
            "eager fp32": (fp32, x32),
            "eager bf16": (bf16, x16),
            "torch.compile bf16": (compiled, x16),
            "amxopt bf16": (opt, x16),
        }
        if not with_compile:
            del variants["torch.compile bf16"]
        if available_providers()["sgl_kernel"][0]:  # SGLang's CPU kernels behind the same graph
            sgl = amxopt.optimize(bf16, x16, amxopt.AmxConfig(keep_source=True, provider="sgl_kernel"))
            variants["amxopt[sgl_kernel] bf16"] = (sgl, x16)
        if without:  # the same optimize() minus these passes: what they add, measured in this run
            passes = [p.__name__ for p in DEFAULT_PASSES if p.__name__ not in without]
            ablated = amxopt.optimize(bf16, x16, amxopt.AmxConfig(keep_source=True, passes=passes))
            variants[f"amxopt bf16 without {'+'.join(without)}"] = (ablated, x16)
        if autotune_off:  # every rewrite kept: what autotune's choices add or cost, measured in this run
            every = amxopt.optimize(bf16, x16, amxopt.AmxConfig(keep_source=True, autotune=False))
            variants["amxopt bf16, autotune off"] = (every, x16)
        if pinned_schedules:  # each of the amx tier's GEMM schedules for every linear, optimized and run in it
            for schedule in native.AMX_SCHEDULES:
                with native.use_amx_schedule(schedule):
                    pinned = amxopt.optimize(bf16, x16, amxopt.AmxConfig(keep_source=True))
                variants[f"amxopt bf16, {schedule} schedule pinned"] = (
                    within(pinned, lambda s=schedule: native.use_amx_schedule(s)),
                    x16,
                )
        if pool_off:  # the same optimized model, its large outputs from ATen's allocator (fresh pages)
            variants["amxopt bf16, output pool off"] = (within(opt, lambda: native.use_output_pool(False)), x16)
        outputs = {}
        for label, (fn, inputs) in variants.items():  # warm-up (and torch.compile's compilation)
            outputs[label], secs = timed(fn, inputs)
            if label == "torch.compile bf16":
                setup["torch.compile first call"] = secs
        times = {label: [] for label in variants}
        faults = {label: [] for label in variants}
        for label, (fn, inputs) in rounds(variants, repeats):
            before = page_faults()
            times[label].append(timed(fn, inputs)[1])
            faults[label].append(page_faults() - before)
    print(f"report counts {opt.report.counts()}; left {len(opt.report.left)}")
    result = _summarize(
        name, str(size), opt.amx_config.provider, times, outputs, setup, opt.report.counts(), repeats, faults
    )
    result["config"] = config or {}
    del fp32, bf16, opt, compiled, variants, outputs
    torch._dynamo.reset()
    gc.collect()
    return result


def _summarize(name, what, provider, times, outputs, setup, counts, repeats, faults=None) -> dict:
    med = {label: statistics.median(ts) for label, ts in times.items()}
    # Each round runs every variant once, so a round's eager bf16 / variant compares two calls a few
    # seconds apart: the median of those ratios follows the machine's slow and fast phases less than
    # the ratio of the two medians does.
    paired = {
        label: statistics.median(e / t for e, t in zip(times["eager bf16"], ts, strict=True))
        for label, ts in times.items()
    }
    errors = {label: max_abs_error(outputs[label], outputs["eager fp32"]) for label in times if "bf16" in label}
    # page faults a call (minor: fresh pages of large allocations), the median over the rounds
    faults_med = {label: int(statistics.median(f)) for label, f in (faults or {}).items()}
    print(
        "| variant | median s | vs eager bf16 | paired rounds vs eager bf16 | max abs err vs fp32 | page faults a call |"
        "\n|---|---|---|---|---|---|"
    )
    for label, secs in med.items():
        err = f"{errors[label]:.3e}" if label in errors else "-"
        flt = f"{faults_med[label]:,}" if label in faults_med else "-"
        print(f"| {label} | {secs:.3f} | {med['eager bf16'] / secs:.2f}x | {paired[label]:.2f}x | {err} | {flt} |")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        "one-time: " + ", ".join(f"{k} {v:.1f} s" for k, v in setup.items()) + f"; peak RSS {peak_mb:.0f} MB",
        flush=True,
    )
    return dict(
        model=name,
        input=what,
        provider=provider,
        median_s=med,
        rounds_s=times,
        ratio_vs_eager_bf16={k: med["eager bf16"] / v for k, v in med.items()},
        paired_ratio_vs_eager_bf16=paired,
        max_abs_error_vs_fp32=errors,
        page_faults_per_call=faults_med,
        peak_rss_mb=peak_mb,
        setup_s=setup,
        counts=counts,
        repeats=repeats,
    )


def each_in_its_own_process(names: list[str], argv: list[str]) -> list[dict]:
    """Runs this script once per model, the other arguments as given, and gathers the results: what one
    model leaves behind (torch.compile's caches, its fp32 and bf16 copies) never adds to the next. All
    five default models in one process passed 24 GB and were killed by the OOM killer on a 24 GB machine."""
    rest, skip = [], False
    for a in argv:  # argv without --models / --json and their values
        if skip:
            skip = False
        elif a in ("--models", "--json"):
            skip = True
        elif not a.startswith(("--models=", "--json=")):
            rest.append(a)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            out = pathlib.Path(d) / f"{name}.json"
            cmd = [sys.executable, __file__, "--models", name, "--json", str(out), *rest]
            done = subprocess.run(cmd, check=False)
            if done.returncode != 0:
                print(f"\n{name}: the benchmark process failed with exit code {done.returncode}", flush=True)
                results.append(dict(model=name, failed=done.returncode))
            else:
                results += json.loads(out.read_text())
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join([*DEFAULT_MODELS, *E2E]))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--without",
        default="",
        help="also run amxopt with these passes (comma-separated, e.g. replace_glue) left out, interleaved; "
        "model rows only",
    )
    parser.add_argument(
        "--autotune-off",
        action="store_true",
        help="also run amxopt with autotune off (every rewrite kept), interleaved: what autotune's choices are "
        "worth; model rows only",
    )
    parser.add_argument(
        "--no-compile",
        dest="with_compile",
        action="store_false",
        help="skip torch.compile (its first call takes minutes where bf16 is emulated, e.g. AMD Zen 3)",
    )
    parser.add_argument(
        "--pinned-schedules",
        action="store_true",
        help="also run amxopt with each of the amx tier's GEMM schedules pinned for every linear "
        "(AMXOPT_AMX_SCHEDULE), interleaved with amxopt as autotuned (the faster schedule per linear shape); "
        "model rows only, AMX CPUs only",
    )
    parser.add_argument(
        "--pool-off",
        action="store_true",
        help="also run amxopt with the native ops' output pool switched off (native.use_output_pool), interleaved; "
        "model rows only",
    )
    parser.add_argument(
        "--size",
        default=None,
        help="input size instead of the default (a Python literal as amxopt.models.example_inputs takes: "
        "448, (224, 336), 21,60,104,512); one zoo model only",
    )
    parser.add_argument(
        "--config",
        default="",
        help="config values replacing the real config's, comma-separated key=literal (num_layers=1): "
        "real sizes for a part of a model; one zoo model only",
    )
    args = parser.parse_args()
    native.refuse_software_tiles("bench_models")
    config = {}
    for item in filter(None, re.split(r",(?=\s*\w+\s*=)", args.config)):  # a value may hold commas: (1, 2, 2)
        key, eq, value = item.partition("=")
        if not eq:
            parser.error(f"--config: {item!r} is not key=value")
        try:
            config[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parser.error(f"--config: {value!r} is not a Python literal (in {item!r})")
    if (config or args.size) and (len(args.models.split(",")) > 1 or args.models in E2E):
        parser.error("--size / --config: name one zoo model with --models")
    if unknown := [n for n in args.models.split(",") if n not in models.ZOO and n not in E2E]:
        parser.error(f"--models: unknown {unknown}; known: {[*models.ZOO, *E2E]}")
    check_run_options(parser, args.repeats, args.json)
    if config or args.size:
        _check_model_options(parser, args.models, args.size, config)
    if args.pinned_schedules and native.active_tier() != "amx":
        parser.error(
            f"--pinned-schedules: the GEMM schedules order the amx tier, and this CPU runs {native.active_tier()}"
        )
    row_flags = {"--without": args.without, "--autotune-off": args.autotune_off}
    row_flags.update({"--pinned-schedules": args.pinned_schedules, "--pool-off": args.pool_off})
    if (asked := [flag for flag, value in row_flags.items() if value]) and all(
        n in E2E for n in args.models.split(",")
    ):
        parser.error(f"{' / '.join(asked)}: model rows only, and --models names end-to-end rows only")
    without = tuple(p for p in args.without.split(",") if p)
    unknown = [p for p in without if p not in {q.__name__ for q in DEFAULT_PASSES}]
    if unknown:
        parser.error(f"--without: unknown passes {unknown}")
    names = args.models.split(",")
    if len(names) > 1:  # one fresh process per model (see each_in_its_own_process)
        results = each_in_its_own_process(names, sys.argv[1:])
    else:
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {native.cpu_model()}, "
            f"amxopt tier {native.active_tier()}, AMX GEMM schedule "
            f"{native.amx_schedule() + ' (pinned)' if native.amx_schedule_pinned() else 'per linear (autotune)'}",
            flush=True,
        )
        name = names[0]
        if name in E2E:
            results = [bench_e2e(name, args.repeats)]
        else:
            results = [
                bench_model(
                    name,
                    args.size if args.size is not None else DEFAULT_MODELS.get(name, (None,))[0],
                    args.repeats,
                    args.with_compile,
                    without,
                    args.autotune_off,
                    args.pinned_schedules,
                    config,
                    args.pool_off,
                )
            ]
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    failed = [r["model"] for r in results if "failed" in r]
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _check_model_options(parser: argparse.ArgumentParser, name: str, size: str | None, config: dict) -> None:
    """Before anything is built: ``--config`` keys the model's config has, of the type its value
    has there (a count or size at least 1), and a ``--size`` its family takes."""
    real = models.ZOO[name].config()
    for key, value in config.items():
        default = real.get(key) if isinstance(real, dict) else getattr(real, key, None)
        if type(default) is int and default >= 1 and (type(value) is not int or value < 1):
            parser.error(f"--config {key}={value!r}: {name}'s {key} is a count or size ({default}), an integer >= 1")
    try:
        models.example_inputs(name, size=size, config=config)
    except (KeyError, ValueError, TypeError) as e:
        parser.error(f"--size / --config: {e.args[0] if isinstance(e, KeyError) else e}")


if __name__ == "__main__":
    sys.exit(main())
