"""Many speculators-package requests in ONE interpreter of ``.venv-speculators`` (the package imported once).

Usage (run by that virtualenv's python, never ours): ``python package_batch.py REQUEST.json RESULT.json`` with
``{"jobs": [<request as speculators_package_worker.py reads it>, ...]}``; the result is ``{"jobs": [<its result>,
...]}`` in order. Why: each worker start pays the package's import (~30 s on this machine); the conformance suite asks
it about every algorithm's export, so it loads the project's worker script once and calls its ``main`` per job.
The script is loaded from its file under another module name: the name ``speculators`` here means the package.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "speculators" / "serving" / "speculators_package_worker.py"


def main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("speculators_package_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    jobs = json.loads(Path(argv[1]).read_text())["jobs"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for index, job in enumerate(jobs):
            request, result = Path(tmp) / f"{index}.json", Path(tmp) / f"{index}-result.json"
            request.write_text(json.dumps(job))
            worker.main(["worker", str(request), str(result)])
            results.append(json.loads(result.read_text()))
    Path(argv[2]).write_text(json.dumps({"jobs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
