"""SUMMARY.md is generated from the result files and from nothing else (issue 21): the committed summary must be
exactly what ``bench/summary.py`` renders from the committed JSON, and every figure in it must move when its JSON
does."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.summary import RESULTS, SUMMARY_NAME, machine_line, render, write


def test_committed_summary_is_what_the_results_render():
    committed = (RESULTS / SUMMARY_NAME).read_text()
    assert committed == render(RESULTS), (
        "bench/results/SUMMARY.md is stale or hand-edited: run bench/summary.py"
    )


def test_a_figure_changed_in_a_result_file_changes_the_summary(tmp_path):
    shutil.copytree(RESULTS, tmp_path, dirs_exist_ok=True)
    before = render(tmp_path)
    result = json.loads((tmp_path / "engine.json").read_text())
    result["runs"][0]["speculative_tokens_per_s"] = 123456.7
    (tmp_path / "engine.json").write_text(json.dumps(result))
    after = render(tmp_path)
    assert "123456.7 vs" in after and "123456.7 vs" not in before
    assert write(tmp_path).read_text() == after


def test_each_section_names_its_own_machine_and_a_new_result_file_gets_a_section(tmp_path):
    (tmp_path / "a.json").write_text(
        json.dumps(
            {
                "command": ".venv/bin/python bench/a.py",
                "machine": {"cpu_model": "AMD EPYC", "cpus": 2, "native_bf16": ["avx512_bf16"]},
                "summary": {"tokens_per_s": 42.5},
            }
        )
    )
    (tmp_path / "b.json").write_text(json.dumps({"machine": {"cpu_model": "Intel Xeon", "native_bf16": []}}))
    (tmp_path / "c.json").write_text(json.dumps({"tokens_per_s": 1.0}))
    text = render(tmp_path)
    sections = {block.split("\n", 1)[0]: block for block in text.split("\n## ")[1:]}
    assert set(sections) == {"a", "b", "c"}
    assert "AMD EPYC" in sections["a"] and "native bf16: avx512_bf16" in sections["a"]
    assert "tokens_per_s: 42.5" in sections["a"] and "`.venv/bin/python bench/a.py`" in sections["a"]
    assert "Intel Xeon" in sections["b"] and "native bf16: none" in sections["b"]
    assert "not recorded" in sections["c"]


def test_every_bench_renders_its_own_result_files():
    """summary.py knows no bench: each bench module lists the result files it writes and renders their sections,
    and no two benches claim the same file."""
    from bench import BENCHES, bench_modules

    stems = [stem for module in bench_modules() for stem in module.RESULTS]
    assert len(stems) == len(set(stems))
    for name, module in zip(BENCHES, bench_modules(), strict=True):
        assert callable(module.run) and callable(module.render), name
    committed = {p.stem for p in RESULTS.glob("*.json") if not p.stem.endswith("_curve")}
    assert committed <= set(stems), f"result files no bench renders: {sorted(committed - set(stems))}"


def test_a_machine_without_cpu_model_says_so():
    assert "not recorded" in machine_line({"machine": {"platform": "Linux", "cpus": 2}})


def test_the_peer_trainers_parallel_drafters_reach_the_summary(tmp_path):
    """acceptance_bench's summary of a sweep with the peer trainer's P-EAGLE and DFlash: their rows in every table
    (summary.greedy_acceptance_length.peer_peagle.k<k> ...), the ours-vs-peer goals, and SUMMARY.md's rows."""
    from bench import acceptance_bench

    al = {"eagle3": 1.4, "peagle": 1.3, "peer_peagle": 1.2, "dflash": 1.1, "peer_dflash": 1.25, "ngram": 1.2}
    ks = {name: [1, 2, 3, 4] if name != "eagle3" else [1, 2, 3] for name in al}

    def record(value: float) -> dict:
        return {
            "batched": {
                "acceptance_length": value,
                "tokens_per_verify_step": value,
                "tokens_per_s": 10 * value,
            },
            "batch1": {"tokens_per_s": 5 * value},
        }

    sweep = {f"{name}/k{k}": record(al[name] + k / 100) for name in al for k in ks[name]}
    sweep["plain"] = {"runs": [{"batched": {"tokens_per_s": 10.0}, "batch1": {"tokens_per_s": 5.0}}]}
    summary = acceptance_bench.summarize(sweep, ks, [n for n in al if n != "ngram"], {})
    assert summary["greedy_acceptance_length"]["peer_peagle"]["k4"] == pytest.approx(1.24)
    assert summary["tokens_per_step"]["peer_dflash"]["k2"] == pytest.approx(1.27)
    assert summary["speedup_c1"]["peer_dflash"]["k4"] == pytest.approx(1.29)
    goals = summary["goals"]
    assert (
        goals["peagle_al_k4_ours_vs_peer"] == pytest.approx([1.34, 1.24])
        and goals["peagle_at_least_peer"] is True
    )
    assert (
        goals["dflash_al_k4_ours_vs_peer"] == pytest.approx([1.14, 1.29])
        and goals["dflash_at_least_peer"] is False
    )
    (tmp_path / "acceptance.json").write_text(json.dumps({"mode": "full", "summary": summary}))
    text = render(tmp_path)
    assert "| peer_peagle | 1.21 | 1.22 | 1.23 | 1.24 |" in text
    assert "| peer_dflash | 1.26 | 1.27 | 1.28 | 1.29 |" in text
    assert "goal dflash_at_least_peer: False" in text
