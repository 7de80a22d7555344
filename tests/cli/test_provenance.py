"""What ran, recorded: every run folder's ``provenance.yaml`` (code, versions, machine, the
precision that ran, world size, command line); ``report`` shows commit and device per row and
refuses to average runs whose records differ unless ``--allow_mixed``; the committed results
carry records recovered from their own files."""

import re
import shutil
import subprocess
from pathlib import Path

import lightning
import pytest
import torch
import yaml
from tiny_run import tiny_listops

from macformer_lit import provenance
from macformer_lit.cli import main
from macformer_lit.report import main as report_main

REPO = Path(__file__).resolve().parents[2]


def tiny(root: Path, subcommand: str, *extra: str) -> list[str]:
    quiet = ["--wandb_mode", "disabled", "--trainer.enable_progress_bar", "false"]
    return [subcommand, *tiny_listops(root / "data", root / "runs", *quiet, *extra)]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A finished tiny fit (4 steps, tested after), then a test of its last checkpoint."""
    root = tmp_path_factory.mktemp("prov")
    main(tiny(root, "fit", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
              "--experiment", "a"))  # fmt: skip
    main(tiny(root, "test", "--experiment", "a", "--ckpt_path", "last"))
    return root, root / "runs/a/version_0"


def test_a_fit_records_what_ran(fitted):
    root, run = fitted
    (entry,) = provenance.read(run)  # the test after fit is part of the fit: one entry
    assert entry["subcommand"] == "fit"
    assert entry["command"].startswith("python -m macformer_lit fit --config lra_listops.yaml")
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert entry["code"]["commit"] == (head or provenance.UNKNOWN)
    assert isinstance(entry["code"]["dirty"], bool) or entry["code"]["dirty"] == "unknown"
    assert entry["code"]["digest"] == provenance.package_digest()
    assert entry["versions"]["torch"] == str(torch.__version__)
    assert entry["versions"]["lightning"] == lightning.__version__
    assert entry["versions"]["cuda"] == (torch.version.cuda or "none")
    machine = entry["machine"]
    assert machine["devices"] == ["cpu"] and machine["threads"] == torch.get_num_threads()
    assert machine["cpu"] == provenance.cpu_model()
    assert machine["cpu_flags"] == provenance.cpu_flags()
    assert "attention_kernels" not in entry  # softmax: no kernel options
    assert entry["precision"] == {"asked": None, "used": "32-true"}
    assert entry["world_size"] == 1
    # Every checkpoint carries the config it trained with.
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    recorded = ckpt[provenance.CHECKPOINT_KEY]
    assert recorded["config"]["trainer"]["max_steps"] == 4
    assert recorded["precision"] == "32-true" and recorded["world_size"] == 1


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_a_fit_records_the_attention_kernels_the_machine_chose(tmp_path):
    """auto_kernels chooses by the machine: the record says what it chose (one line, the
    same for both layers; attention/maclaurin.py, choose_kernels)."""
    main(tiny(tmp_path, "fit", "--config", "attention/maclaurin_ppsbn_auto.yaml",
              "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
              "--experiment", "auto"))  # fmt: skip
    (entry,) = provenance.read(tmp_path / "runs/auto/version_0")
    (choice,) = entry["attention_kernels"]
    assert choice.startswith("auto: native_map+native_fused"), choice


def test_an_evaluation_records_its_checkpoint(fitted):
    root, run = fitted
    (entry,) = provenance.read(root / "runs/a/version_1")
    assert entry["subcommand"] == "test"
    assert entry["checkpoint"] == {"path": str(run / "checkpoints/last.ckpt"), "step": 4}


def test_the_precision_that_ran_is_recorded(tmp_path):
    """16-mixed asked on a CPU runs bf16: the record says both."""
    main(tiny(tmp_path, "fit", "--trainer.max_steps", "1", "--trainer.precision", "16-mixed",
              "--test_after_fit", "false", "--experiment", "p"))  # fmt: skip
    (entry,) = provenance.read(tmp_path / "runs/p/version_0")
    assert entry["precision"] == {"asked": "16-mixed", "used": "bf16-mixed"}


# ---- report ------------------------------------------------------------------------------
def copies(fitted, tmp_path, *names: str) -> list[Path]:
    """Copies of the finished run as further seeds (seed_everything 1, 2, ...)."""
    _, run = fitted
    out = []
    for seed, name in enumerate(names, 1):
        folder = tmp_path / "runs" / name
        shutil.copytree(run, folder, ignore=shutil.ignore_patterns("checkpoints"))
        config = folder / "config.yaml"
        config.write_text(
            config.read_text().replace("seed_everything: 42", f"seed_everything: {seed}")
        )
        out.append(folder)
    return out


def edit_record(folder: Path, **fields) -> None:
    entries = provenance.read(folder)
    for dotted, value in fields.items():
        provenance.set_key(entries[0], dotted.replace("__", "."), value)
    (folder / provenance.RECORD).write_text(yaml.safe_dump(entries, sort_keys=False))


def report_error(tmp_path, *extra) -> str:
    with pytest.raises(SystemExit) as err:
        report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), *extra])
    return str(err.value.code)


def test_report_shows_commit_and_device_and_averages_alike_runs(fitted, tmp_path):
    one, _ = copies(fitted, tmp_path, "one", "two")
    report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out/report.md").read_text()
    summary = provenance.summary(provenance.read(one))
    commit = summary["commit"] + ("*" if summary["dirty"] == "True" else "")
    row = next(line for line in md.splitlines() if line.startswith("| ListOps | softmax"))
    assert "| 2 |" in row  # both seeds in one row
    assert f"| CPU ({summary['cpu']}, {summary['threads']} thread" in row
    assert f"| {commit} |" in row


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("code__digest", "sha256:0000000000000000", "code: sha256:0000000000000000 (runs/one)"),
        ("versions__torch", "2.11.0", "torch: 2.11.0 (runs/one)"),
        ("precision__used", "bf16-mixed", "precision: bf16-mixed (runs/one)"),
        ("world_size", 2, "world_size: 2 (runs/one)"),
    ],
)
def test_report_refuses_to_average_runs_whose_records_differ(fitted, tmp_path, field, value, named):
    one, _ = copies(fitted, tmp_path, "one", "two")
    edit_record(one, **{field: value})
    err = report_error(tmp_path)
    assert err.startswith(
        "report: error: runs whose recorded code or settings differ would be averaged: "
        "ListOps softmax (CPU): "
    ), err
    assert named in err and " vs " in err and "(runs/two)" in err
    assert "--allow_mixed averages them anyway" in err
    assert "\n" not in err
    assert not (tmp_path / "out").exists()
    # Asked for, they are averaged, and the table lists the difference.
    report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out"), "--allow_mixed"])
    md = (tmp_path / "out/report.md").read_text()
    assert "## Averaged with --allow_mixed" in md and named in md


def test_runs_without_a_code_digest_average_only_with_one_another(fitted, tmp_path):
    """The explicit rule for records that hold no digest (recovered after the run, or none
    at all): ``unknown`` matches ``unknown`` only, and the row is marked †."""
    one, two = copies(fitted, tmp_path, "one", "two")
    edit_record(one, code__digest="unknown", code__commit="aaaaaaa", code__dirty=False)
    err = report_error(tmp_path)
    assert "code: unknown (runs/one) vs sha256:" in err
    # Both without a digest (as the committed results' records): averaged, commits shown.
    edit_record(two, code__digest="unknown", code__commit="bbbbbbb", code__dirty=True)
    report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert "| aaaaaaa, bbbbbbb* † |" in (tmp_path / "out/report.md").read_text()
    # Folders without any record (written before provenance.yaml) likewise, among themselves.
    for folder in (one, two):
        (folder / provenance.RECORD).unlink()
    report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert "| unknown † |" in (tmp_path / "out/report.md").read_text()


def test_report_applies_a_resumes_recorded_changes(fitted, tmp_path):
    """config.yaml keeps the first max_steps; the resume's recorded change says the run was
    meant to go on to step 8, so a fit tested at step 4 has not finished."""
    (one,) = copies(fitted, tmp_path, "one")
    record = dict(
        provenance.read(one)[0], changes=[{"key": "trainer.max_steps", "old": 4, "new": 8}]
    )
    provenance.append(one, record)
    report_main([str(tmp_path / "runs"), str(fitted[1]), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out/report.md").read_text()
    assert "training stopped before its limit: tested at step 4 of trainer.max_steps 8" in md


def test_an_unreadable_record_is_listed_as_skipped(fitted, tmp_path):
    (one,) = copies(fitted, tmp_path, "one")
    (one / provenance.RECORD).write_text("- when: [unclosed\n")
    report_main([str(tmp_path / "runs"), str(fitted[1]), "--out", str(tmp_path / "out")])
    md = (tmp_path / "out/report.md").read_text()
    assert re.search(r"`[^`]*runs/one`: provenance\.yaml is not valid YAML", md), md


# ---- the committed results ---------------------------------------------------------------
COMMITTED = sorted(p.parent for p in (REPO / "results").rglob("config.yaml"))


def test_every_committed_run_has_a_record():
    """Runs from before provenance.yaml have a recovered record (sources named, a short
    commit); runs since wrote their own (a full commit of a clean tree), one entry per start
    (a run resumed after a stop has two or more). Either way the code digest is the
    package's at that commit, never guessed."""
    assert len(COMMITTED) >= 20
    digests = {}
    for folder in COMMITTED:
        entries = provenance.read(folder)
        assert entries, folder
        for entry in entries:
            commit = entry["code"]["commit"]
            if "recovered" in entry:
                assert len(entries) == 1 and entry["sources"], folder
                assert re.fullmatch(r"[0-9a-f]{7}", commit), folder
            else:
                assert re.fullmatch(r"[0-9a-f]{40}", commit), folder
                assert entry["code"]["dirty"] is False, folder
            if commit not in digests:
                digests[commit] = provenance.digest_at(commit)
            if digests[commit] != provenance.UNKNOWN:  # a shallow clone lacks the commit
                assert entry["code"]["digest"] == digests[commit], folder
            header = (folder / "config.yaml").read_text().splitlines()[0]
            assert header == f"# lightning.pytorch=={entry['versions']['lightning']}", folder
    softmax = REPO / "results/lra_listops/lra_listops_table2"
    commits = [
        provenance.read(softmax / f"method=softmax,seed={s}/version_0")[0]["code"]["commit"]
        for s in (0, 1, 2)
    ]
    assert commits == ["8d6b7af", "b74208e", "b9d72b4"]


def test_digest_at_a_commit_equals_the_digest_of_that_checkout(tmp_path):
    """Recovered records get their code digest from git: ``digest_at`` must hash a commit's
    package exactly as ``package_digest`` hashes a checkout of it."""
    import hashlib
    import io
    import tarfile

    root = provenance.PACKAGE_DIR.parent
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", "HEAD", "macformer_lit"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip("not a git checkout")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp_path, filter="data")
    package = tmp_path / "macformer_lit"
    digest = hashlib.sha256()
    sources = [p for p in package.rglob("*") if p.suffix in (".py", ".cpp", ".h")]
    assert any(p.suffix == ".cpp" for p in sources)  # the native kernels' C++ counts too
    for path in sorted(sources, key=lambda p: p.relative_to(package).as_posix()):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    assert provenance.digest_at("HEAD") == "sha256:" + digest.hexdigest()[:16]
    assert provenance.digest_at("0" * 40) == provenance.UNKNOWN
