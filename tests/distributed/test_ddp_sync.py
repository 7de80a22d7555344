"""Under DDP (2 gloo processes, through the CLI), random features are identical on every
rank after every redraw, and pre-SBN running statistics are identical on both ranks
(docs/maths.md §5.6, §10.1), with DDP's own buffer broadcast switched off so that it cannot hide a
difference. ``ddp_probe.StateDump`` saves each rank's state after every training batch.
"""

from __future__ import annotations

import torch
from ddp_probe import ddp, run_cli


def test_ddp_features_and_pre_sbn_statistics_identical_on_both_ranks(tmp_path, monkeypatch):
    (tmp_path / "probe.yaml").write_text(
        "trainer:\n  callbacks:\n    - class_path: ddp_probe.StateDump\n"
    )
    args = [
        "fit",
        "--config",
        "lra_listops.yaml",
        "--config",
        "attention/rmfa_exp.yaml",
        *ddp(2),
        "--config",
        str(tmp_path / "probe.yaml"),
        "--data.data_dir",
        str(tmp_path / "data"),
        "--data.train_size",
        "32",
        "--data.val_size",
        "4",
        "--data.test_size",
        "4",
        "--data.batch_size",
        "4",
        "--model.init_args.d_model",
        "16",
        "--model.init_args.ffn_dim",
        "32",
        "--model.init_args.attention.num_features",
        "16",
        "--callbacks.redraw.policy",
        "steps",
        "--callbacks.redraw.every_n_steps",
        "2",
        "--trainer.max_steps",
        "7",
        "--trainer.val_check_interval",
        "4",
        "--trainer.enable_progress_bar",
        "false",
        "--runs_dir",
        str(tmp_path / "runs"),
        "--wandb_mode",
        "disabled",
        "--test_after_fit",
        "false",
    ]
    monkeypatch.setenv("DDP_PROBE_DIR", str(tmp_path / "probe"))
    proc = run_cli(args, cwd=tmp_path)
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr
    r0 = torch.load(tmp_path / "probe/rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "probe/rank1.pt", weights_only=False)
    assert [s["step"] for s in r0] == [s["step"] for s in r1] == list(range(1, 8))
    # The ranks trained on different batches, so equal statistics are not a coincidence.
    assert any(a["batch"] != b["batch"] for a, b in zip(r0, r1))

    draws = []
    for a, b in zip(r0, r1):
        assert len(a["features"]) == 2  # two layers with random features
        for fa, fb in zip(a["features"], b["features"]):
            assert fa.keys() == fb.keys()
            for key in fa:
                assert torch.equal(fa[key], fb[key]), (a["step"], key)
        draws.append(int(a["features"][0]["redraw_index"]))
        assert len(a["sbn"]) == 2
        for (ma, va), (mb, vb) in zip(a["sbn"], b["sbn"]):
            assert torch.equal(ma, mb) and torch.equal(va, vb), a["step"]
    # Batch s (0-based) trains with draw s // 2: redraws at steps 2, 4 and 6.
    assert draws == [0, 0, 1, 1, 2, 2, 3]
    first, last = r0[0]["features"][0], r0[-1]["features"][0]
    assert any(not torch.equal(first[k], last[k]) for k in first if k != "redraw_index")
    # Statistics moved away from their initial values (0 mean, 1 variance).
    assert not torch.equal(r0[-1]["sbn"][0][0], torch.zeros_like(r0[-1]["sbn"][0][0]))
