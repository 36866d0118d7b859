"""Benchmark every amxopt op against PyTorch eager bf16 and the reference provider, in one run.

For each case the implementations run interleaved (round-robin, every other round in reverse
order, so that drift on a shared machine, and what one call leaves in the caches for the next, hit
all alike), median of --repeats after --warmup calls; the ratio is eager time / op time (> 1:
faster than PyTorch), and "paired" the median of each round's eager / op time (two calls
milliseconds apart). On AMX the amx tier's other GEMM schedule runs too (``native[amx/rows]``),
pinned for the call, and a last table gives its paired ratio against ``native[amx]`` (the default,
groups, as a linear runs that autotune did not give Rows; or the schedule the process pins). GEMM and
attention cases also report TFLOP/s as a fraction of this machine's AMX limit (tools/amx_peak.c)
and of its AVX-512-BF16 limit (tools/avx512_bf16_peak.c), both compiled on the fly and measured in
the same run: before the cases (the fractions use these) and again after
them (printed at the end: on shared cores the limits move with what the neighbours run). Where the
CPU has no AMX, the AMX column divides by the limit quoted for the Xeon the targets were set on
(6.46 TFLOP/s).

    .venv/bin/python tools/bench_ops.py [--repeats 20] [--json out.json] [--only linear] [--cold]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import pathlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import amxopt  # noqa: F401 - registers torch.ops.amxopt
from amxopt.cli import check_run_options
from amxopt.ops import native
from amxopt.ops.providers import available_providers

amx = torch.ops.amxopt
AMX_PEAK_QUOTED = 6.46  # tools/amx_peak.c on the 2-core Xeon the issue's AMX targets were set on
BF16 = torch.bfloat16


@dataclasses.dataclass
class Case:
    op: str
    name: str
    flops: float  # 0 when TFLOP/s is not meaningful (memory-bound ops)
    # "eager" first: the baseline; or a function building them when the case runs (cases whose
    # operands would not all fit in memory at once: linear with --cold)
    impls: dict[str, Callable[[], object]] | Callable[[], dict[str, Callable[[], object]]]


PEAK_PROGRAMS = {  # source in tools/ -> gcc flags
    "avx512_bf16": ("avx512_bf16_peak.c", ["-O3", "-march=x86-64-v4", "-mavx512bf16"]),
    "amx": ("amx_peak.c", ["-O2", "-mamx-tile", "-mamx-bf16"]),
}


def measured_peak(tier: str) -> float | None:
    """TFLOP/s of the register-only loop of ``tier``'s bf16 instruction on every thread, or None where
    this CPU cannot run the tier or the program cannot be built or run."""
    if not native.tier_supported(tier)[0]:
        return None
    name, flags = PEAK_PROGRAMS[tier]
    src = pathlib.Path(__file__).with_name(name)
    with tempfile.TemporaryDirectory() as d:
        exe = pathlib.Path(d) / "peak"
        try:
            subprocess.run(["gcc", *flags, "-fopenmp", str(src), "-o", str(exe)], check=True, capture_output=True)
            out = subprocess.run(
                [str(exe)],
                check=True,
                capture_output=True,
                text=True,
                env={"OMP_NUM_THREADS": str(torch.get_num_threads())},
            )
            return float(out.stdout.strip())
        except (OSError, subprocess.CalledProcessError, ValueError):
            return None


def variants() -> list[str]:
    """What runs against eager: the reference, native at every tier this CPU runs (``native[fp32]``), the
    amx tier's other GEMM schedule (``native[amx/rows]``, GEMM cases only) where AMX runs, and SGLang's
    kernels where the ``sgl_kernel`` provider is usable."""
    labels = ["reference"]
    if available_providers()["native"][0]:
        labels += [f"native[{t}]" for t in native.TIERS if native.tier_supported(t)[0]]
        if native.tier_supported("amx")[0]:
            labels += [f"native[amx/{s}]" for s in native.AMX_SCHEDULES if s != native.amx_schedule()]
    if available_providers()["sgl_kernel"][0]:
        labels.append("sgl_kernel")
    return labels


def provider_of(label: str) -> str:
    return label.split("[")[0]


def without_schedules(labels: list[str]) -> list[str]:
    """The variants of ops that do not run the GEMM engine (the schedule changes nothing there)."""
    return [label for label in labels if "/" not in label]


def at_tier(label: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the native tier capped as ``label`` says (uncapped for the CPU's best tier), and in
    the amx GEMM schedule it names after a slash."""
    tier, _, schedule = label[label.index("[") + 1 : -1].partition("/") if "[" in label else (None, "", "")
    if (tier is None or tier == native.cpu_tier()) and not schedule:
        return fn

    def run():
        with native.max_tier(tier), native.use_amx_schedule(schedule or native.amx_schedule()):
            return fn()

    return run


def l3_bytes() -> int:
    """The last-level cache of this CPU (sysfs), or 64 MB where it cannot be read."""
    try:
        size = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(size[:-1]) * {"K": 1 << 10, "M": 1 << 20}[size[-1]]
    except (OSError, ValueError, KeyError):
        return 64 << 20


def weight_copies(w: torch.Tensor, cold: bool) -> list[torch.Tensor]:
    """``w`` alone, or (cold) as many distinct copies as fill twice the L3: cycled through, each call
    reads its weight from memory, as a layer of a model larger than the caches does."""
    if not cold:
        return [w]
    return [w.clone() for _ in range(max(2, math.ceil(2 * l3_bytes() / (w.numel() * w.element_size()))))]


def linear_cases(providers: list[str], cold: bool = False) -> list[Case]:
    cases = []
    shapes = [(784, 1024, 3072), (784, 1024, 4096), (784, 4096, 1024), (1280, 1536, 8960)]
    shapes += [(m, k, n) for m in (16, 1) for k, n in ((1024, 4096), (1536, 1536))]
    # Where 16-row AMX tiles overtake the AVX-512-BF16 kernel (gemm.cpp's kAmxSmallM, tuned on the
    # packed kernel before it read A in place): on AMX, native[amx] against native[avx512_bf16].
    shapes += [(m, 1536, 1536) for m in (2, 4, 8)]
    # + a residual in the epilogue, against eager's linear and add (Qwen3-VL's fc2, Omni's out-proj)
    with_residual = [(784, 4096, 1024), (390, 1280, 1280)]

    def build(m: int, k: int, n: int, residual: bool) -> dict[str, Callable[[], object]]:
        x, w, b = torch.randn(m, k, dtype=BF16), torch.randn(n, k, dtype=BF16) * 0.03, torch.randn(n, dtype=BF16)
        r = torch.randn(m, n, dtype=BF16) if residual else None
        ws = itertools.cycle(weight_copies(w, cold))
        impls = {"eager": (lambda: F.linear(x, next(ws), b) + r) if residual else lambda: F.linear(x, next(ws), b)}
        for p in providers:
            packed = itertools.cycle([amx.pack_linear_weight(c, provider_of(p)) for c in weight_copies(w, cold)])
            impls[p] = at_tier(
                p, lambda pw=packed, p=provider_of(p): amx.linear(x, next(pw), b, "none", n, p, residual=r)
            )
        return impls

    for (m, k, n), residual in [(s, False) for s in shapes] + [(s, True) for s in with_residual]:
        label = f"M={m} K={k} N={n}" + (" + residual" if residual else "") + (" (cold weights)" if cold else "")
        cases.append(Case("linear", label, 2.0 * m * k * n, functools.partial(build, m, k, n, residual)))
    return cases


def _segments(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def attention_cases(providers: list[str]) -> list[Case]:
    cases = []
    for heads, lengths, d, label in (
        (16, [784], 64, "one SDPA call"),
        (20, [104] * 8, 64, "per-segment SDPA loop"),
        (12, [1280], 128, "one SDPA call"),
    ):
        t = sum(lengths)
        q, k, v = (torch.randn(t, heads, d, dtype=BF16) for _ in range(3))
        cu = _segments(lengths)
        scale = d**-0.5

        def eager(q=q, k=k, v=v, cu=cu, scale=scale):
            bounds = cu.tolist()
            outs = [
                F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v)), scale=scale)
                for a, b in zip(bounds, bounds[1:])
            ]
            return torch.cat([o[0].transpose(0, 1) for o in outs])

        impls = {"eager": eager}
        for p in providers:
            impls[p] = at_tier(
                p,
                lambda q=q, k=k, v=v, cu=cu, m=max(lengths), s=scale, p=provider_of(p): amx.varlen_attention(
                    q, k, v, cu, cu, m, m, s, False, p
                ),
            )
        flops = sum(4.0 * heads * n * n * d for n in lengths)
        cases.append(
            Case("varlen_attention", f"{len(lengths)}x{lengths[0]} tok, {heads}h x {d} (vs {label})", flops, impls)
        )
    cases.append(_vision_attention_with_rotary(providers))
    return cases


def _vision_attention_with_rotary(providers: list[str]) -> Case:
    """Qwen3-VL's vision attention as a block runs it: q, k, v slices of one qkv output, q and k
    rotated (rotate_half, D-wide cos / sin), one segment. Eager: transformers' rotary + SDPA; amxopt:
    the rotary inside the attention (fuse_rotary)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    t, heads, d = 784, 16, 64
    qkv = torch.randn(t, 3, heads, d, dtype=BF16)
    q, k, v = qkv.unbind(1)
    angles = torch.randn(t, d // 2)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    cu = _segments([t])

    def eager():
        qr, kr = apply_rotary_pos_emb_vision(q, k, cos, sin)
        return F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (qr, kr, v)))

    impls = {"eager": eager}
    for p in providers:
        impls[p] = at_tier(
            p,
            lambda p=provider_of(p): amx.varlen_attention(
                q, k, v, cu, cu, t, t, d**-0.5, False, p, rotary_cos=cos, rotary_sin=sin
            ),
        )
    return Case(
        "varlen_attention", f"1x{t} tok, {heads}h x {d} + rotary (vs rotary + SDPA)", 4.0 * heads * t * t * d, impls
    )


def patch_embed_cases(providers: list[str]) -> list[Case]:
    cases = []
    for shape, kernel, out_ch, label in (
        ((784, 3, 2, 16, 16), (2, 16, 16), 1024, "Qwen3-VL 784 patches 3x2x16x16 -> 1024"),
        ((1, 16, 5, 64, 64), (1, 2, 2), 1536, "Wan latent 16x5x64x64, patch 1x2x2 -> 1536"),
    ):
        x = torch.randn(*shape, dtype=BF16)
        conv = torch.nn.Conv3d(shape[1], out_ch, kernel, stride=kernel).to(BF16).eval()
        impls = {"eager": lambda x=x, conv=conv: conv(x)}
        w = conv.weight.detach().reshape(out_ch, -1)
        for p in providers:
            packed = amx.pack_linear_weight(w, provider_of(p))
            impls[p] = at_tier(
                p,
                lambda x=x, pw=packed, b=conv.bias.detach(), kr=list(kernel), o=out_ch, p=provider_of(p): (
                    amx.patch_embed(x, pw, b, kr, o, p)
                ),
            )
        patches = x.numel() // w.shape[1]
        cases.append(Case("patch_embed", label, 2.0 * patches * w.shape[1] * out_ch, impls))
    return cases


def conv2d_cases(providers: list[str]) -> list[Case]:
    """The Qwen3-Omni audio encoder's three 3x3 stride-2 convs with their gelu, on 30 chunks of 100
    mel frames: the first on the 1-channel spectrogram, the next two 480 -> 480 channels on the
    channels-last output of the one before (as in the optimized model)."""
    cases = []
    for shape, label in (
        ((30, 1, 128, 100), "Omni conv1 30x1x128x100 -> 480, 3x3 s2 + gelu"),
        ((30, 480, 64, 50), "Omni conv2 30x480x64x50 -> 480, 3x3 s2 + gelu"),
        ((30, 480, 32, 25), "Omni conv3 30x480x32x25 -> 480, 3x3 s2 + gelu"),
    ):
        x = torch.randn(*shape, dtype=BF16)
        if shape[1] > 1:
            x = x.contiguous(memory_format=torch.channels_last)
        conv = torch.nn.Conv2d(shape[1], 480, 3, stride=2, padding=1).to(BF16).eval()
        w, b = conv.weight.detach(), conv.bias.detach()
        impls = {"eager": lambda x=x, conv=conv: F.gelu(conv(x))}
        for p in providers:
            impls[p] = at_tier(
                p, lambda x=x, w=w, b=b, p=provider_of(p): amx.conv2d(x, w, b, [2, 2], [1, 1], [1, 1], 1, "gelu", p)
            )
        outputs = shape[0] * 480 * ((shape[2] + 1) // 2) * ((shape[3] + 1) // 2)
        cases.append(Case("conv2d", label, 2.0 * outputs * shape[1] * 9, impls))
    return cases


def norm_cases(providers: list[str]) -> list[Case]:
    cases = []
    for rows, d in ((784, 1024), (1280, 1536)):
        x, w, b = torch.randn(rows, d, dtype=BF16), torch.randn(d, dtype=BF16), torch.randn(d, dtype=BF16)
        impls = {"eager": lambda x=x, w=w, b=b, d=d: F.layer_norm(x, (d,), w, b, 1e-6)}
        for p in providers:
            impls[p] = at_tier(p, lambda x=x, w=w, b=b, p=provider_of(p): amx.layer_norm(x, w, b, 1e-6, p))
        cases.append(Case("layer_norm", f"{rows} x {d}", 0.0, impls))
        impls = {"eager": lambda x=x, w=w, d=d: F.rms_norm(x, (d,), w, 1e-6)}
        for p in providers:
            impls[p] = at_tier(p, lambda x=x, w=w, p=provider_of(p): amx.rms_norm(x, w, 1e-6, p))
        cases.append(Case("rms_norm", f"{rows} x {d}", 0.0, impls))
    return cases


def measure(case: Case, warmup: int, repeats: int) -> dict[str, list[float]]:
    impls = case.impls() if callable(case.impls) else case.impls
    times: dict[str, list[float]] = {name: [] for name in impls}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in impls.values():
                fn()
        for round_ in range(repeats):
            # every other round in reverse order: what one call leaves in the caches (or the allocator)
            # for the next falls on each side of a pair alike (two runs of the same kernel in a row
            # read 1.05x and 1.52x apart in a fixed order on a Zen 4)
            order = list(impls.items())
            for name, fn in order if round_ % 2 == 0 else reversed(order):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default=None, help="run only this op (linear, varlen_attention, ...)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="linear: every implementation cycles through its own copies of the weight (twice the L3 in all), "
        "so that each call reads its weight from memory as in a real model",
    )
    args = parser.parse_args()
    check_run_options(parser, args.repeats, args.json)
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup}: at least 0")
    native.refuse_software_tiles("bench_ops")

    providers = variants()
    peak = measured_peak("avx512_bf16")
    amx_measured = measured_peak("amx")
    amx_label = f"measured now: {amx_measured}" if amx_measured else f"quoted (no AMX here): {AMX_PEAK_QUOTED}"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; cpu {native.cpu_model()}; "
        f"best tier {native.cpu_tier()}, AMX GEMM schedule {native.amx_schedule()}{' (pinned)' if native.amx_schedule_pinned() else ''}; variants {providers}; "
        f"AVX-512-BF16 limit measured now: {peak if peak else 'n/a'} TFLOP/s; AMX limit {amx_label} TFLOP/s"
    )
    amx_limit = amx_measured or AMX_PEAK_QUOTED
    cases = (
        linear_cases(providers, args.cold)
        + attention_cases(without_schedules(providers))
        + patch_embed_cases(providers)
        + conv2d_cases(providers)
        + norm_cases(without_schedules(providers))
    )
    ops = sorted({c.op for c in cases})
    if args.only is not None and args.only not in ops:
        parser.error(f"--only {args.only!r} names no op of the bench; it has {', '.join(ops)}")
    cases = [c for c in cases if args.only in (None, c.op)]
    results, schedules = [], []
    header = (
        "| op | case | impl | median ms | ratio vs eager | paired | TFLOP/s | of AVX-512-BF16 limit | "
        f"of AMX {amx_limit} |"
    )
    print("\n" + header + "\n|" + "---|" * 9)
    for case in cases:
        times = measure(case, args.warmup, args.repeats)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        # the median of each round's eager / impl: calls milliseconds apart, so a slow or fast phase of
        # the machine (seconds) falls on both sides of a ratio
        paired = {
            name: statistics.median(e / t for e, t in zip(times["eager"], ts, strict=True))
            for name, ts in times.items()
        }
        for name, secs in med.items():
            tflops = case.flops / secs / 1e12 if case.flops else None
            row = dict(
                op=case.op,
                case=case.name,
                impl=name,
                median_ms=secs * 1e3,
                ratio=med["eager"] / secs,
                paired_ratio=paired[name],
                tflops=tflops,
                frac_avx512=tflops / peak if tflops and peak else None,
                frac_amx=tflops / amx_limit if tflops else None,
            )
            if "/" in name:  # the other GEMM schedule against the process's, call by call in each round
                base = times[name.split("/")[0] + "]"]
                row["paired_vs_default_schedule"] = statistics.median(
                    b / t for b, t in zip(base, times[name], strict=True)
                )
                schedules.append(f"| {case.op} | {case.name} | {name} | {row['paired_vs_default_schedule']:.2f}x |")
            results.append(row)
            fmt = lambda v, f: f"{v:{f}}" if v is not None else "-"  # noqa: E731
            print(
                f"| {case.op} | {case.name} | {name} | {secs * 1e3:.3f} | {row['ratio']:.2f}x | {paired[name]:.2f}x | "
                f"{fmt(tflops, '.3f')} | {fmt(row['frac_avx512'], '.0%')} | {fmt(row['frac_amx'], '.1%')} |",
                flush=True,
            )
    if schedules:
        print("\n| op | case | schedule | paired vs native[amx], this process's (> 1: faster) |\n|---|---|---|---|")
        print("\n".join(schedules))
    after = dict(avx512_bf16=measured_peak("avx512_bf16"), amx=measured_peak("amx"))
    print(f"\nlimits measured again after the cases: AVX-512-BF16 {after['avx512_bf16']}, AMX {after['amx']} TFLOP/s")
    if args.json:
        meta = dict(
            cpu=native.cpu_model(),
            tier=native.cpu_tier(),
            amx_schedule=native.amx_schedule(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
            avx512_bf16_peak_tflops=peak,
            amx_peak_tflops=amx_measured,  # None without AMX: frac_amx is then of the quoted limit
            amx_peak_quoted_tflops=AMX_PEAK_QUOTED,
            peaks_after_tflops=after,
            repeats=args.repeats,
            warmup=args.warmup,
        )
        pathlib.Path(args.json).write_text(json.dumps(dict(meta=meta, results=results), indent=1))


if __name__ == "__main__":
    main()
