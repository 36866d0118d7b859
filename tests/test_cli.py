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
    # pack_weights: the weight and its packing op removed, the packed weight added; the text diff from before to after
    pack = (tmp_path / f"{len(DEFAULT_PASSES):02d}_pack_weights.diff.txt").read_text()
    assert re.findall(r"^(removed|added|changed) (\d+) nodes:$", pack, re.M) == [
        ("removed", "2"),
        ("added", "1"),
        ("changed", "0"),
    ]
    text = pack.split("+++ after\n")[1].splitlines()
    assert any(line.startswith("-") and "pack_linear_weight.default" in line for line in text), pack
    assert any(line.startswith("+") and "self._packed.fc_weight" in line for line in text), pack
    assert "<td>pack_weights</td><td>yes</td><td>-2 +1 ~0</td>" in (tmp_path / "index.html").read_text()
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
        (["--size", "0,32,32"], "sizes must be positive and finite"),
        (["--tp", "2", "--rank", "5"], "--rank 5 is not a rank of --tp 2"),
        (["--tp", "2", "--rank", "2"], "--rank 2 is not a rank of --tp 2 (0..1)"),
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


def test_a_json_file_there_is_left_as_it_was(tmp_path):
    # (an earlier run's results: the check neither removes nor empties it)
    earlier = tmp_path / "run1.json"
    earlier.write_text('{"earlier": "results"}')
    cli.check_run_options(argparse.ArgumentParser(), 1, str(earlier))
    assert earlier.read_text() == '{"earlier": "results"}'


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


def build_ids():
    return nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 8)).eval(), (torch.tensor([[1, 2, 9]]),)


def test_a_factorys_integer_inputs_are_not_cast():
    model, (ids,) = dump.load_target("tests.test_cli:build_ids", torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16 and ids.dtype == torch.int64


def test_a_factory_is_found_from_the_working_directory(tmp_path, monkeypatch):
    # As the console script runs: its sys.path starts at its bin/, without the working directory.
    (tmp_path / "amxopt_cwd_factory.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    try:
        model, (x,) = dump.load_target("amxopt_cwd_factory:build", torch.bfloat16)
    finally:
        sys.modules.pop("amxopt_cwd_factory", None)
    assert model.weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16


def test_dump_writes_into_dumps_named_after_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["dump", "tests.test_cli:build_tiny", "--dtype", "fp32", "--no-autotune"]) == 0
    assert (tmp_path / "dumps" / "tests.test_cli.build_tiny" / "index.html").is_file()  # (no ':' in a path)


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


def _chain(modules: list[tuple[str, ...]]):
    """A graph input, then one node per entry of ``modules`` (the module paths it is in), in a chain."""
    import networkx as nx

    g, prev = nx.DiGraph(), "x"
    g.add_node(prev, kind="input", label="x", detail="", modules=())
    for i, mods in enumerate(modules):
        g.add_node(f"n{i}", kind="aten", label="op", detail="", modules=mods)
        g.add_edge(prev, f"n{i}")
        prev = f"n{i}"
    return g


def test_dump_draws_a_large_graphs_first_block():
    assert dump.layer(_chain([()] * 399))[1] == "whole graph"  # 400 nodes: drawn whole
    assert dump.layer(_chain([()] * 400))[1] == "first 400 nodes"
    # The first block of a stack (blocks.0 beside blocks.1), not a one-element list's proj.0; the node
    # feeding it drawn as an input.
    blocks = [("blocks", f"blocks.{b}") for b in range(50) for _ in range(10)]
    sub, title = dump.layer(_chain([("proj", "proj.0"), *blocks]))
    assert title == "blocks.0"
    assert sorted(kind for _, kind in sub.nodes(data="kind")) == ["aten"] * 10 + ["input"]


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


class _Off(nn.Module):
    """An output near a tolerance's edge case, and a captured form off by a chosen amount."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc, self.kind = nn.Linear(8, 8), kind

    def forward(self, x):
        y, captured = self.fc(x), torch.compiler.is_compiling()
        if self.kind == "nan":  # NaN where captured
            return y * torch.nan if captured else y
        if self.kind == "nan_second":  # two outputs, the second NaN where captured
            return y, (y * torch.nan if captured else y)
        if self.kind == "tiny":  # magnitude 1e-6, off by 1e-9 in fp32: within 2e-5 of the 0.01 floor
            y = y * 1e-6
            return y + 1e-9 if captured and y.dtype == torch.float32 else y
        if self.kind == "zero":  # all zeros, off by 1e-6 in bf16: within 2% of the 1e-3 floor
            y = y * 0
            return y + 1e-6 if captured and y.dtype == torch.bfloat16 else y
        # "skewed": one column of 1000s beside values near 1, off by 5e-3 in fp32: within 2e-5 of its
        # largest magnitude (2e-2), not of its mean one (~2e-3)
        y = torch.cat([torch.full_like(y[:, :1], 1000.0), y], dim=1)
        return y + 5e-3 if captured and y.dtype == torch.float32 else y


def build_nan():
    return _Off("nan").eval(), (torch.randn(3, 8),)


def build_nan_second():
    return _Off("nan_second").eval(), (torch.randn(3, 8),)


def build_tiny_output():
    return _Off("tiny").eval(), (torch.randn(3, 8),)


def build_zero_output():
    return _Off("zero").eval(), (torch.randn(3, 8),)


def build_skewed_output():
    return _Off("skewed").eval(), (torch.randn(3, 8),)


class _Cancelling(nn.Module):
    """``x (1 + 2**-6) - x``: bf16 keeps little of it (an error near 10% of the output, past the 2% floor);
    the captured form 1.25x as far from fp32 as eager bf16."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.tensor(1 + 2**-6))
        self.register_buffer("b", torch.tensor(1.0))

    def forward(self, x):
        y = x * self.a - x * self.b
        if torch.compiler.is_compiling() and y.dtype == torch.bfloat16:
            exact = x.float() * self.a.float() - x.float() * self.b.float()
            return exact + 1.25 * (y.float() - exact)
        return y


def build_cancelling():
    return _Cancelling().eval(), (torch.randn(4, 64),)


@pytest.mark.parametrize(
    "factory, fails",
    [
        ("build_nan", ["fp32", "bf16"]),  # a NaN is never within a bound
        ("build_nan_second", ["fp32", "bf16"]),
        ("build_tiny_output", []),  # the 0.01 floor: 2e-5 of magnitude 1e-6 would fail summation order
        ("build_zero_output", []),  # the 1e-3 floor: 2% of zero would fail any bf16 rounding
        ("build_skewed_output", []),  # the largest magnitude, not the mean one
        ("build_cancelling", []),  # bf16: within 1.5x eager bf16's error
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


def test_check_names_a_nan_output_as_the_one_nearest_its_bound(capsys):
    # A NaN error over its bound compares as nothing: counted as infinitely near, not output 0 (exact).
    assert cli.main(["check", "tests.test_cli:build_nan_second", "--provider", "reference"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines if "nearest its bound: output 1, nan FAILS" in line] == [
        "fp32",
        "bf16",
    ], lines


def test_commands_pass_their_options_on(tmp_path, monkeypatch):
    import amxopt
    import amxopt.runtime
    from amxopt.runtime import module

    calls = []
    optimize, profile_graph, build_graph = amxopt.optimize, module.profile_graph, amxopt.runtime.build_graph

    def record(name, real):
        def call(*args, **kwargs):
            config = next((a for a in [*args, *kwargs.values()] if isinstance(a, amxopt.AmxConfig)), None)
            calls.append((name, config.autotune if config else kwargs))
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(amxopt, "optimize", record("optimize", optimize))
    monkeypatch.setattr(module, "profile_graph", record("profile_graph", profile_graph))
    monkeypatch.setattr(amxopt.runtime, "build_graph", record("build_graph", build_graph))
    factory = "tests.test_cli:build_tiny"
    assert cli.main(["check", factory, "--no-autotune", "--provider", "reference"]) == 0
    assert calls == [("optimize", False)] * 2
    calls.clear()
    assert cli.main(["profile", factory, "--dtype", "fp32", "--no-autotune", "--repeats", "1", "--by-shape"]) == 0
    assert calls == [("optimize", False), ("profile_graph", dict(repeats=1, by_shape=True))]
    calls.clear()
    assert cli.main(["dump", factory, "--dtype", "fp32", "--no-autotune", "--out", str(tmp_path)]) == 0
    assert calls == [("build_graph", False)]


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
