from __future__ import annotations

from launcher.commands import build_launch
from tests.support.training_harness import compose_config


def test_single_node_command():
    cfg = compose_config(["parallel.pp=2", "parallel.dp=2"])
    plan = build_launch(cfg, ["parallel.pp=2", "parallel.dp=2"], "runs/x")
    assert plan.world_size == 4 and plan.nnodes == 1
    assert plan.commands == [["torchrun", "--standalone", "--nproc-per-node=4", "--max-restarts=0", "-m",
                              "pipedream.train", "parallel.pp=2", "parallel.dp=2", "train.run_dir=runs/x"]]


def test_two_node_commands_share_a_rendezvous():
    overrides = ["parallel.pp=2", "parallel.dp=2", "launcher.nnodes=2", "launcher.master_addr=10.0.0.1",
                 "launcher.master_port=1234", "launcher.max_restarts=3"]
    cfg = compose_config(overrides)
    plan = build_launch(cfg, [o for o in overrides if not o.startswith("launcher.")], "runs/y")
    assert plan.nproc_per_node == 2 and len(plan.commands) == 2
    for node, command in enumerate(plan.commands):
        assert command[:9] == ["torchrun", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={node}",
                               "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:1234", "--rdzv-id=pipedream",
                               "--rdzv-conf=join_timeout=300",
                               "--max-restarts=3"]
        assert command[-1] == "train.run_dir=runs/y"


def test_dry_run_prints_every_node(capsys):
    from launcher.__main__ import main
    assert main(["launcher.nnodes=2", "parallel.pp=2", "parallel.dp=1"]) == 0
    out = capsys.readouterr().out
    assert "# node 0" in out and "# node 1" in out and out.count("torchrun") == 2


def test_elastic_commands_span_min_to_max_nodes_and_tell_the_ranks():
    overrides = ["parallel.pp=2", "launcher.nnodes=2", "launcher.min_nodes=1", "launcher.master_port=1234",
                 "launcher.rendezvous_timeout_s=60"]
    cfg = compose_config(overrides)
    plan = build_launch(cfg, [o for o in overrides if not o.startswith("launcher.")], "runs/e")
    for command in plan.commands:
        assert command[1] == "--nnodes=1:2"
        assert ("--rdzv-conf=join_timeout=60,last_call_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
                in command)
        assert command[-3:] == ["launcher.nnodes=2", "launcher.min_nodes=1", "train.run_dir=runs/e"]
