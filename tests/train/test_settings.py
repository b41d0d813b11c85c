"""Training settings: every shipped recipe builds them, and a bad value fails at settings time (before the
accelerator starts) with a message naming its key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from tests.conftest import REPO_ROOT
from tests.train.conftest import compose
from train.objectives import algorithms, objective_class, objective_for, train_settings
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
    assert objective_for(settings).topk_weight == (resolved.get("hass") or {}).get("topk_weight", 0.0)
    assert settings.resolved == resolved and settings.data == resolved["data"]
    # the algorithm's own groups, exactly as the recipe has them, and none of another algorithm's
    declared = objective_class(settings.train.algorithm).groups
    assert set(settings.objective) == set(declared)
    for key, group in settings.objective.items():
        assert type(group) is declared[key] and dataclasses.asdict(group) == resolved[key], key
    foreign = {key for name in algorithms() for key in objective_class(name).groups} - set(declared)
    assert not foreign & set(resolved), foreign & set(resolved)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("schedule.name=cosne", "schedule.name='cosne': use one of cosine, linear, constant"),
        ("optim.lr=-0.001", "optim.lr=-0.001: must be > 0"),
        ("train.ttt_steps=0", "train.ttt_steps=0: must be at least 1"),
        ("train.attention_backend=flash", "train.attention_backend='flash'"),
        (
            "train.algorithm=medusa",
            "train.algorithm='medusa': use one of dflash, ",  # the registry's names, sorted
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
        ("model.draft_vocab_size=3", "hass.topk=4 exceeds model.draft_vocab_size=3"),  # tiny_hass: K=4
        ("hass.topk=0", "hass.topk=0: must be at least 1"),
        ("hass.topk_weight=-1", "hass.topk_weight=-1.0: must be at least 0"),
        ("+hass.top_k=3", "hass: unknown key(s) ['top_k']"),
        ("hass.detach_context=1", "hass.detach_context=1: expected true or false"),
    ],
)
def test_a_bad_value_fails_at_settings_time_naming_its_key(override, key):
    with pytest.raises(SettingsError) as error:
        train_settings(compose(recipe_overrides("tiny_hass", override)))
    assert key in str(error.value)


@pytest.mark.parametrize(
    ("recipe", "extra", "flags"),
    [
        ("tiny_eagle3", (), (False, False)),
        ("tiny_eagle31", (), (True, True)),
        ("tiny_eagle3", ("train.algorithm=eagle31",), (True, True)),
        ("tiny_eagle3", ("model.norm_before_fc=true",), (True, False)),
        ("tiny_hass", (), (False, False)),
    ],
)
def test_the_norm_flags_are_the_recipes_else_what_the_algorithm_declares(recipe, extra, flags):
    """EAGLE-3.1 (train.algorithm=eagle31) builds EAGLE-3's draft with norm_before_fc and norm_output on, as its
    unit variant declares; model.norm_* left null follow the algorithm, a set one is the recipe's."""
    from train.assemble import recipe_draft_config

    settings = train_settings(compose(recipe_overrides(recipe, *extra)))
    verifier = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8}
    verifier |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512, "rms_norm_eps": 1e-5}
    config = recipe_draft_config(settings, verifier, [2, 4, 5], 256, "tiny")
    assert (config.norm_before_fc, config.norm_output) == flags


@pytest.mark.parametrize(
    ("recipe", "override", "key"),
    [
        ("tiny_dflash", "block.block_size=1", "block.block_size=1: must be at least 2"),
        ("tiny_dflash", "block.max_anchors=0", "block.max_anchors=0: must be at least 1"),
        ("tiny_dflash", "block.position_weighting=linear", "block.position_weighting='linear'"),
        ("tiny_dflash", "block.dpace_alpha=0", "block.dpace_alpha=0.0 in (0, 1]"),
        ("tiny_dflash", "block.block_causal=maybe", "block.block_causal='maybe': expected true or false"),
        ("tiny_dspark", "dspark.markov_rank=0", "dspark.markov_rank=0: must be at least 1"),
        ("tiny_dflash2", "dflash2.selector_top_k=0", "dflash2.selector_top_k=0: must be at least 1"),
        ("tiny_dflash2", "dflash2.selector_weight=-0.5", "dflash2.selector_weight=-0.5: must be at least 0"),
        ("tiny_peagle", "peagle.max_anchors=0", "peagle.max_anchors=0: must be at least 1"),
    ],
)
def test_an_objective_groups_bad_value_names_its_full_key(recipe, override, key):
    with pytest.raises(SettingsError) as error:
        train_settings(compose(recipe_overrides(recipe, override)))
    assert key in str(error.value)


@pytest.mark.parametrize(
    ("recipe", "override", "message"),
    [
        (
            "tiny_eagle3",
            "+block.block_size=4",
            "block: train.algorithm=eagle3 does not read the block group, so block.block_size would be ignored "
            "(read by dflash, dflash2, dspark, lilicorr)",
        ),
        (
            "tiny_dflash",
            "+hass.topk=4",
            "hass: train.algorithm=dflash does not read the hass group, so hass.topk would be ignored (read by hass)",
        ),
        (
            "tiny_dflash",
            "+dspark.markov_rank=8",
            "dspark: train.algorithm=dflash does not read the dspark group",
        ),
        (
            "tiny_dspark",
            "train.algorithm=dflash",
            "dspark: train.algorithm=dflash does not read the dspark group",
        ),
        (
            "tiny_dflash",
            "+model.block_causal=false",
            "model: unknown key(s) ['block_causal']",
        ),  # moved to block
        ("tiny_dflash", "+train.anchor_chunk=4", "train: unknown key(s) ['anchor_chunk']"),
    ],
)
def test_a_group_or_key_the_algorithm_does_not_read_is_refused_naming_it(recipe, override, message):
    """A block drafter's knob in an EAGLE-3 recipe would otherwise be silently ignored."""
    with pytest.raises(SettingsError) as error:
        train_settings(compose(recipe_overrides(recipe, override)))
    assert message in str(error.value)


@pytest.mark.parametrize("algorithm", algorithms())
def test_every_objective_group_builds_from_its_recipe_defaults(algorithm):
    """Each declared group's recipes/<group>/default.yaml builds the group (no unknown key, no problem) and equals
    the dataclass's defaults, which a partial plain dict falls back to."""
    base = {
        "train": {"algorithm": algorithm},
        "model": {"draft_vocab_size": None},
    }  # what every algorithm takes
    for key, group in objective_class(algorithm).groups.items():
        shipped = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "recipes" / key / "default.yaml"))
        built = train_settings({**base, key: shipped}).group(key)
        assert built == group() == train_settings(base).group(key), key


def test_eagle31_with_a_norm_flag_off_is_refused_naming_both():
    with pytest.raises(SettingsError) as error:
        train_settings(compose(recipe_overrides("tiny_eagle31", "model.norm_output=false")))
    assert (
        "model.norm_output=false with train.algorithm=eagle31: EAGLE-3.1 is EAGLE-3 with norm_output=true"
        in str(error.value)
    )


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
