"""amxopt command line: a thin layer over the library.

amxopt passes                      the default pass order
amxopt info [--tp N] [--threads N] CPU features, kernel providers, work items (and N tp ranks' cores)
amxopt dump MODEL [--out DIR] [--tp N --rank R]   graphs before/after every pass (text, SVG, diff,
                                   index.html) + the rewrite report; MODEL is a zoo name or
                                   package.module:factory returning (model, inputs)
amxopt check MODEL                 optimized vs original (MODEL as for dump): max abs error (fp32 and bf16)
amxopt profile MODEL [--by-shape] [--json F]   where the optimized model's call spends its time, per op
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import pathlib
import sys
import time
import traceback

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cmd_passes(args) -> int:
    from amxopt.passes import DEFAULT_PASSES

    for i, p in enumerate(DEFAULT_PASSES, 1):
        doc = (p.__module__ and sys.modules[p.__module__].__doc__ or "").strip()
        summary = " ".join(doc.split("\n\n")[0].split())  # the first paragraph, which may wrap
        print(f"{i}. {summary}")
    return 0


def _cmd_info(args) -> int:
    from amxopt.ops import native
    from amxopt.ops.providers import available_providers, resolve

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"cpu: {native.cpu_model()}")
    flags = native.cpu_flags()
    wanted = ("amx_tile", "amx_bf16", "avx512f", "avx512_bf16", "avx512_vnni", "avx2", "fma")
    print("     " + ", ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted))
    for name, (ok, why) in available_providers().items():
        print(f"provider {name:<10} {'available' if ok else 'unavailable'}: {why}")
    if args.tp:
        from amxopt.runtime.tp import describe_plan

        print(f"tensor parallel plan for tp={args.tp}:\n{describe_plan(args.tp)}")
    if resolve("auto") != "native":
        print("every op runs the reference (plain ATen)")
        return 0
    for tier in native.TIERS:
        ok, why = native.tier_supported(tier)
        emulated = " on software tiles (AMXOPT_EMULATE_AMX=1: for tests, many times slower)"
        where = emulated if tier == "amx" and ok and native.amx_emulated() else ""
        print(f"tier {tier:<12} {'runs here' + where if ok else 'skipped: ' + why}")
    tier = native.active_tier()
    print(
        f"active tier: {tier}; vector ISA of epilogues and norms: {native.vec_isa()}; "
        f"oneDNN bf16 matmul ISA: {native.onednn_isa()}"
    )
    print(f"  amxopt.linear            -> {native.gemm_engine(tier, 784)} (M=784); {native.gemm_engine(tier, 1)} (M=1)")
    print("  amxopt.patch_embed       -> the linear engine on gathered patches")
    conv_gemm = {"amx": "im2col + the linear engine", "fp32": "ATen's convolution in fp32"}.get(tier, "ATen's")
    print(f"  amxopt.conv2d            -> Cin*kh*kw <= 64: direct kernel; larger bf16: {conv_gemm}")
    print(
        f"  amxopt.varlen_attention  -> bf16: {native.attention_engine(tier, True)}; "
        f"fp32: {native.attention_engine(tier, False)}"
    )
    print(f"  amxopt.layer_norm/rms_norm -> {native.vec_isa()} row kernel, fp32 accumulation")
    print(
        f"  amxopt.norm_modulate/gated_residual/rotary_embedding -> {native.vec_isa()} row kernel, fp32 math, "
        "one rounding"
    )
    _print_work_items(args.threads or torch.get_num_threads())
    return 0


# The op shapes: linear (rows, K, N); attention (segment lengths, heads).
_WORK_LINEARS = ((784, 1024, 3072), (784, 1024, 4096), (784, 4096, 1024), (1280, 1536, 8960), (16, 1024, 4096))
_WORK_ATTENTIONS = (([784], 16), ([104] * 8, 20), ([1280], 12))


def _print_work_items(threads: int) -> None:
    """How the GEMM and attention kernels cut the work at ``threads`` threads, and the share of the
    threads their items keep busy (smaller items than the tuned ones where those would leave some idle)."""
    from amxopt.ops import native

    print(f"work items at {threads} threads (--threads N: another count), and the threads they keep busy:")
    for m, k, n in _WORK_LINEARS:
        s = native.linear_work_split(m, n, k, threads)
        item = f"{min(s.rows, m)} rows x {min(s.cols, n)} columns"
        print(f"  linear {m}x{k}->{n}: {s.items} of {item} ({s.balance(threads):.0%})")
    for lens, heads in _WORK_ATTENTIONS:
        s = native.attention_work_split(lens, heads, True, threads)
        segs = f"{len(lens)} x {lens[0]}" if len(lens) > 1 else str(lens[0])
        rows = min(s.rows, max(lens))
        print(f"  attention {heads} heads x {segs} (bf16): {s.items} of {rows} query rows ({s.balance(threads):.0%})")


def _cmd_dump(args) -> int:
    from amxopt import AmxConfig
    from amxopt.capture import prepare
    from amxopt.ops.providers import resolve
    from amxopt.runtime import build_graph, dump

    config = AmxConfig(provider=resolve(args.provider), autotune=args.autotune)
    if args.tp > 1:  # one rank's shard, as that rank would build it; the graph is written, not run
        config = dataclasses.replace(config, tp=args.tp, tp_rank=args.rank, tp_group="amxopt-dump")
    model, inputs = dump.load_target(args.model, _DTYPES[args.dtype], args.size)
    if model.training:  # as optimize() refuses it: dropout would stay in the dumped graph
        raise ValueError(f"{type(model).__name__} is in training mode; amxopt optimizes inference, call .eval()")
    adapter, graph_inputs = prepare(model, inputs)
    graph = build_graph(model, adapter, graph_inputs, config, keep_text=True)
    out = pathlib.Path(args.out or f"dumps/{args.model.replace(':', '.')}")
    files = dump.write(graph, out, args.model)
    print(graph.report)
    print(f"\nwrote {len(files)} files to {out}/: open {out / 'index.html'}")
    return 0


def _cmd_check(args) -> int:
    import amxopt
    from amxopt.capture import split_inputs
    from amxopt.runtime import compare, dump

    failed = False
    for name in ("fp32", "bf16"):
        model, inputs = dump.load_target(args.model, _DTYPES[name], args.size)
        call_args, call_kwargs = split_inputs(inputs)
        t = time.perf_counter()
        opt = amxopt.optimize(
            model, inputs, amxopt.AmxConfig(provider=args.provider, autotune=args.autotune, keep_source=True)
        )
        took = time.perf_counter() - t
        with torch.no_grad():
            actual, expected = opt(*call_args, **call_kwargs), model(*call_args, **call_kwargs)
            if name == "bf16":  # the same weights in fp32: the reference both bf16 runs are measured against
                fp32_args, fp32_kwargs = split_inputs(dump.cast_inputs(inputs, torch.float32))
                reference = model.float()(*fp32_args, **fp32_kwargs)
        if name == "fp32":  # (error, eager bf16's error, allowed) per output
            errors = compare.leaf_errors(actual, expected)
            leaves = [(err, None, _FP32_TOLERANCE * max(_FP32_SMALLEST, scale)) for err, scale in errors]
        else:
            eager = [err for err, _ in compare.leaf_errors(expected, reference)]
            leaves = [
                (err, eager_err, max(_BF16_OVER_EAGER * eager_err, _BF16_FLOOR * (scale + 1e-3)))
                for (err, scale), eager_err in zip(compare.leaf_errors(actual, reference), eager, strict=True)
            ]
        bad = not all(err <= allowed for err, _, allowed in leaves)  # NaN fails too
        failed |= bad

        # the output nearest its bound (a NaN first); where there are several, the largest error of all too
        def nearness(i: int) -> float:
            err, _, allowed = leaves[i]
            return math.inf if math.isnan(err) else err / max(allowed, 1e-30)

        nearest = max(range(len(leaves)), key=nearness)
        err, eager_err, allowed = leaves[nearest]
        eager = "" if eager_err is None else f"eager bf16's {eager_err:.3e}"
        verdict = f"{' FAILS' if bad else ''} (allowed {allowed:.1e})"
        if len(leaves) == 1:
            against = "the original" if eager_err is None else f"the fp32 original ({eager})"
            errors = f"max abs error vs {against} {err:.3e}{verdict}"
        else:
            largest = max((e for e, _, _ in leaves), key=lambda e: math.inf if math.isnan(e) else e)
            errors = (
                f"max abs error vs the {'' if eager_err is None else 'fp32 '}original {largest:.3e} over "
                f"{len(leaves)} outputs; nearest its bound: output {nearest}, {err:.3e}{verdict}"
                + (f", {eager}" if eager else "")
            )
        print(f"{name}: optimized in {took:.1f}s, {errors}, counts {opt.report.counts()}")
    return 1 if failed else 0


# fp32: kernels differ from ATen's only in summation order: max abs error per output within 2e-5
# of its largest finite magnitude (taken as at least 0.01: an output of all but zeros allows 2e-7).
# Measured at the real configs (Qwen3-VL-2B vision, Omni audio, Wan2.1-1.3B): 0.6-1.2e-6; the old
# bound, 1e-3, passed an attention that swapped two tokens' outputs (4e-4).
# bf16, as the tests judge it: each output of the optimized model within 1.5x eager bf16's error
# against the same weights in fp32, or 2% of its magnitude.
_FP32_TOLERANCE, _FP32_SMALLEST = 2e-5, 1e-2
_BF16_OVER_EAGER, _BF16_FLOOR = 1.5, 2e-2


def _cmd_profile(args) -> int:
    import json

    import amxopt
    from amxopt.runtime import dump

    model, inputs = dump.load_target(args.model, _DTYPES[args.dtype], args.size)
    opt = amxopt.optimize(model, inputs, amxopt.AmxConfig(provider=args.provider, autotune=args.autotune))
    profile = opt.profile(inputs, repeats=args.repeats, by_shape=args.by_shape)
    print(f"{args.model} ({args.dtype}, {torch.get_num_threads()} threads), median of {args.repeats} runs")
    print(profile)
    if args.json:
        run = dict(model=args.model, dtype=args.dtype, repeats=args.repeats, threads=torch.get_num_threads())
        pathlib.Path(args.json).write_text(json.dumps(run | dict(by_shape=args.by_shape) | profile.to_json()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="amxopt", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what amxopt does; tracebacks of errors")
    # -v after the command too (as its errors' hint suggests); SUPPRESS: a command without it keeps the parser's
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("passes", help="list DEFAULT_PASSES in order", parents=[verbose]).set_defaults(fn=_cmd_passes)
    info = sub.add_parser("info", help="CPU features and kernel providers", parents=[verbose])
    info.add_argument("--tp", type=int, default=0, help="also print the cores each of N tp ranks would bind")
    info.add_argument("--threads", type=int, default=0, help="work items for N threads (default: torch's count)")
    info.set_defaults(fn=_cmd_info)
    for name, fn, text in (
        ("dump", _cmd_dump, "write graphs before/after each pass"),
        ("check", _cmd_check, "equivalence"),
        ("profile", _cmd_profile, "time per op of the optimized model's call"),
    ):
        p = sub.add_parser(name, help=text, parents=[verbose])
        p.add_argument(
            "model",
            help="a zoo name (see amxopt.models.ZOO), e.g. tiny-qwen3-vl-vision; "
            "or package.module:factory, factory() returning (model, inputs)",
        )
        p.add_argument("--size", default=None, help="input size, e.g. 448 (image side), 30 (audio s), 5,32,32")
        p.add_argument("--provider", default="auto")
        p.add_argument(
            "--no-autotune",
            dest="autotune",
            action="store_false",
            help="replace every matching node, without timing it against ATen",
        )
        if name in ("dump", "profile"):
            p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
        if name == "profile":
            p.add_argument(
                "--repeats", type=int, default=3, help="timed runs; the rows are those of the run of median total"
            )
            p.add_argument("--by-shape", action="store_true", help="one row per op and input shapes")
            p.add_argument("--json", default=None, help="also write the rows to this file")
        if name == "dump":
            p.add_argument("--out", default=None, help="output directory (default dumps/MODEL)")
            p.add_argument("--tp", type=int, default=1, help="dump the tensor-parallel shard of --rank of N ranks")
            p.add_argument("--rank", type=int, default=0)
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    if getattr(args, "size", None):
        try:
            args.size = _parse_size(args.size)
        except ValueError as e:
            parser.error(f"--size {args.size!r}: {e}")
    if args.command == "dump" and args.tp > 1 and not 0 <= args.rank < args.tp:
        parser.error(f"--rank {args.rank} is not a rank of --tp {args.tp} (0..{args.tp - 1})")
    if args.command == "dump" and (args.tp < 1 or (args.tp == 1 and args.rank != 0)):
        parser.error(f"--tp {args.tp} --rank {args.rank}: --tp is a rank count >= 2, --rank one of its ranks")
    if args.command == "dump" and args.out and pathlib.Path(args.out).exists() and not pathlib.Path(args.out).is_dir():
        parser.error(f"--out {args.out}: a file is there, not a directory")
    if args.command == "profile":
        check_run_options(parser, args.repeats, args.json)
    if args.command == "info":
        for flag, count in (("--threads", args.threads), ("--tp", args.tp)):
            if not 0 <= count <= _MAX_COUNT:
                parser.error(f"{flag} {count}: a count from 0 to {_MAX_COUNT}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.fn(args)
    except (ValueError, TypeError, RuntimeError, KeyError, MemoryError, OSError) as e:  # they say what is wrong
        if args.verbose:
            traceback.print_exc()
            return 2
        message = str(e.args[0] if isinstance(e, KeyError) and e.args else e)  # str(KeyError) quotes it
        print(f"amxopt {args.command}: {message.removeprefix('amxopt: ')}\n(-v shows the traceback)", file=sys.stderr)
        return 2
    except Exception:  # a bug (in a factory, say): its traceback, and exit 2 as an error, not 1 (check: outputs off)
        traceback.print_exc()
        return 2


def check_run_options(parser: argparse.ArgumentParser, repeats: int, json: str | None, flag: str = "--repeats") -> None:
    """Refuse, before anything runs, a run count below 1 and a --json file in no directory (the
    profile command and the benches: a run ended in a StatisticsError, or lost its results at the end)."""
    if repeats < 1:
        parser.error(f"{flag} {repeats}: at least 1")
    if json:
        path = pathlib.Path(json)
        target = path.resolve()  # (a symlink's target, which the run writes; made and removed below, not the link)
        if not target.parent.is_dir():
            parser.error(f"--json {json}: its directory does not exist")
        if path.is_dir():
            parser.error(f"--json {json}: is a directory (name a file)")
        if path.exists() and not path.is_file():
            return  # a pipe or a device (/dev/stdout): opening it to try would block or end its reader
        existed = target.exists()
        try:  # opened, not os.access: that says yes to root, whatever the file system says at the write
            with open(target, "a"):  # (appending nothing: an existing file is left as it is)
                pass
            if not existed:
                target.unlink()
        except OSError as e:
            parser.error(f"--json {json}: not writable ({e.strerror or e})")


_MAX_COUNT = 1 << 16  # --threads, --tp: a thread or rank count, past any machine's


def _parse_size(text: str):
    """``448``, ``30.5``, ``1e3`` or ``5,32,32``: positive numbers (ints where they read as ints)."""

    def number(p: str) -> int | float:
        try:
            return int(p)
        except ValueError:
            return float(p)

    try:
        parts = [number(p) for p in text.split(",")]
    except ValueError:
        raise ValueError("sizes are positive numbers, separated by commas") from None
    if any(not 0 < p < math.inf for p in parts):  # (1e400 reads as inf)
        raise ValueError("sizes must be positive and finite")
    return parts[0] if len(parts) == 1 else tuple(parts)


if __name__ == "__main__":
    sys.exit(main())
