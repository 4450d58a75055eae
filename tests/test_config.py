"""Config: defaults, presets, TOML, dotted overrides, types and errors."""

import pytest

from lab.commands.cli import run_main
from lab.runtime.config import ConfigError, RunConfig, build_parser, config_from_args, resolve


def parse(argv):
    return config_from_args(build_parser("t", "t").parse_args(argv))


def test_dotted_overrides_and_scientific_integers():
    cfg = parse(["--model.d_model", "256", "--train.tokens", "2e6", "--train.compile", "true", "--strategy", "single"])
    assert cfg.model.d_model == 256 and cfg.train.tokens == 2_000_000 and cfg.train.compile is True
    assert cfg.parallel.strategy == "single"


def test_preset_then_toml_then_command_line(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[model]\npreset = "small"\nn_layer = 3\n[train]\nlr = 1e-3\n')
    cfg = parse(["--config", str(f), "--train.lr", "5e-4"])
    assert (cfg.model.d_model, cfg.model.n_head) == (384, 6)  # from the preset
    assert cfg.model.n_layer == 3  # TOML over preset
    assert cfg.train.lr == 5e-4  # command line over TOML


def test_optional_fields_accept_none():
    cfg = parse(["--model.n_kv_head", "2", "--model.d_ff", "none"])
    assert cfg.model.n_kv_head == 2 and cfg.model.d_ff is None


def test_round_trip_through_dict():
    cfg = parse(["--model.preset", "tiny-modern", "--train.seed", "7"])
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("tree, message", [
    ({"model": {"preset": "gpt5"}}, "unknown model preset 'gpt5'"),
    ({"model": {"width": 3}}, "unknown option 'model.width'"),
    ({"optim": {"lr": 3}}, "unknown section 'optim'"),
    ({"train": {"tokens": 1.5}}, "train.tokens: expected int"),
    ({"train": {"compile": "maybe"}}, "train.compile: expected bool"),
    ({"model": {"d_model": None}}, "model.d_model cannot be empty"),
])
def test_bad_values_raise_one_line_errors(tree, message):
    with pytest.raises(ConfigError, match=message) as e:
        resolve(tree)
    assert "\n" not in str(e.value)


def test_missing_and_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        parse(["--config", str(tmp_path / "nope.toml")])
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse(["--config", str(bad)])


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:  # what `python launch/run.py --help` prints: the script is run_main
        run_main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    for option in ("--model.d_model", "--train.tokens", "--data.corpus", "--parallel.strategy", "--strategy",
                   "--resume", "--run-dir", "--config"):
        assert option in out
