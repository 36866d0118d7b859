"""The CLI: pass list, info, and dump writing before/after graphs for every pass."""

from __future__ import annotations

from amxopt import cli
from amxopt.passes import DEFAULT_PASSES


def test_passes_lists_default_order(capsys):
    assert cli.main(["passes"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0].split(". ")[1] for line in lines] == [p.__name__ for p in DEFAULT_PASSES]


def test_info_names_cpu_features_and_providers(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "amx_tile=" in out and "avx512_bf16=" in out and "provider reference" in out


def test_dump_writes_graphs_and_report(tmp_path, capsys):
    assert cli.main(["dump", "tiny-wan", "--out", str(tmp_path), "--dtype", "fp32", "--no-autotune"]) == 0
    for i, p in enumerate(DEFAULT_PASSES, 1):
        before = (tmp_path / f"{i:02d}_{p.__name__}.before.txt").read_text()
        after = (tmp_path / f"{i:02d}_{p.__name__}.after.txt").read_text()
        assert "def forward" in before and "def forward" in after
    first = (tmp_path / "01_replace_attention.before.txt").read_text()
    last = (tmp_path / f"{len(DEFAULT_PASSES):02d}_pack_weights.after.txt").read_text()
    assert "aten.scaled_dot_product_attention" in first and "amxopt.varlen_attention" in last
    assert "aten.linear" not in last and "pack_linear_weight" not in last
    report = (tmp_path / "report.txt").read_text()
    assert "rewrite report: WanTransformer3DModel" in report
    assert "rewrite report" in capsys.readouterr().out


def test_dump_of_a_tp_shard_shows_the_collectives(tmp_path, capsys):
    args = ["dump", "tiny-qwen3-vl-vision", "--out", str(tmp_path), "--dtype", "fp32", "--no-autotune"]
    assert cli.main([*args, "--tp", "3", "--rank", "2"]) == 0
    index = [p.__name__ for p in DEFAULT_PASSES].index("shard_tensor_parallel") + 1
    after = (tmp_path / f"{index:02d}_shard_tensor_parallel.after.txt").read_text()
    assert after.count("_c10d_functional.all_reduce") == 6  # 3 blocks x (attention, MLP)
    assert "tensor parallel (tp 3, rank 2): 6 attention/MLP units sharded" in capsys.readouterr().out
