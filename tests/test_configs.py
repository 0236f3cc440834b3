"""The named run configs in configs/: each one validates, and those that write out a preset match it."""

from pathlib import Path

import pytest

from flashdraft.config import resolve_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"smollm2_h200", "qwen3_8b_h200", "tiny_cpu"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_and_says_what_it_measured(path):
    resolve_config("default", path)
    head = path.read_text().splitlines()[0]
    assert head.startswith("# "), f"{path.name} starts with a comment saying what it is"


@pytest.mark.parametrize("preset", ["qwen3_8b_h200", "tiny_cpu"])
def test_config_matches_the_preset_it_writes_out(preset):
    path = next(p for p in CONFIGS if p.stem == preset)
    assert resolve_config("default", path) == resolve_config(preset)
