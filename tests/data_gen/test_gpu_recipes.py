"""The 8B recipes regenerate through vLLM (as their headers and the README say), with hours of barrier timeout."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from data_gen.pipeline import GenSettings, regenerates_first
from tests.conftest import REPO_ROOT


@pytest.mark.parametrize(
    "recipe", ["eagle3_llama8b", "eagle3_qwen3_8b", "hass_llama8b", "hass_llama8b_stage2", "eagle31_llama8b"]
)
def test_8b_recipes_regenerate_with_vllm_first(recipe):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"recipe={recipe}"])
    gen = GenSettings.from_mapping(OmegaConf.to_container(cfg, resolve=True)["data_gen"])
    assert gen.regenerate.enabled and gen.regenerate.backend == "vllm"
    assert regenerates_first(
        gen.regenerate
    )  # the vLLM worker owns the GPU before the HF verifier loads there
    assert gen.barrier_timeout_hours >= 12
