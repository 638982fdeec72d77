"""launcher.bind_cores: with ``auto`` two CPU ranks run on disjoint core sets (single cores on a
2-core machine), each with one intra-op thread per core, as every rank's summary reports; an
explicit bad list is refused in one line before anything launches."""
from __future__ import annotations

import json
import os

import pytest

from pipedream.runtime.affinity import even_sets
from tests.support.processes import run_cli

MLP = ["model=mlp", "data=synthetic", "model.num_layers=2", "model.hidden_size=8", "train.global_batch_size=4",
       "train.micro_batch_size=2", "parallel.pp=2", "train.steps=2", "train.eval_every=0", "train.progress=false",
       "trace.enabled=false", "launcher.check_memory=false"]


@pytest.mark.slow
def test_auto_binds_each_rank_to_its_own_cores(tmp_path):
    done = run_cli("launcher", [*MLP, "launcher.bind_cores=auto", f"train.run_dir={tmp_path}/run"], tmp_path)
    assert done.code == 0, done.stderr_lines
    ranks = sorted(json.loads((tmp_path / "run" / "summary.json").read_text())["ranks"], key=lambda r: r["rank"])
    expected = [list(s) for s in even_sets(sorted(os.sched_getaffinity(0)), 2)]   # [[0], [1]] on 2 cores
    assert [r["cpu_affinity"] for r in ranks] == expected
    assert not set(expected[0]) & set(expected[1])
    assert [r["intra_op_threads"] for r in ranks] == [len(s) for s in expected]
    assert "cores per local rank " + " ".join(f"[{','.join(map(str, s))}]" for s in expected) in done.stdout


@pytest.mark.slow
def test_a_bad_core_list_is_refused_before_launch(tmp_path):
    done = run_cli("launcher", [*MLP, "launcher.bind_cores=[[0],[0]]", f"train.run_dir={tmp_path}/run"], tmp_path)
    assert done.code == 2
    assert done.stderr_lines == ["error: launcher.bind_cores=[[0], [0]]: core 0 is in two sets: give each local "
                                 "rank cores of its own"]
    assert "launch:" not in done.stdout and not (tmp_path / "run").exists()
