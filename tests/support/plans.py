"""Dry-run memory plans of the recipes, each traced once per test session.

Tracing a recipe's step on the meta device takes seconds (about ten at 32k tokens), and several test modules read
the same plans (every recipe plans offline; the GPU recipes fit their hardware; the 32k recipe is linear in length).
Callers must treat a returned plan as read-only: it is shared."""

from __future__ import annotations

from functools import cache
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tests.conftest import REPO_ROOT


def resolved_recipe(recipe: str, *overrides: str) -> dict[str, Any]:
    """The composed, resolved recipe with Hydra overrides, as train/run.py sees it."""
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base=None):
        cfg = compose(config_name="config", overrides=[f"recipe={recipe}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


@cache
def recipe_plan(recipe: str, *overrides: str) -> dict[str, Any]:
    """:func:`train.memory_plan.plan_memory` of the recipe with ``overrides``, computed once per session."""
    from train.memory_plan import plan_memory

    return plan_memory(resolved_recipe(recipe, *overrides))


__all__ = ["recipe_plan", "resolved_recipe"]
