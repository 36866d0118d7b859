"""Load-time benchmark: memory and time from a checkpoint on disk to a model ready to run.

For each model (real configs, random weights, saved once in bf16 with ``save_pretrained``), every
route runs in a fresh process, so that each peak RSS (``VmHWM``) is its own:

* ``hf``: transformers/diffusers ``from_pretrained`` (what eager runs on);
* ``hf+compile``: the same, then ``torch.compile`` with freezing and its first call (``--compile``);
* ``hf+optimize``: ``from_pretrained``, then ``amxopt.optimize(model, example_inputs)`` (capture,
  rewrite, packing, source released) with an empty graph cache: setup time and RSS after;
* ``hf+optimize warm``: the same, with the graph the previous route left in the graph cache
  (restored, not captured: what every optimize() after the first costs);
* ``amxopt.from_pretrained``: packing while streaming the checkpoint;
* ``amxopt.load``: the artifact ``opt.save`` wrote after the previous route's first call
  (memory-mapped, no packing, graph restored), and its first call.

Each process also reports the RSS of the bare imports, so the weights' share can be read apart.
Autotune is off (its timing runs would blur the setup time; decisions are cached on disk anyway).

    .venv/bin/python tools/bench_load.py [--models qwen3-vl-2b-vision,wan2.1-t2v-1.3b] [--compile] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROUTES = ("hf", "hf+optimize", "hf+optimize warm", "amxopt.from_pretrained", "amxopt.load")
_MB = 2**20


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mb() -> float:
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across exec, so a child would report
    # the parent's peak (the parent builds and saves each checkpoint) whenever it is the larger.
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _child(route: str, name: str, path: pathlib.Path) -> dict:
    import torch

    import amxopt
    from amxopt import models

    base = _rss_mb()
    cls = _class_of(name)
    config = amxopt.AmxConfig(autotune=False, autotune_cache=str(path / "cache"))
    if route == "hf+optimize":
        shutil.rmtree(path / "cache", ignore_errors=True)
    inputs = models.example_inputs(name, torch.bfloat16)
    t = time.perf_counter()
    out: dict = {}
    if route in ("hf", "hf+optimize", "hf+optimize warm", "hf+compile"):
        model = cls.from_pretrained(path / "hf", torch_dtype=torch.bfloat16).eval()
        out["load_s"] = time.perf_counter() - t
        if route.startswith("hf+optimize"):
            t = time.perf_counter()
            opt = amxopt.optimize(model, inputs, config)
            out["optimize_s"] = time.perf_counter() - t
            out["packed_mb"] = _packed_mb(opt.graph_module)
            del model
        elif route == "hf+compile":
            from bench_models import compile_baseline  # (tools/ is this script's directory)

            compiled = compile_baseline(model)
            t = time.perf_counter()
            with torch.no_grad():
                compiled(**inputs)
            out["first_call_s"] = time.perf_counter() - t
    elif route == "amxopt.from_pretrained":
        opt = amxopt.from_pretrained(cls, path / "hf", torch.bfloat16, config)
        out["load_s"] = time.perf_counter() - t
        out["packed_mb"] = _source_packed_mb(opt)
        out.update(rss_mb=_rss_mb(), peak_rss_mb=_peak_mb())
        if not (path / "artifact").exists():  # for the amxopt.load route, after this route's numbers
            with torch.no_grad():
                opt(**inputs)  # captured (or restored from the graph cache) at its first call, then saved
            t = time.perf_counter()
            opt.save(path / "artifact")
            out["save_s"] = time.perf_counter() - t
    elif route == "amxopt.load":
        opt = amxopt.load(path / "artifact", config)
        out["load_s"] = time.perf_counter() - t
        out["packed_mb"] = _source_packed_mb(opt)
        out.update(rss_mb=_rss_mb(), peak_rss_mb=_peak_mb())
        t = time.perf_counter()
        with torch.no_grad():
            opt(**inputs)
        out["first_call_s"] = time.perf_counter() - t
        # The first call reads every packed page of the mapping: the peak a running model holds.
        out["peak_after_call_mb"] = _peak_mb()
        # Not "restored from" alone: a graph captured in amxopt's forked child is restored from it too.
        saved = ("graph restored from the artifact", "graph restored from the graph cache")
        out["captured"] = not any(n.startswith(saved) for n in opt.report.notes)
    out.setdefault("rss_mb", _rss_mb())
    out.setdefault("peak_rss_mb", _peak_mb())
    out.update(route=route, model=name, imports_rss_mb=base)
    return out


def _class_of(name: str):
    from amxopt import models

    return models._model_class(models.ZOO[name].family)


def _packed_mb(gm) -> float:
    return sum(b.numel() * b.element_size() for b in gm.get_submodule("_packed").buffers()) / _MB


def _source_packed_mb(opt) -> float:
    from amxopt.ops import packed

    seen, total = set(), 0
    for p in opt.__dict__["_source"].parameters():
        for t in packed.packings(p).values():
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total / _MB


def _median_row(rows: list[dict]) -> dict:
    """One route's runs: the median of each number, the first run's other fields."""
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in rows if k in r)
    return out


def _run(route: str, name: str, path: pathlib.Path) -> dict:
    cmd = [sys.executable, __file__, "--child", route, "--models", name, "--dir", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{route} on {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-vl-2b-vision,wan2.1-t2v-1.3b")
    parser.add_argument("--compile", action="store_true", help="also time from_pretrained + torch.compile")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every route (interleaved); medians reported")
    parser.add_argument(
        "--dir", default=None, help="working directory for checkpoints, kept (default: a temp dir, removed at the end)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.models, pathlib.Path(args.dir))))
        return

    import torch

    from amxopt import models
    from amxopt.cli import check_run_options
    from amxopt.ops import native

    check_run_options(parser, args.repeats, args.json)
    if unknown := [n for n in args.models.split(",") if n not in models.ZOO]:
        parser.error(f"--models: unknown {unknown}; known: {list(models.ZOO)}")
    native.refuse_software_tiles("bench_load")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu {native.cpu_model()}, tier {native.active_tier()}"
    )
    results = []
    routes = list(ROUTES) + (["hf+compile"] if args.compile else [])
    # without --dir, the checkpoints (GBs at the real sizes) go when the run ends
    scratch = None if args.dir else tempfile.TemporaryDirectory(prefix="amxopt-bench-load-")
    for name in args.models.split(","):
        root = pathlib.Path(args.dir or scratch.name) / name
        if not (root / "hf").exists():
            models.build_model(name, torch.bfloat16).save_pretrained(root / "hf")
        shutil.rmtree(root / "artifact", ignore_errors=True)  # an earlier run's (other amxopt code): saved anew
        runs = [[_run(route, name, root) for route in routes] for _ in range(args.repeats)]
        rows = [_median_row([run[i] for run in runs]) for i in range(len(routes))]
        packed_mb = next(r["packed_mb"] for r in rows if "packed_mb" in r)
        print(f"\n## {name}: packed weights {packed_mb:.0f} MB (medians of {args.repeats} runs per route)")
        print(
            "| route | load s | setup s | first call s | peak RSS MB | RSS after MB | imports RSS MB | peak / (packed + 300) "
            "| peak after first call MB |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            first = f"{r['first_call_s']:.2f}" if "first_call_s" in r else "-"
            after_call = f"{r['peak_after_call_mb']:.0f}" if "peak_after_call_mb" in r else "-"
            print(
                f"| {r['route']} | {r.get('load_s', 0):.2f} | {r.get('optimize_s', 0):.2f} | {first} | "
                f"{r['peak_rss_mb']:.0f} | {r['rss_mb']:.0f} | {r['imports_rss_mb']:.0f} | "
                f"{r['peak_rss_mb'] / (packed_mb + 300):.2f} | {after_call} |"
            )
        by = {r["route"]: r for r in rows}
        print(
            f"amxopt.load vs amxopt.from_pretrained: {by['amxopt.from_pretrained']['load_s'] / by['amxopt.load']['load_s']:.1f}x "
            f"as fast (load's first call {'captured' if by['amxopt.load']['captured'] else 'ran the saved graph'}); "
            f"optimize() setup {by['hf+optimize']['optimize_s']:.1f} s cold, "
            f"{by['hf+optimize warm']['optimize_s']:.1f} s with the graph cache",
            flush=True,
        )
        if args.repeats > 1:
            cold = ", ".join(f"{run[routes.index('hf+optimize')]['optimize_s']:.2f}" for run in runs)
            print(f"cold optimize() setup per run: {cold} s")
        results += rows
    if scratch is not None:
        scratch.cleanup()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
