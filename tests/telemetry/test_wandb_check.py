"""W&B online without credentials: refused by train's check, before the model is built, where
wandb.init refused it only once the model was built and the data read. The credentials are
searched as wandb searches (WANDB_API_KEY, the netrc entry `wandb login` wrote for the server);
offline and disabled W&B need none."""

from __future__ import annotations

import os

import pytest

from conftest import main_in_process, tiny_overrides, wandb_afresh
from shardtune.errors import UserError
from shardtune.telemetry.trackers import check_trackers, check_wandb

KEY = "k" * 40  # a key of the shape wandb takes; nothing is sent
HOST = "http://127.0.0.1:9"  # nothing answers there: the key is checked before the server is asked


@pytest.fixture
def never_logged_in(tmp_path, monkeypatch):
    """A machine where W&B was never logged in to: a home of the test's own (no ~/.netrc, no W&B
    settings file) and no WANDB_* variables; W&B's settings, which wandb loads once per process,
    are loaded afresh in the test (and the earlier ones restored after it)."""
    for name in [n for n in os.environ if n.startswith("WANDB_") or n == "NETRC"]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb_afresh(monkeypatch)
    return tmp_path


def refusal(check) -> str:
    with pytest.raises(UserError) as caught:
        check()
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("mode", [None, "online", "shared"])
def test_online_without_a_key_is_refused_naming_the_three_ways(never_logged_in, monkeypatch, mode):
    monkeypatch.setenv("WANDB_BASE_URL", HOST)
    if mode:
        monkeypatch.setenv("WANDB_MODE", mode)
    line = refusal(lambda: check_trackers(["tensorboard", "wandb"], timeout=2))
    assert f"wandb logs online to {HOST} but finds no API key" in line
    assert all(way in line for way in ("`wandb login`", "WANDB_API_KEY", "WANDB_MODE=offline")), line


def test_a_key_is_found_where_wandb_looks_for_the_server_it_talks_to(never_logged_in, monkeypatch):
    """WANDB_API_KEY; the netrc entry of the server's host (~/.netrc, or NETRC's file), not another
    host's; the server `wandb login --host` saved in W&B's settings file when WANDB_BASE_URL is unset."""
    home = never_logged_in
    monkeypatch.setenv("WANDB_BASE_URL", HOST)
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    check_wandb()
    monkeypatch.delenv("WANDB_API_KEY")
    wandb_afresh(monkeypatch)
    (home / ".netrc").write_text(f"machine other.example login user password {KEY}\n")
    assert "finds no API key" in refusal(check_wandb)
    (home / ".netrc").write_text(f"machine 127.0.0.1:9 login user password {KEY}\n")
    check_wandb()
    (home / "elsewhere").write_text((home / ".netrc").read_text())
    (home / ".netrc").unlink()
    monkeypatch.setenv("NETRC", str(home / "elsewhere"))
    check_wandb()

    monkeypatch.delenv("WANDB_BASE_URL")
    wandb_afresh(monkeypatch)
    (home / "wandb-config").mkdir()
    (home / "wandb-config" / "settings").write_text("[default]\nbase_url = http://127.0.0.1:8\n")
    assert "online to http://127.0.0.1:8 but" in refusal(check_wandb)
    (home / "elsewhere").write_text(f"machine 127.0.0.1:8 login user password {KEY}\n")
    check_wandb()


@pytest.mark.parametrize("mode", ["offline", "dryrun", "disabled"])
def test_offline_or_disabled_needs_no_key(never_logged_in, monkeypatch, mode):
    monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_BASE_URL", HOST)
    check_trackers(["wandb"], timeout=2)


@pytest.mark.parametrize("env, words", [
    ({"WANDB_API_KEY": "short"}, ["wandb refuses its credentials for", "WANDB_API_KEY", "wandb login"]),
    ({"WANDB_MODE": "bogus"}, ["wandb refuses its settings", "'online'", "WANDB_MODE"]),
    ({"WANDB_BASE_URL": "not a url", "WANDB_MODE": "offline"}, ["wandb refuses its settings", "WANDB_BASE_URL"]),
])
def test_what_wandb_would_refuse_is_refused_at_the_check(never_logged_in, monkeypatch, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = refusal(lambda: check_trackers(["wandb"], timeout=2))
    assert all(w in line for w in words), line


def test_train_refuses_before_it_builds_anything(never_logged_in, assets, monkeypatch):
    monkeypatch.setenv("WANDB_BASE_URL", HOST)
    out = never_logged_in / "run"
    code, err = main_in_process(["train", *tiny_overrides(assets, out), "log.trackers=[wandb]"])
    assert code == 2 and "wandb logs online" in err and "wandb login" in err, err
    assert not out.exists()


def test_wandb_offline_saved_in_its_settings_needs_no_key(never_logged_in, monkeypatch):
    """`wandb offline` writes the mode into W&B's settings file, with no WANDB_MODE: the run logs
    to its folder, as wandb.init reads it, and needs no key."""
    monkeypatch.setenv("WANDB_BASE_URL", HOST)
    (never_logged_in / "wandb-config").mkdir()
    (never_logged_in / "wandb-config" / "settings").write_text("[default]\nmode = offline\n")
    check_trackers(["wandb"], timeout=2)  # no refusal: no key needed, no server asked
