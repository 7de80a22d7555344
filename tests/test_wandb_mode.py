"""W&B ``mode: auto``: online exactly when wandb will find an API key, offline otherwise, and an
explicit ``WANDB_MODE`` wins over the guess. Real environment variables and real netrc files
under a temporary HOME; nothing touches the network (no run is started)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from macformer_lit.loggers import AutoWandbLogger, has_wandb_credentials, netrc_path, resolve_mode

KEY = "0123456789abcdef0123456789abcdef01234567"  # the shape of a W&B key, 40 hex digits


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty HOME and none of the W&B variables: the state of a machine never logged in."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    assert Path.home() == home and Path("~").expanduser() == home
    return home


def _entry(host="api.wandb.ai", password=KEY):
    return f"machine {host}\n  login user\n" + (f"  password {password}\n" if password else "")


def test_no_credentials_means_offline(home):
    assert not has_wandb_credentials()
    assert resolve_mode("auto") == "offline"


def test_an_api_key_in_the_environment_means_online(home, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    assert has_wandb_credentials()
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_API_KEY", "")  # set but empty is no key
    assert resolve_mode("auto") == "offline"


# ~/.netrc contents -> whether wandb finds a key in it for api.wandb.ai.
NETRC_CASES = {
    "entry": (_entry(), True),
    "other host only": (_entry(host="example.com"), False),
    "default entry": (f"default login user password {KEY}\n", True),  # netrc's fallback
    "entry without a password": (_entry(password=None), False),
    "empty password": ("machine api.wandb.ai login user password\n", False),
    "unparsable": (f"password {KEY}\n", False),  # NetrcParseError: bad toplevel token
    "empty": ("", False),
}


@pytest.mark.parametrize("case", NETRC_CASES)
def test_the_netrc_entry_for_api_wandb_ai_decides(case, home):
    text, online = NETRC_CASES[case]
    (home / ".netrc").write_text(text)
    assert has_wandb_credentials() is online
    assert resolve_mode("auto") == ("online" if online else "offline")


@pytest.mark.parametrize("case", NETRC_CASES)
def test_the_guess_agrees_with_wandbs_own_netrc_reader(case, home):
    """The answer wandb gives for the same file (its internal reader, as of wandb 0.31)."""
    wbnetrc = pytest.importorskip("wandb.sdk.lib.wbauth.wbnetrc", reason="wandb < 0.2x layout")
    text, _ = NETRC_CASES[case]
    (home / ".netrc").write_text(text)
    found = wbnetrc.read_netrc_auth(host="https://api.wandb.ai") is not None
    assert has_wandb_credentials() is found


def test_the_netrc_variable_names_the_file(home, monkeypatch):
    (home / ".netrc").write_text(_entry())
    elsewhere = home / "sub" / "netrc"
    elsewhere.parent.mkdir()
    elsewhere.write_text(_entry(host="example.com"))
    monkeypatch.setenv("NETRC", str(elsewhere))
    assert netrc_path() == elsewhere
    assert resolve_mode("auto") == "offline"  # ~/.netrc is not read when NETRC is set
    elsewhere.write_text(_entry())
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("NETRC", "~/sub/netrc")  # expanded, as wandb does
    assert netrc_path() == elsewhere and resolve_mode("auto") == "online"
    monkeypatch.setenv("NETRC", str(home / "missing"))
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("NETRC", "")  # empty is unset: back to ~/.netrc
    assert netrc_path() == home / ".netrc" and resolve_mode("auto") == "online"


def test_a_windows_style_netrc_is_read_when_it_is_the_only_one(home):
    (home / "_netrc").write_text(_entry())
    assert netrc_path() == home / "_netrc" and resolve_mode("auto") == "online"
    (home / ".netrc").write_text("")
    assert netrc_path() == home / ".netrc" and resolve_mode("auto") == "offline"


def test_a_self_hosted_server_needs_its_own_entry(home, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")
    (home / ".netrc").write_text(_entry())
    assert resolve_mode("auto") == "offline"
    (home / ".netrc").write_text(_entry(host="wandb.example.com"))
    assert resolve_mode("auto") == "online"


@pytest.mark.parametrize(
    "env, expected",
    [
        ("online", "online"),
        ("offline", "offline"),
        ("disabled", "disabled"),
        ("run", "online"),  # wandb's older names
        ("dryrun", "offline"),
    ],
)
@pytest.mark.parametrize("credentials", [False, True])
def test_wandb_mode_in_the_environment_wins_over_the_guess(
    home, monkeypatch, env, expected, credentials
):
    if credentials:
        monkeypatch.setenv("WANDB_API_KEY", KEY)
    assert has_wandb_credentials() is credentials
    monkeypatch.setenv("WANDB_MODE", env)
    assert resolve_mode("auto") == expected


def test_an_unknown_wandb_mode_leaves_the_guess(home, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    assert resolve_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    assert resolve_mode("auto") == "online"


@pytest.mark.parametrize("mode", ["online", "offline", "disabled"])
def test_an_explicit_mode_is_kept_whatever_the_environment(home, monkeypatch, mode):
    for env, key in (("online", ""), ("offline", KEY), ("disabled", KEY)):
        monkeypatch.setenv("WANDB_MODE", env)
        monkeypatch.setenv("WANDB_API_KEY", key)
        assert resolve_mode(mode) == mode


def test_the_logger_resolves_auto_without_starting_a_run(home, monkeypatch, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="macformer_lit.loggers"):
        offline = AutoWandbLogger(save_dir=str(tmp_path / "run"), mode="auto")
    assert offline.mode == "offline" and offline._wandb_init["mode"] == "offline"
    assert offline._offline is True
    assert "no credentials found, logging offline" in caplog.text
    assert (tmp_path / "run").is_dir() and offline.run_dir() is None  # no run yet
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="macformer_lit.loggers"):
        online = AutoWandbLogger(save_dir=str(tmp_path / "run2"), mode="auto")
    assert online.mode == "online" and online._wandb_init["mode"] == "online"
    assert online._offline is False and online._experiment is None
    assert "no credentials" not in caplog.text
