"""benchmarks/train_step.py on a tiny shape: every requested row, the reference ratio, the FLOP
count against a hand computation, tokens/s, the machine header, a failing case reported in
the table, and ``--render`` reproducing the Markdown byte for byte."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import yaml

from benchmarks import train_step
from benchmarks._common import cpu_model, median

B, N = 2, 64


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_tiny_run_rows_flops_tokens_and_render(tmp_path, monkeypatch):
    build = train_step.build_model

    def build_or_fail(preset, backend):
        if backend.name == "favor":
            raise RuntimeError("boom\nsecond line")
        return build(preset, backend)

    monkeypatch.setattr(train_step, "build_model", build_or_fail)
    out = tmp_path / "run"
    train_step.main(
        [
            "--presets", "listops", "--backends", "softmax,macformer,torch,favor",
            "--paths", "eager", "--rounds", "1", "--warmup", "0",
            "--max-len", str(N), "--batch", str(B), "--threads", "1",
            "--gemm-n", "128", "--gemm-calls", "2", "--out", str(out), "--name", "tiny",
        ]
    )  # fmt: skip
    raw = json.loads((out / "tiny.json").read_text())
    md = (out / "tiny.md").read_text()
    rows = read_csv(out / "tiny.csv")
    assert (out / "tiny.png").stat().st_size > 0

    # Every requested row, in the script's backend order; the failure is a row, not a crash.
    [preset] = raw["presets"]
    assert (preset["batch"], preset["length"]) == (B, N)
    got = [(r["backend"], r["path"], r["status"]) for r in preset["results"]]
    assert got == [
        ("softmax", "eager", "ok"),
        ("macformer", "eager", "ok"),
        ("favor", "eager", "failed: RuntimeError: boom"),
        ("torch", "eager", "ok"),
    ]
    assert [(r["backend"], r["path"]) for r in rows] == [g[:2] for g in got]
    assert "| FAVOR+ | eager | failed: RuntimeError: boom |" in md
    for label in ("softmax (SDPA)", "Macformer (RMFA exp + ppSBN)", "nn.TransformerEncoder"):
        assert f"| {label}" in md
    results = {r["backend"]: r for r in preset["results"]}
    for name in ("softmax", "macformer", "torch"):
        assert len(results[name]["times_s"]) == 1
        assert results[name]["peak_memory_bytes"] > 0

    # The reference: eager fp32 softmax, ratio exactly 1 (time and memory).
    by = {r["backend"]: r for r in rows}
    assert float(by["softmax"]["ratio_to_eager_softmax"]) == 1.0
    assert float(by["softmax"]["mem_ratio_to_eager_softmax"]) == 1.0
    summary = {r["backend"]: r for r in train_step.summarise(preset, {"float32": 1.0})}
    assert summary["softmax"]["ratio"] == 1.0

    # FLOPs of the softmax step by hand, sizes from the preset YAML.
    init = yaml.safe_load(open(train_step.default_config_dir() / "lra_listops.yaml"))["model"][
        "init_args"
    ]
    m, H, f, layers = init["d_model"], init["num_heads"], init["ffn_dim"], init["num_layers"]
    d, classes = m // H, 10  # ListOps: 10 classes
    mac_layer = 4 * B * N * m * m + 2 * B * N * m * f + 2 * B * H * N * N * d
    mac = layers * mac_layer + B * (m * f + f * classes)
    assert (m, H, f, layers) == (64, 2, 128, 2)
    assert 3 * 2 * mac == 63_028_224
    assert results["softmax"]["flops"]["step"] == 3 * 2 * mac
    assert results["torch"]["flops"]["step"] == 3 * 2 * mac
    assert int(by["softmax"]["flops_step"]) == 3 * 2 * mac
    # Macformer: the same projections, FFN and head, attention from its own layout.
    layout = results["macformer"]["layout"]
    assert len(layout) == layers and all(x["S"] > 0 and x["D"] > 0 for x in layout)
    attn = sum(2 * B * H * N * x["S"] * d + 2 * B * H * N * x["D"] * (d + 1) for x in layout)
    mac_rmfa = mac - layers * 2 * B * H * N * N * d + attn
    assert results["macformer"]["flops"]["step"] == 6 * mac_rmfa

    # tokens/s = real tokens / median time; GFLOP/s = FLOPs / median time.
    assert preset["real_tokens"] == B * N
    for name in ("softmax", "macformer", "torch"):
        t = median(results[name]["times_s"])
        assert float(by[name]["tokens_per_s"]) == pytest.approx(B * N / t, rel=1e-5)
        assert summary[name]["tokens_per_s"] == B * N / t
        flops = results[name]["flops"]["step"]
        assert float(by[name]["gflops_per_s"]) == pytest.approx(flops / t / 1e9, rel=1e-5)

    # The header names the machine, the threads and the GEMM peak.
    assert f"- **cpu**: {cpu_model()}" in md
    assert "- **intra-op threads used**: 1" in md
    assert "- **GEMM peak float32**:" in md

    # --render reproduces the outputs byte for byte.
    again = tmp_path / "render"
    train_step.main(["--render", str(out / "tiny.json"), "--out", str(again), "--name", "tiny"])
    assert (again / "tiny.md").read_bytes() == (out / "tiny.md").read_bytes()
    assert (again / "tiny.csv").read_bytes() == (out / "tiny.csv").read_bytes()
    assert (again / "tiny.json").read_bytes() == (out / "tiny.json").read_bytes()


def test_fp16_is_a_gpu_path_reported_as_skipped_on_the_cpu(tmp_path):
    """``--paths fp16`` (autocast fp16 + GradScaler, Lightning's 16-mixed) is CUDA-only: on
    the CPU each backend gets a skipped row naming why, beside its timed eager row."""
    out = tmp_path / "run"
    train_step.main(
        [
            "--presets", "listops", "--backends", "softmax,linear", "--paths", "eager,fp16",
            "--rounds", "1", "--warmup", "0", "--max-len", "32", "--batch", "2",
            "--threads", "1", "--gemm-n", "64", "--gemm-calls", "1", "--no-memory",
            "--out", str(out), "--name", "fp16",
        ]
    )  # fmt: skip
    [preset] = json.loads((out / "fp16.json").read_text())["presets"]
    got = {(r["backend"], r["path"]): r["status"] for r in preset["results"]}
    assert got[("softmax", "eager")] == got[("linear", "eager")] == "ok"
    for name in ("softmax", "linear"):
        assert (
            got[(name, "fp16")]
            == "skipped: fp16 (a GradScaler, as Lightning's 16-mixed) is a GPU path"
        )
    assert "float16" not in json.loads((out / "fp16.json").read_text())["gemm_peaks"]


def test_profile_lists_the_ops_and_group_shares_of_each_case(tmp_path):
    """--profile N: one more step per case under torch.profiler; the Markdown lists N ops
    per case and the GEMM, SDPA and copy shares (softmax's SDPA share is not zero, RMFA's
    is), and --render keeps them."""
    out = tmp_path / "run"
    train_step.main(
        [
            "--presets", "listops", "--backends", "softmax,rmfa_nosbn", "--paths", "eager",
            "--rounds", "1", "--warmup", "0", "--max-len", str(N), "--batch", str(B),
            "--threads", "1", "--gemm-n", "128", "--gemm-calls", "2", "--no-memory",
            "--profile", "3", "--out", str(out), "--name", "prof",
        ]
    )  # fmt: skip
    [preset] = json.loads((out / "prof.json").read_text())["presets"]
    prof = {r["backend"]: r["profile"] for r in preset["results"]}
    assert all(len(p["top"]) == 3 and p["total_ms"] > 0 for p in prof.values())
    assert prof["softmax"]["shares"]["SDPA"] > 0 and prof["rmfa_nosbn"]["shares"]["SDPA"] == 0
    assert prof["rmfa_nosbn"]["shares"]["GEMM"] > 0
    # ATen calls from outside ATen: RMFA's step (map, products, division) makes more of
    # them than softmax's, whose attention is one fused SDPA call each way.
    assert 0 < prof["softmax"]["aten_calls"] < prof["rmfa_nosbn"]["aten_calls"]
    md = (out / "prof.md").read_text()
    assert md.count("of cpu self time; GEMM ") == 2
    assert md.count(" top-level ATen calls. Top: ") == 2
    train_step.main(["--render", str(out / "prof.json"), "--out", str(tmp_path), "--name", "prof"])
    assert (tmp_path / "prof.md").read_text() == md


@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole-batch"])
def test_whole_batch_runs_the_cpu_step_as_a_gpu_runs_it(tmp_path, monkeypatch, whole):
    """--whole-batch: the Maclaurin map and ppSBN run over the whole batch, as off the CPU
    (what a GPU step keeps, measured here); the header says which; the switch is off again
    after the run. Without it, the same run cuts the batch into pieces (some passes)."""
    from macformer_lit.attention import features, pieces, ppsbn

    monkeypatch.setattr(pieces, "PIECE_BYTES", 1)  # one batch entry a piece, where pieces run
    seen = []

    def spy(t, bytes_per_entry=None):
        got = pieces.batch_slices(t, bytes_per_entry)
        seen.append(len(got))
        return got

    monkeypatch.setattr(features, "batch_slices", spy)
    monkeypatch.setattr(ppsbn, "batch_slices", spy)
    out = tmp_path / "run"
    train_step.main(
        [
            "--presets", "listops", "--backends", "macformer", "--paths", "eager",
            "--rounds", "1", "--warmup", "0", "--max-len", "32", "--batch", str(B),
            "--threads", "1", "--gemm-n", "64", "--gemm-calls", "1", "--no-memory",
            "--out", str(out), "--name", "wb", *(["--whole-batch"] if whole else []),
        ]
    )  # fmt: skip
    assert seen, "the Macformer step never asked for batch pieces"
    assert (set(seen) == {1}) if whole else (B in seen)
    assert not pieces._whole
    run = json.loads((out / "wb.json").read_text())["run"]
    assert run["batch pieces"].startswith("off (--whole-batch" if whole else "the package's")


@pytest.mark.parametrize("name", ["uniform", "uniform_prefix"])
def test_uniform_layers_count_no_attention_flops(name):
    """Uniform attention is a mean of v (a reduction): its layers count projections and FFN
    only, not softmax's N² products (they once did, giving GFLOP/s above the GEMM peak)."""
    config_dir = train_step.default_config_dir()
    args = argparse.Namespace(max_len=N, batch=B)
    preset = train_step.load_preset("listops", config_dir, args)
    backend = {b.name: b for b in train_step.all_backends(config_dir)}[name]
    model = train_step.build_model(preset, backend)
    layout = train_step.attention_layout(model, backend, preset)
    assert layout == [{"kind": "uniform"}] * preset["model_init_args"]["num_layers"]
    flops = train_step.count_flops(preset, layout)["forward_parts"]
    assert flops["attention"] == flops["feature_map"] == 0
    assert flops["projections"] > 0 and flops["ffn"] > 0
