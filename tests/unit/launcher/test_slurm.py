"""SLURM without SLURM: the compressed node-list parser, the launcher's commands derived from a faked
allocation (environment variables only; no ``scontrol`` on PATH here, so the parser is used), the
emitted sbatch script, and the preemption settings. ``scontrol`` itself and running the scripts:
tests/distributed/test_slurm_launch.py."""
from __future__ import annotations

import re

import pytest

from launcher.commands import build_launch
from launcher.preempt import agent_options, job_exit_code
from launcher.sbatch import emit_script, sbatch_script
from launcher.slurm import apply_allocation, expand_nodelist, read_allocation
from pipedream.errors import ConfigError
from pipedream.config.preemption import PreemptionSpec
from pipedream.lifecycle.preemption import write_marker
from tests.support.training_harness import compose_config

DEGREES = ["parallel.pp=4", "parallel.dp=2"]


def slurm_env(tmp_path, nodes: int, node_id: int, nodelist: str, **extra: str) -> dict[str, str]:
    return {"PATH": str(tmp_path), "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NODEID": str(node_id), "SLURM_JOB_NODELIST": nodelist, **extra}


@pytest.mark.parametrize("text,hosts", [
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("node7", ["node7"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("rack[1-2]-n[009-010]", ["rack1-n009", "rack1-n010", "rack2-n009", "rack2-n010"]),
    ("x[1],y[2-3]z,w", ["x1", "y2z", "y3z", "w"]),
])
def test_compressed_nodelists_expand(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["gpu[01-03", "gpu]1[", "gpu[3-1]", "gpu[a-b]", "gpu[1-]", ""])
def test_malformed_nodelists_are_refused(text):
    with pytest.raises(ValueError):
        expand_nodelist(text)


def test_no_allocation_outside_slurm(tmp_path):
    cfg = compose_config(DEGREES)
    assert read_allocation({"PATH": str(tmp_path)}) is None
    assert apply_allocation(cfg, DEGREES, {"PATH": str(tmp_path)}) == (cfg, [])


def test_four_nodes_from_the_environment(tmp_path):
    env = slurm_env(tmp_path, 4, 2, "gpu[01-03],cpu7", SLURM_GPUS_ON_NODE="2", SLURM_NTASKS_PER_NODE="1(x4)")
    allocation = read_allocation(env)
    assert allocation.hosts == ("gpu01", "gpu02", "gpu03", "cpu7") and allocation.node_rank == 2
    assert allocation.gpus_per_node == 2 and allocation.tasks_per_node == 1
    cfg, notes = apply_allocation(compose_config(DEGREES), DEGREES, env)
    assert (cfg.launcher.nnodes, cfg.launcher.node_rank, cfg.launcher.master_addr) == (4, 2, "gpu01")
    assert "launcher.master_addr=gpu01 (the first host of SLURM_JOB_NODELIST)" in notes
    plan = build_launch(cfg, DEGREES, "runs/s")
    assert plan.world_size == 8 and plan.nproc_per_node == 2
    for node, command in enumerate(plan.commands):
        assert command[:7] == ["torchrun", "--nnodes=4", "--nproc-per-node=2", f"--node-rank={node}",
                               "--rdzv-backend=c10d", "--rdzv-endpoint=gpu01:29500", "--rdzv-id=pipedream"]
        assert command[-3:] == [*DEGREES, "train.run_dir=runs/s"]


def test_one_node_runs_standalone(tmp_path):
    cfg, _ = apply_allocation(compose_config(DEGREES), DEGREES, slurm_env(tmp_path, 1, 0, "gpu05"))
    plan = build_launch(cfg, DEGREES, "runs/s")
    assert plan.commands == [["torchrun", "--standalone", "--nproc-per-node=8", "--max-restarts=0", "-m",
                              "pipedream.train", *DEGREES, "train.run_dir=runs/s"]]


def test_command_line_keys_win(tmp_path):
    argv = [*DEGREES, "launcher.master_addr=10.1.2.3", "launcher.nnodes=2"]
    cfg, notes = apply_allocation(compose_config(argv), argv, slurm_env(tmp_path, 4, 3, "gpu[01-04]"))
    assert (cfg.launcher.nnodes, cfg.launcher.node_rank, cfg.launcher.master_addr) == (2, 3, "10.1.2.3")
    assert "launcher.master_addr=10.1.2.3 (command line; SLURM says gpu01)" in notes


def test_outside_a_step_every_node_is_printed(tmp_path, monkeypatch, capsys):
    from launcher.__main__ import main
    env = slurm_env(tmp_path, 2, 0, "n[1-2]")
    del env["SLURM_NODEID"]   # an salloc shell on the login node
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(DEGREES) == 0
    out = capsys.readouterr().out
    assert "# slurm: job 4242 on 2 node(s): n1 n2" in out
    assert out.count("--rdzv-endpoint=n1:29500") == 2 and "# node 1" in out


def test_more_processes_than_gpus_is_refused(tmp_path):
    argv = [*DEGREES, "cluster=h100_x8"]
    env = slurm_env(tmp_path, 2, 0, "g[1-2]", SLURM_GPUS_ON_NODE="2")
    with pytest.raises(ConfigError, match="needs 4 processes per node .* SLURM gave this node 2 GPU"):
        apply_allocation(compose_config(argv), argv, env)


@pytest.mark.parametrize("env,match", [
    ({"SLURM_JOB_NUM_NODES": "3"}, "names 2 hosts"),
    ({"SLURM_NODEID": "5"}, "SLURM_NODEID=5 is not below"),
    ({"SLURM_GPUS_ON_NODE": "lots"}, "SLURM_GPUS_ON_NODE=lots is not a SLURM count"),
    ({"SLURM_JOB_NODELIST": "g[1-2"}, "cannot be read"),
])
def test_inconsistent_allocations_are_refused(tmp_path, env, match):
    with pytest.raises(ConfigError, match=match):
        read_allocation({**slurm_env(tmp_path, 2, 0, "g[1-2]"), **env})


def sbatch_layout(text: str) -> tuple[int, int | None, int]:
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", text, re.M).group(1))
    gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)$", text, re.M)
    world = int(re.search(r"^# world size (\d+) = ", text, re.M).group(1))
    return nodes, int(gpus.group(1)) if gpus else None, world


@pytest.mark.parametrize("argv,layout", [
    (["cluster=h100_x8", "parallel.pp=4", "parallel.dp=4"], (2, 8, 16)),
    (["cluster=h100_x8", "parallel.pp=4", "parallel.dp=4", "launcher.nnodes=4"], (4, 4, 16)),
    (["cluster=h100_x8", "parallel.pp=2"], (1, 2, 2)),
    (["parallel.pp=2", "parallel.dp=2"], (2, None, 4)),     # local_cpu: 2 devices per node, no GPUs
])
def test_emitted_sbatch_names_the_config_world_size(argv, layout):
    cfg = compose_config(argv)
    text = sbatch_script(cfg, argv, build_launch(cfg, [], "x").world_size)
    assert sbatch_layout(text) == layout
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --requeue" in text
    assert "#SBATCH --signal=USR1@300" in text and '[ "$status" -eq 75 ]' in text
    srun = text[text.index("srun "):]
    assert all(arg in srun for arg in argv if not arg.startswith("launcher.")) and "launcher.nnodes" not in srun
    assert '"train.run_dir=${run_dir}" train.resume=auto "$@"' in srun


def test_emit_refuses_what_it_cannot_write():
    cfg = compose_config(["parallel.pp=3", "cluster=h100_x8", "launcher.nnodes=2", "launcher.emit=pbs"])
    with pytest.raises(ConfigError, match="launcher.emit=pbs is not a script"):
        emit_script(cfg, [], 3)
    with pytest.raises(ConfigError, match="3 processes, which 2 node"):
        sbatch_script(cfg, ["launcher.nnodes=2"], 3)


def test_preemption_settings():
    spec = PreemptionSpec.from_config(compose_config([]))
    assert (spec.signal_name, spec.requeue_exit_code) == ("USR1", 75)
    assert agent_options(spec) == ["--ignore-signal=USR1"]
    off = PreemptionSpec.from_config(compose_config(["preemption.signal=null"]))
    assert off.signal is None and agent_options(off) == []
    assert PreemptionSpec.from_config(compose_config(["preemption.signal=SIGUSR2"])).signal_name == "USR2"
    for bad, match in [("preemption.signal=TERM", "not a preemption signal"),
                       ("preemption.requeue_exit_code=1", "from 3 to 125"),
                       ("preemption.signal_before_s=0", "positive number of seconds")]:
        with pytest.raises(ConfigError, match=match):
            PreemptionSpec.from_config(compose_config([bad]))


def test_a_preempted_run_exits_with_the_requeue_code(tmp_path, capsys):
    spec = PreemptionSpec.from_config(compose_config([]))
    assert job_exit_code(0, tmp_path, spec) == 0
    write_marker(tmp_path, {"step": 7, "signal": "USR1", "checkpoint": "c"})
    assert job_exit_code(0, tmp_path, spec) == 75
    assert "stopped for preemption after step 7" in capsys.readouterr().err
    assert job_exit_code(1, tmp_path, spec) == 1    # a failure stays a failure
    off = PreemptionSpec.from_config(compose_config(["preemption.signal=null"]))
    assert job_exit_code(0, tmp_path, off) == 0


def test_several_tasks_per_node_draw_a_warning(tmp_path, capsys):
    apply_allocation(compose_config(DEGREES), DEGREES, slurm_env(tmp_path, 2, 0, "n[1-2]", SLURM_NTASKS_PER_NODE="4"))
    assert "SLURM_NTASKS_PER_NODE=4" in capsys.readouterr().err
    apply_allocation(compose_config(DEGREES), DEGREES, slurm_env(tmp_path, 2, 0, "n[1-2]", SLURM_NTASKS_PER_NODE="1"))
    assert capsys.readouterr().err == ""
