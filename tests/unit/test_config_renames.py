"""Renamed config keys (config_renames.RENAMED): each earlier key, in a YAML file or an override,
loads to the same config as its new keys, with one line saying so; the earlier and the new name
given together are a one-line error."""

import pytest
import yaml

from megatron_gspo import docs_gen
from megatron_gspo.config import load_config
from megatron_gspo.config_renames import NOTICES_PRINTED, RENAMED
from megatron_gspo.errors import UserError

pytestmark = pytest.mark.unit

# (earlier key, its value) -> the same setting in today's keys, written out by hand
TODAY = {
    ("algo.tis", "none"): {},  # off: sets nothing
    ("algo.tis", "token"): {"algo.mismatch": "tis", "algo.mismatch_level": "token"},
    ("algo.tis", "sequence"): {"algo.mismatch": "tis", "algo.mismatch_level": "sequence"},
}
BASE = {"model": {"path": "m"}, "algo": {"loss": "grpo"}}


def _nested(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    return out


def _write(tmp_path, flat: dict, name="c.yaml"):
    raw = {k: dict(v) for k, v in BASE.items()}
    for section, keys in _nested(flat).items():
        raw.setdefault(section, {}).update(keys)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def _notices(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("config:")]


@pytest.fixture(autouse=True)
def _no_notice_printed_yet():
    """Each test sees the notices as a new process would (they print once per process)."""
    NOTICES_PRINTED.clear()
    yield
    NOTICES_PRINTED.clear()


def test_every_renamed_key_has_a_case_here():
    assert {old for old, _ in TODAY} == set(RENAMED)


@pytest.mark.parametrize("old, value", list(TODAY), ids=[f"{k}={v}" for k, v in TODAY])
def test_an_earlier_key_loads_as_its_new_keys_with_one_line(tmp_path, capsys, old, value):
    want = load_config(_write(tmp_path, TODAY[old, value], "new.yaml")).to_dict()
    assert _notices(capsys) == []  # today's keys: nothing to say
    from_yaml = load_config(_write(tmp_path, {old: value}, "old.yaml"))
    assert from_yaml.to_dict() == want
    (line,) = _notices(capsys)
    assert line.startswith(f"config: {old!r} is now {RENAMED[old]!r}")
    assert line.endswith("the old name will be removed")
    NOTICES_PRINTED.clear()
    from_override = load_config(_write(tmp_path, {}, "base.yaml"), [f"{old}={value}"])
    assert from_override.to_dict() == want and len(_notices(capsys)) == 1
    # in the file and again as an override: still one line for the load
    NOTICES_PRINTED.clear()
    both = load_config(_write(tmp_path, {old: value}, "old.yaml"), [f"{old}={value}"])
    assert both.to_dict() == want and len(_notices(capsys)) == 1


def test_the_notice_prints_once_per_process_however_often_the_config_loads(tmp_path, capsys):
    """`study` loads its base config once per run it plans, and used to print the notice each
    time; a different value of the key is a different notice, printed once too."""
    for _ in range(3):
        load_config(_write(tmp_path, {"algo.tis": "token"}))
        load_config(_write(tmp_path, {}), ["algo.tis=token"])
    (line,) = _notices(capsys)
    assert line == (
        "config: 'algo.tis' is now 'algo.mismatch' (algo.tis=token reads as algo.mismatch=tis, "
        "algo.mismatch_level=token); the old name will be removed"
    )
    load_config(_write(tmp_path, {"algo.tis": "sequence"}))
    load_config(_write(tmp_path, {"algo.tis": "sequence"}))
    (line,) = _notices(capsys)
    assert "(algo.tis=sequence reads as" in line


def test_the_earlier_tis_key_reaches_the_loss(tmp_path, capsys):
    """algo.tis=sequence was truncated IS per sequence: the correction the loss applies now."""
    algo = load_config(_write(tmp_path, {}), ["algo.tis=sequence", "algo.tis_cap=1.5"]).algo
    assert (algo.correction, algo.tis_cap) == (("tis", "sequence"), 1.5)
    capsys.readouterr()


# (earlier key, value, a new key, a value of it that says otherwise)
DISAGREE = [
    ("algo.tis", "token", "algo.mismatch", "mis"),
    ("algo.tis", "sequence", "algo.mismatch", "none"),
    ("algo.tis", "token", "algo.mismatch_level", "sequence"),
]


@pytest.mark.parametrize("old, value, new, other", DISAGREE)
def test_earlier_and_new_name_that_disagree_are_one_line_errors(
    tmp_path, capsys, old, value, new, other
):
    assert old in RENAMED
    with pytest.raises(UserError, match=f"'{old}' is the earlier name of") as e:
        load_config(_write(tmp_path, {old: value, new: other}))
    assert "\n" not in str(e.value) and f"{new!r}, which disagree" in str(e.value)
    with pytest.raises(UserError, match="the overrides set both") as e:
        load_config(_write(tmp_path, {}), [f"{new}={other}", f"{old}={value}"])
    assert "\n" not in str(e.value)
    capsys.readouterr()


@pytest.mark.parametrize("old, value", list(TODAY), ids=[f"{k}={v}" for k, v in TODAY])
def test_earlier_and_new_name_that_agree_load(tmp_path, capsys, old, value):
    """A config.yaml a run wrote before the rename lists both names, with the same meaning."""
    want = load_config(_write(tmp_path, TODAY[old, value], "new.yaml")).to_dict()
    both = load_config(_write(tmp_path, {old: value, **TODAY[old, value]}, "both.yaml"))
    assert both.to_dict() == want and len(_notices(capsys)) == 1
    pairs = [f"{k}={v}" for k, v in TODAY[old, value].items()]
    assert load_config(_write(tmp_path, {}), [*pairs, f"{old}={value}"]).to_dict() == want


def test_a_run_dir_config_written_before_the_rename_is_the_same_config(tmp_path, capsys):
    """Resuming compares the run's config.yaml with today's: the earlier key is not a change."""
    from megatron_gspo.train.run_dir import config_changes

    for old, value in TODAY:
        cfg = load_config(_write(tmp_path, TODAY[old, value]))
        written = cfg.to_dict()
        written.setdefault(old.split(".")[0], {})[old.split(".")[1]] = value
        assert config_changes(written, cfg) == []
        cfg_off = load_config(_write(tmp_path, {}))
        if TODAY[old, value]:  # a different setting is still a change
            assert config_changes(written, cfg_off) != []
    assert _notices(capsys) == []  # a file the trainer wrote: no notice


def test_an_override_of_either_name_replaces_the_files(tmp_path, capsys):
    """Overrides replace what the file says, whichever name either uses."""
    path = _write(tmp_path, {"algo.mismatch": "mis", "algo.mismatch_level": "sequence"})
    algo = load_config(path, ["algo.tis=token"]).algo
    assert (algo.mismatch, algo.mismatch_level) == ("tis", "token")
    algo = load_config(_write(tmp_path, {"algo.tis": "token"}), ["algo.mismatch=icepop"]).algo
    assert algo.correction == ("icepop", "token")
    capsys.readouterr()


def test_a_bad_earlier_value_names_the_earlier_key(tmp_path):
    with pytest.raises(UserError, match="algo.tis must be one of none, token, sequence, not"):
        load_config(_write(tmp_path, {}), ["algo.tis=seq"])
    with pytest.raises(UserError, match="algo.tis must be one of"):
        load_config(_write(tmp_path, {"algo.tis": "both"}))


def test_only_rank_0_prints_the_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    load_config(_write(tmp_path, {"algo.tis": "token"}))
    assert _notices(capsys) == []


def test_the_config_page_lists_the_renamed_keys():
    text = docs_gen.config_md()
    for old, new in RENAMED.items():
        assert f"| `{old}` | `{new}` |" in text
