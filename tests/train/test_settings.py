"""Training settings: every shipped recipe builds them, and a bad value fails at settings time (before the
accelerator starts) with a message naming its key."""

from __future__ import annotations

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO_ROOT
from tests.train.conftest import compose
from train.objectives import objective_for, train_settings
from train.settings import ATTENTION_BACKENDS, SettingsError

RECIPES = sorted(path.stem for path in (REPO_ROOT / "recipes" / "recipe").glob("*.yaml"))


def recipe_overrides(recipe: str, *extra: str) -> list[str]:
    tiny = ["verifier.name_or_path=/nowhere/tiny-verifier"] if recipe.startswith("tiny") else []
    return [f"recipe={recipe}", *tiny, *extra]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_builds_its_settings(recipe):
    cfg = compose(recipe_overrides(recipe))
    settings = train_settings(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert settings.recipe_name == recipe
    assert settings.train.ttt_steps == resolved["train"]["ttt_steps"]
    assert settings.optim.lr == pytest.approx(float(resolved["optim"]["lr"]))
    assert settings.eval.k == resolved["eval"]["k"]
    assert settings.deepspeed.config == resolved["deepspeed"]["config"]
    assert objective_for(settings).topk_weight == (
        resolved["train"]["hass"]["topk_weight"] if resolved["train"]["algorithm"] == "hass" else 0.0
    )
    assert settings.resolved == resolved and settings.data == resolved["data"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("schedule.name=cosne", "schedule.name='cosne': use one of cosine, linear, constant"),
        ("optim.lr=-0.001", "optim.lr=-0.001: must be > 0"),
        ("train.ttt_steps=0", "train.ttt_steps=0: must be at least 1"),
        ("train.attention_backend=flash", "train.attention_backend='flash'"),
        (
            "train.algorithm=medusa",
            "train.algorithm='medusa': use one of dflash, dspark, eagle3, hass, peagle",
        ),
        ("train.data_mode=streaming", "train.data_mode='streaming'"),
        ("train.dtype=fp16", "fp16 needs loss scaling"),
        ("train.micro_batch_size=0", "train.micro_batch_size=0"),
        ("train.grad_accum=0", "train.grad_accum=0"),
        ("train.packing=maybe", "train.packing='maybe': expected true or false"),
        ("train.epochs=1.5", "train.epochs=1.5: expected an integer"),
        ("model.fc_init=orthogonal", "model.fc_init='orthogonal'"),
        ("model.layer_type=mistral", "model.layer_type='mistral'"),
        ("optim.name=sgd", "optim.name='sgd'"),
        ("optim.betas=[0.9]", "optim.betas=[0.9]: expected a list of 2 numbers"),
        ("schedule.warmup_ratio=1.5", "schedule.warmup_ratio=1.5: must be in [0, 1]"),
        ("logging.wandb.mode=loud", "logging.wandb.mode='loud'"),
        ("eval.max_samples=0", "eval.max_samples=0"),
        ("+train.ttt_step=5", "train: unknown key(s) ['ttt_step']"),
        ("deepspeed.enabled=true", "deepspeed.config.zero_optimization.stage"),
        ("model.draft_vocab_size=3", "train.hass.topk=4 exceeds model.draft_vocab_size=3"),  # tiny_hass: K=4
    ],
)
def test_a_bad_value_fails_at_settings_time_naming_its_key(override, key):
    with pytest.raises(SettingsError) as error:
        train_settings(compose(recipe_overrides("tiny_hass", override)))
    assert key in str(error.value)


def test_every_problem_is_listed_at_once():
    overrides = recipe_overrides("tiny_eagle3", "schedule.name=cosne", "optim.lr=0", "train.ttt_steps=0")
    with pytest.raises(SettingsError) as error:
        train_settings(compose(overrides))
    assert {p.split("=")[0] for p in error.value.problems} >= {"schedule.name", "optim.lr", "train.ttt_steps"}


def test_a_typo_fails_before_the_run_starts(tmp_path):
    # the schedule name used to be read only when the first learning rate was computed, after the accelerator,
    # the data and the draft were set up (after warmup on the 8B recipe): now nothing starts at all
    from train.trainer import train

    run_dir = tmp_path / "run"
    overrides = recipe_overrides(
        "tiny_eagle3", f"run_dir={run_dir}", "logging=disabled", "schedule.name=cosne"
    )
    with pytest.raises(ValueError, match="schedule.name='cosne'"):
        train(compose(overrides), run_dir)
    assert not run_dir.exists()


def test_defaults_are_the_recipe_groups_defaults():
    # a partial dict (scripts/gpu_check.py) falls back to these: they must be what recipes/<group>/ ships
    groups = {"model": "eagle3", "train": "eagle3", "optim": "adamw", "schedule": "cosine"}
    groups |= {"deepspeed": "none", "logging": "offline"}
    defaults = train_settings({})
    for group, name in groups.items():
        shipped = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "recipes" / group / f"{name}.yaml"))
        built = train_settings({group: drop_interpolations(shipped)})
        assert getattr(built, group) == getattr(defaults, group), group


def drop_interpolations(mapping: dict) -> dict:
    return {
        k: drop_interpolations(v) if isinstance(v, dict) else v
        for k, v in mapping.items()
        if not (isinstance(v, str) and "${" in v)
    }


def test_the_backends_are_the_attention_modules():
    from train.ttt_attention import BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS


def test_a_plain_dict_builds_settings_without_omegaconf():
    code = (
        "import sys; sys.modules['omegaconf'] = None\n"
        "from train.objectives import train_settings\n"
        "s = train_settings({'train': {'ttt_steps': 7}, 'optim': {'lr': '5e-5'}})\n"
        "assert (s.train.ttt_steps, s.eval.k, s.optim.lr) == (7, 7, 5e-5), s\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
