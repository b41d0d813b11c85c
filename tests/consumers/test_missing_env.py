"""A missing consumer virtualenv skips its tests on a developer's machine but fails them under ``CI=true``, where
`make test` has built every consumer environment: the vLLM and speculators-package checks never vanish quietly.
(Not marked ``consumer``: nothing here needs a consumer environment.)"""

from __future__ import annotations

import pytest

from speculators.serving.speculators_package import speculators_package_available
from speculators.serving.vllm_bridge import vllm_available
from speculators.serving.worker_process import missing_consumer_is_error
from tests.conftest import require_consumer


@pytest.mark.parametrize(
    "value,is_error",
    [(None, False), ("", False), ("false", False), ("0", False), ("true", True), ("TRUE", True), ("1", True)],
)
def test_ci_decides_whether_a_missing_consumer_is_an_error(value, is_error):
    environ = {} if value is None else {"CI": value}
    assert missing_consumer_is_error(environ) is is_error


@pytest.mark.parametrize(
    "env_var,available,target",
    [
        ("SPECULATORS_VLLM_PYTHON", vllm_available, "vllm-env"),
        ("SPECULATORS_PKG_PYTHON", speculators_package_available, "speculators-env"),
    ],
)
def test_missing_consumer_env_skips_locally_and_fails_under_ci(
    env_var, available, target, monkeypatch, tmp_path
):
    monkeypatch.setenv(env_var, str(tmp_path / "absent" / "bin" / "python"))
    assert not available()
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=f"make {target}"):
        require_consumer(available(), "the consumer virtualenv", target)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"make {target}.*CI is set"):
        require_consumer(available(), "the consumer virtualenv", target)
