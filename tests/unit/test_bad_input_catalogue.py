"""Every case of the failure catalogue (tests/support/bad_input_catalogue.py) is refused in-process: exit code
2, one ``error:`` line naming the case's value, fast, and the launcher never reaches its torchrun
call (replaced here by a tripwire; this tier's conftest also refuses any process)."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.support.bad_input_catalogue import CATALOGUE, make_fixtures

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 20   # far below the 120 s a rank's communication timeout would take; generous for a loaded machine


class TorchrunStarted(AssertionError):
    """The launcher got as far as starting torchrun."""


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return make_fixtures(tmp_path_factory.mktemp("catalogue"))


def entry_point(tool: str):
    if tool == "planner":
        from planner.__main__ import main
    elif tool == "export":
        from pipedream.export import main
    else:
        from launcher.__main__ import main
    return main


@pytest.mark.parametrize("case", CATALOGUE, ids=[c.id for c in CATALOGUE])
def test_refused_before_launch(case, fixtures, monkeypatch, capsys):
    def tripwire(*args, **kwargs):
        raise TorchrunStarted(f"{case.id}: the launcher started torchrun")

    monkeypatch.setattr("launcher.__main__.run_supervised", tripwire)
    main = entry_point(case.tool)
    started = time.monotonic()
    code = main(case.args(fixtures))
    elapsed = time.monotonic() - started
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    if case.warning:   # (a dry run here: the run would start)
        assert code == 0 and err[0].startswith("warning: ") and case.expect in err[0]
    else:
        assert code == 2 and err[0].startswith("error: ") and case.expect in err[0], err
    assert elapsed < SECONDS


def test_the_catalogue_is_documented():
    doc = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", doc, flags=re.M))
    assert listed == {c.id for c in CATALOGUE}


def test_port_taken_on_node_0_is_refused(monkeypatch, capsys):
    import socket

    monkeypatch.setattr("launcher.__main__.run_supervised", lambda *a, **k: pytest.fail("torchrun started"))
    from launcher.__main__ import main
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["launcher.nnodes=2", "launcher.node_rank=0", f"launcher.master_port={port}",
                     "train.run_dir=/nonexistent-but-creatable/x"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: launcher.master_port={port} is taken") and "\n" not in err
