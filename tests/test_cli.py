"""The CLI: pass list, info, and dump writing graphs (text, SVG, diff, index.html) for every pass."""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import runpy
import sys
import threading
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amxopt import cli
from amxopt.passes import DEFAULT_PASSES
from amxopt.runtime import dump


def test_passes_lists_default_order(capsys):
    assert cli.main(["passes"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0].split(". ")[1] for line in lines] == [p.__name__ for p in DEFAULT_PASSES]
    # each summary is the docstring's whole first paragraph, not its first line (replace_glue's wraps)
    assert lines[[p.__name__ for p in DEFAULT_PASSES].index("replace_glue")].endswith("``amxopt.rotary_embedding``.")


def test_info_names_cpu_features_and_providers(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "amx_tile=" in out and "avx512_bf16=" in out and "provider reference" in out


def test_info_shows_work_items_for_a_thread_count(capsys):
    assert cli.main(["info", "--threads", "56"]) == 0
    out = capsys.readouterr().out
    assert "work items at 56 threads" in out
    # Qwen3-VL's fc2 at 56 threads: smaller items than the tuned ones, which would keep 64-89% busy
    fc2 = next(line for line in out.splitlines() if "linear 784x4096->1024" in line)
    assert int(fc2.rsplit("(", 1)[1].rstrip("%)")) >= 85, fc2
    assert "attention 12 heads x 1280 (bf16)" in out


def test_dump_writes_graphs_and_report(tmp_path, capsys):
    assert cli.main(["dump", "tiny-wan", "--out", str(tmp_path), "--dtype", "fp32", "--no-autotune"]) == 0
    for i, p in enumerate(DEFAULT_PASSES, 1):
        before = (tmp_path / f"{i:02d}_{p.__name__}.before.txt").read_text()
        after = (tmp_path / f"{i:02d}_{p.__name__}.after.txt").read_text()
        assert "def forward" in before and "def forward" in after
    attention = f"{[p.__name__ for p in DEFAULT_PASSES].index('replace_attention') + 1:02d}_replace_attention"
    first = (tmp_path / "01_remove_dropout.before.txt").read_text()
    last = (tmp_path / f"{len(DEFAULT_PASSES):02d}_pack_weights.after.txt").read_text()
    assert "aten.scaled_dot_product_attention" in first and "amxopt.varlen_attention" in last
    assert "aten.linear" not in last and "pack_linear_weight" not in last
    report = (tmp_path / "report.txt").read_text()
    assert "rewrite report: WanTransformer3DModel" in report
    assert "rewrite report" in capsys.readouterr().out
    # Pictures: one layer of Wan (blocks.0 and what feeds it), nodes coloured by kind.
    captured = _svg_kinds(tmp_path / "00_captured.svg")
    final = _svg_kinds(tmp_path / f"{len(DEFAULT_PASSES):02d}_pack_weights.svg")
    assert "replaced" not in captured and captured["aten"] > 10
    assert final["replaced"] >= 4  # attention x2, rms_norm x2 ... in one block
    assert "blocks.0" in (tmp_path / "00_captured.svg").read_text()
    diff = (tmp_path / f"{attention}.diff.txt").read_text()
    assert "(scaled_dot_product_attention)" in diff.split("added")[0]  # removed
    assert "(amxopt.varlen_attention)" in diff.split("added")[1]
    index = (tmp_path / "index.html").read_text()
    for i, p in enumerate(DEFAULT_PASSES, 1):
        assert f'href="{i:02d}_{p.__name__}.svg"' in index and f'href="{i:02d}_{p.__name__}.diff.txt"' in index


def _svg_kinds(path) -> dict[str, int]:
    root = ET.parse(path).getroot()  # well-formed XML, or this raises
    kinds: dict[str, int] = {}
    for g in root.iter("{http://www.w3.org/2000/svg}g"):
        kinds[g.get("class")] = kinds.get(g.get("class"), 0) + 1
    return kinds


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(self.norm(x)))


def build_tiny():
    """A user's model for ``amxopt dump tests.test_cli:build_tiny``."""
    return _Tiny().eval(), (torch.randn(4, 16),)


def build_tiny_from_a_processor():
    """A factory whose inputs are a processor's output (a ``BatchFeature``, which pytree takes as one leaf)."""
    from transformers import BatchFeature

    return _Tiny().eval(), BatchFeature({"x": torch.randn(4, 16)})


class _ConvThenView(nn.Module):
    """A 1x1 conv read by a view: patch_embed writes channels-last, so the pass makes the view a reshape."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 1)

    def forward(self, x):
        return self.conv(x).view(x.shape[0], -1)


def build_conv_then_view():
    return _ConvThenView().eval(), (torch.randn(2, 4, 3, 3),)


def test_the_dump_lists_nodes_a_pass_changed_in_place(tmp_path):
    args = ["dump", "tests.test_cli:build_conv_then_view", "--out", str(tmp_path), "--dtype", "fp32", "--no-autotune"]
    assert cli.main(args) == 0
    index = [p.__name__ for p in DEFAULT_PASSES].index("replace_patch_embed") + 1
    diff = (tmp_path / f"{index:02d}_replace_patch_embed.diff.txt").read_text()
    changed = diff.split("changed ")[1].split("\n")
    assert changed[0] == "1 nodes:" and "(view -> reshape)" in changed[1], diff
    assert "~1</td>" in (tmp_path / "index.html").read_text()


def build_nothing():
    return "a model"


def test_dump_of_any_model_from_a_factory(tmp_path, capsys):
    assert (
        cli.main(["dump", "tests.test_cli:build_tiny", "--out", str(tmp_path), "--dtype", "fp32", "--no-autotune"]) == 0
    )
    final = _svg_kinds(tmp_path / f"{len(DEFAULT_PASSES):02d}_pack_weights.svg")
    assert final["replaced"] == 2  # layer_norm, linear with gelu fused
    assert "whole graph" in (tmp_path / "00_captured.svg").read_text()
    assert "rewrite report: _Tiny" in capsys.readouterr().out
    # A second dump captures again: a graph from the graph cache has no text of its passes.
    again = tmp_path / "again"
    assert cli.main(["dump", "tests.test_cli:build_tiny", "--out", str(again), "--dtype", "fp32", "--no-autotune"]) == 0
    assert all("def forward" in p.read_text() for p in again.glob("*.before.txt"))
    assert len(list(again.glob("*.before.txt"))) == len(DEFAULT_PASSES)


@pytest.mark.parametrize(
    "spec, error", [("tests.test_cli:nothing", "cannot load"), ("tests.test_cli:build_nothing", "must return")]
)
def test_dump_of_a_bad_factory_says_what_is_wrong(spec, error, capsys):
    assert cli.main(["dump", spec, "--dtype", "fp32"]) == 2
    assert error in capsys.readouterr().err
    # -v, before or after the command: the traceback, and still exit 2 (1 is a check that failed)
    for verbose in (["-v", "dump", spec], ["dump", spec, "-v"]):
        assert cli.main([*verbose, "--dtype", "fp32"]) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "ValueError: amxopt: " in err and error in err


@pytest.mark.parametrize(
    "args, error",
    [
        (["--size", "abc"], "sizes are positive numbers"),
        (["--size", "-64"], "sizes must be positive"),
        (["--size", "1.e400"], "sizes must be positive and finite"),
        (["--tp", "2", "--rank", "5"], "--rank 5 is not a rank of --tp 2"),
        (["--tp", "0"], "--tp is a rank count >= 2"),
        (["--rank", "1"], "--tp is a rank count >= 2"),
        (["--out", __file__], "a file is there, not a directory"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(args, error, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["dump", "tiny-qwen3-vl-vision", *args])
    assert exit_.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("448", 448), ("30.5", 30.5), ("1e3", 1000.0), ("5,32,32", (5, 32, 32))])
def test_sizes_read_as_python_reads_numbers(text, size):
    # 1e3 was refused as "not a positive number" (only text with a dot was read as a float)
    assert cli._parse_size(text) == size and type(cli._parse_size(text)) is type(size)


def test_a_json_symlink_to_a_file_not_there_yet_is_left_as_it_was(tmp_path):
    # The check makes and removes the file it tries: the link's target, not the link.
    link = tmp_path / "latest.json"
    link.symlink_to(tmp_path / "run1.json")
    cli.check_run_options(argparse.ArgumentParser(), 1, str(link))
    assert link.is_symlink() and not (tmp_path / "run1.json").exists()


def test_a_json_pipe_is_not_opened_to_try_it(tmp_path):
    # The writability check opened --json: on a FIFO with no reader it blocked, and one with a reader
    # was sent EOF (the run's write then blocked); /dev/stdout into a pipe was refused.
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    check = threading.Thread(target=cli.check_run_options, args=(argparse.ArgumentParser(), 1, str(fifo)), daemon=True)
    check.start()
    check.join(5)
    blocked = check.is_alive()
    if blocked:  # let it go
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert not blocked


@pytest.mark.parametrize("args", [["--threads", "-1"], ["--threads", "99999999999999999999"], ["--tp", "70000"]])
def test_info_refuses_counts_out_of_range(args, capsys):
    # 2**64 and more reached the C++ work-split as a pybind11 cast error naming no flag.
    with pytest.raises(SystemExit) as exit_:
        cli.main(["info", *args])
    err = capsys.readouterr().err  # naming only the flag that is out of range
    assert exit_.value.code == 2 and f"{args[0]} {int(args[1])}: a count from 0 to 65536" in err
    assert ("--tp" in err) == (args[0] == "--tp")


def test_info_prints_the_cores_of_tp_ranks(capsys):
    assert cli.main(["info", "--tp", "2"]) == 0
    assert "provider reference" in capsys.readouterr().out


def build_tiny_in_training_mode():
    model, inputs = build_tiny()
    return model.train(), inputs


def test_dump_refuses_a_model_in_training_mode_as_optimize_does(tmp_path, capsys):
    # It dumped a graph that kept the dropout, and replaced its Linears.
    args = ["dump", "tests.test_cli:build_tiny_in_training_mode", "--out", str(tmp_path), "--dtype", "fp32"]
    assert cli.main(args) == 2
    assert "is in training mode; amxopt optimizes inference, call .eval()" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_factorys_model_is_cast_to_the_dtype_asked_for(tmp_path):
    args = ["dump", "tests.test_cli:build_tiny", "--out", str(tmp_path), "--no-autotune"]
    assert cli.main([*args, "--dtype", "bf16"]) == 0
    assert 'x: "bf16[s77, 16]"' in (tmp_path / "01_remove_dropout.before.txt").read_text()


def test_a_factorys_processor_output_is_cast_to_the_dtype_asked_for():
    model, inputs = dump.load_target("tests.test_cli:build_tiny_from_a_processor", torch.bfloat16)
    assert model.fc.weight.dtype == torch.bfloat16 and inputs["x"].dtype == torch.bfloat16


@pytest.mark.parametrize(
    "args, error",
    [
        (["dump", "no-such-model"], "amxopt dump: unknown model 'no-such-model'; valid names"),
        (["dump", "tests.test_cli:build_tiny", "--size", "32"], "amxopt dump: --size applies to zoo models"),
    ],
)
def test_a_bad_model_is_named_in_one_line(args, error, capsys):
    assert cli.main(args) == 2
    assert capsys.readouterr().err.startswith(error)


def test_dump_draws_every_edge_downward():
    # An input feeding another input (a value computed outside the drawn layer) goes above it.
    import networkx as nx

    from amxopt.runtime import dump

    g = nx.DiGraph()
    g.add_nodes_from(["a", "b"], kind="input")
    g.add_nodes_from(["c", "d"], kind="aten")
    g.add_edges_from([("a", "b"), ("b", "c"), ("a", "d"), ("c", "d")])
    row = {n: i for i, names in enumerate(dump._rows(g)) for n in names}
    assert all(row[u] < row[v] for u, v in g.edges), row


def build_wrong():
    """A factory whose model's optimized form differs from it: check must fail."""
    return _Wrong().eval(), (torch.randn(3, 8),)


class _Wrong(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * 1e4 if torch.compiler.is_compiling() else self.fc(x)


def build_broken():
    """A factory with a bug: check exits 2 (an error), not 1 (an output off)."""
    return nn.Linear(4, 4).eval().missing_attribute, (torch.randn(3, 4),)


def test_check_of_a_factory_that_raises_is_an_error_not_a_failed_check(capsys):
    assert cli.main(["check", "tests.test_cli:build_broken"]) == 2
    assert "missing_attribute" in capsys.readouterr().err


def build_whole_model():
    from amxopt import pipelines

    return pipelines.build_qwen3_vl("tiny"), {}


def test_a_whole_model_factory_is_told_to_return_a_tower(capsys):
    # It said "call optimize() without example inputs", which a CLI user cannot do.
    assert cli.main(["check", "tests.test_cli:build_whole_model"]) == 2
    assert "Qwen3VLForConditionalGeneration, a whole model" in capsys.readouterr().err


def test_check_fails_when_the_optimized_model_differs(capsys):
    assert cli.main(["check", "tests.test_cli:build_wrong", "--provider", "reference"]) == 1
    assert "FAILS" in capsys.readouterr().out


class _Masked(nn.Module):
    """Logits with a masked column (-inf), and a captured form off by ``offset`` where it is bf16."""

    def __init__(self, offset_fp32: float = 0.0, offset_bf16: float = 0.0, extra: tuple = ()):
        super().__init__()
        self.fc, self.extra = nn.Linear(8, 8), extra
        self.offsets = {torch.float32: offset_fp32, torch.bfloat16: offset_bf16}

    def forward(self, x):
        y = self.fc(x)
        if torch.compiler.is_compiling():
            y = y + self.offsets[y.dtype]
        return (torch.cat([y, torch.full_like(y[:, :1], -torch.inf)], dim=1), *self.extra)


def build_masked_wrong():
    return _Masked(offset_fp32=1.0, offset_bf16=1.0).eval(), (torch.randn(3, 8),)


def build_wrong_in_bf16():
    return _Masked(offset_bf16=0.25).eval(), (torch.randn(3, 8),)


def build_with_plain_outputs():
    return _Masked(extra=(None, 3)).eval(), (torch.randn(3, 8),)


class _SmallWrong(nn.Module):
    """Outputs of magnitude 1e-4, the captured form 30% off."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x) * 1e-4
        return y * 1.3 if torch.compiler.is_compiling() else y


def build_small_wrong():
    return _SmallWrong().eval(), (torch.randn(3, 8),)


class _TwoOutputs(nn.Module):
    """A large output off by 1e-4 (far within its bound) and a small one off by 1e-5 (near its bound)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        large, small = y * 100, y
        if torch.compiler.is_compiling():
            large, small = large + 1e-4, small + 1e-5
        return large, small


def build_two_outputs():
    return _TwoOutputs().eval(), (torch.randn(3, 8),)


def test_check_prints_the_largest_error_and_the_output_nearest_its_bound(capsys):
    # "max abs error" was the error of the output nearest its bound: 1e-5 here, where one was 1e-4
    assert cli.main(["check", "tests.test_cli:build_two_outputs", "--provider", "reference"]) == 0
    fp32 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("fp32"))
    found = re.search(r"max abs error vs the original (\S+) over 2 outputs; nearest its bound: output 1, (\S+) ", fp32)
    assert found, fp32
    assert float(found[1]) == pytest.approx(1e-4, rel=0.1) and float(found[2]) == pytest.approx(1e-5, rel=0.1)


class _SwappedTokens(nn.Module):
    """An attention whose captured form swaps two tokens' outputs."""

    def forward(self, q):
        out = F.scaled_dot_product_attention(q, q, q + 1)  # near-uniform weights over values near 1
        return out[:, :, [1, 0, *range(2, out.shape[2])]] if torch.compiler.is_compiling() else out


def build_swapped_tokens():
    torch.manual_seed(0)
    return _SwappedTokens().eval(), (torch.randn(1, 2, 16, 8) * 0.1,)


@pytest.mark.parametrize(
    "factory, fails",
    [
        ("build_masked_wrong", ["fp32", "bf16"]),  # an infinity in the output made the tolerance infinite
        ("build_wrong_in_bf16", ["bf16"]),  # within 10% of the largest magnitude, the old bf16 bound
        ("build_with_plain_outputs", []),  # None and a number beside the tensor: compared, not a crash
        ("build_small_wrong", ["fp32", "bf16"]),  # fp32 allowed 1e-3 absolute below magnitude 1: 30% passed
        ("build_swapped_tokens", ["fp32"]),  # near-uniform attention: 1e-3 of the magnitude passed it
    ],
)
def test_check_judges_each_output_as_the_tests_do(factory, fails, capsys):
    assert cli.main(["check", f"tests.test_cli:{factory}", "--provider", "reference"]) == (1 if fails else 0)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if "FAILS" in line] == fails, lines


def test_dump_of_a_tp_shard_shows_the_collectives(tmp_path, capsys):
    args = ["dump", "tiny-qwen3-vl-vision", "--out", str(tmp_path), "--dtype", "fp32", "--no-autotune"]
    assert cli.main([*args, "--tp", "3", "--rank", "2"]) == 0
    index = [p.__name__ for p in DEFAULT_PASSES].index("shard_tensor_parallel") + 1
    after = (tmp_path / f"{index:02d}_shard_tensor_parallel.after.txt").read_text()
    assert after.count("_c10d_functional.all_reduce") == 6  # 3 blocks x (attention, MLP)
    assert "tensor parallel (tp 3, rank 2): 6 attention/MLP units sharded" in capsys.readouterr().out


@pytest.mark.parametrize(
    "tool, args, error",
    [
        ("bench_ops", ["--repeats", "0"], "--repeats 0: at least 1"),
        ("bench_ops", ["--json", "/no/such/dir/x.json"], "its directory does not exist"),
        ("bench_ops", ["--json", "/tmp"], "--json /tmp: is a directory"),  # (a run's results lost at its end)
        # (os.access said yes to root, and the results were lost at the end)
        ("bench_ops", ["--json", "/proc/version"], "--json /proc/version: not writable"),
        ("bench_ops", ["--warmup", "-4"], "--warmup -4: at least 0"),  # (no warm-up, silently)
        ("bench_models", ["--models", "qwen3-vl-2b-generate", "--without", "replace_norms"], "--without: model rows"),
        ("bench_models", ["--repeats", "0"], "--repeats 0: at least 1"),
        ("bench_tp", ["--repeat", "0"], "--repeat 0: at least 1"),
        ("bench_load", ["--models", "nosuch"], "--models: unknown ['nosuch']"),
    ],
)
def test_the_benches_refuse_bad_options_before_they_run(tool, args, error, monkeypatch, capsys):
    # They ended in a StatisticsError or KeyError traceback, or lost every result at the end (--json).
    path = pathlib.Path(__file__).parents[1] / "tools" / f"{tool}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code == 2 and error in capsys.readouterr().err
