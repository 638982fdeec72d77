"""The launch scripts and the launcher inside a faked SLURM job: environment variables plus stand-in
``scontrol``, ``srun``, ``nvidia-smi`` and ``torchrun`` executables on PATH that record how they
were called. Checks the torchrun command lines derived for 1 and 4 nodes, that the emitted sbatch
script is valid bash and starts a job of the config's world size, and that the batch script
requeues the job exactly when the launcher exits with the requeue code."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "launch"
DEGREES = ["parallel.pp=4", "parallel.dp=2"]


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    """An executable ``name`` on PATH; it appends its arguments to ``<bin_dir>/<name>.calls``."""
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text(f'#!/bin/bash\necho "$*" >> "{bin_dir}/{name}.calls"\n{body}\n')
    path.chmod(0o755)


def calls(bin_dir: Path, name: str) -> list[str]:
    log = bin_dir / f"{name}.calls"
    return log.read_text().splitlines() if log.exists() else []


def slurm_env(bin_dir: Path, nodes: int, node_id: int, nodelist: str, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "SLURM_JOB_ID": "777",
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODEID": str(node_id), "SLURM_JOB_NODELIST": nodelist,
            "PYTHON": sys.executable, **extra}


def launcher(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def torchrun_lines(out: str) -> list[list[str]]:
    return [shlex.split(line) for line in out.splitlines() if line.startswith("torchrun ")]


def test_four_nodes_use_scontrol_for_the_host_list(tmp_path):
    bin_dir = tmp_path / "bin"
    # a site whose scontrol knows names the fallback parser could not guess
    stand_in(bin_dir, "scontrol", 'printf "head-a\\nnode-b\\nnode-c\\nnode-d\\n"')
    env = slurm_env(bin_dir, 4, 3, "site[1-4]", SLURM_GPUS_ON_NODE="2")
    done = launcher([*DEGREES, "launcher.dry_run=true", "train.run_dir=runs/s"], env)
    assert done.returncode == 0, done.stderr
    assert calls(bin_dir, "scontrol") == ["show hostnames site[1-4]"]
    assert "# launcher.node_rank=3 (SLURM_NODEID)" in done.stdout
    commands = torchrun_lines(done.stdout)
    assert len(commands) == 4
    for node, command in enumerate(commands):
        assert command[1:7] == ["--nnodes=4", "--nproc-per-node=2", f"--node-rank={node}", "--rdzv-backend=c10d",
                                "--rdzv-endpoint=head-a:29500", "--rdzv-id=pipedream"]
        assert command[-3:] == [*DEGREES, "train.run_dir=runs/s"]


def test_one_node_and_a_failing_scontrol_fall_back_to_the_parser(tmp_path):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "scontrol", "exit 1")
    done = launcher([*DEGREES, "launcher.dry_run=true", "train.run_dir=runs/s"],
                    slurm_env(bin_dir, 1, 0, "gpu[07]"))
    assert done.returncode == 0, done.stderr
    assert len(calls(bin_dir, "scontrol")) == 1 and "launcher.master_addr=gpu07" in done.stdout
    assert torchrun_lines(done.stdout) == [["torchrun", "--standalone", "--nproc-per-node=8", "--max-restarts=0",
                                            "-m", "pipedream.train", *DEGREES, "train.run_dir=runs/s"]]


def test_emitted_sbatch_is_valid_bash_and_starts_the_configs_world_size(tmp_path):
    config = ["cluster=h100_x8", "model=gpt_small", "parallel.pp=4", "parallel.dp=4", "parallel.tp=2"]
    emitted = launcher([*config, "launcher.emit=slurm"], {**os.environ, "PATH": os.environ["PATH"]})
    assert emitted.returncode == 0, emitted.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(emitted.stdout)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)$", emitted.stdout, re.M).group(1))
    gpus = int(re.search(r"^#SBATCH --gpus-per-node=(\d+)$", emitted.stdout, re.M).group(1))
    assert (nodes, gpus) == (4, 8) and "# world size 32 = 4 node(s) x 8" in emitted.stdout

    # run it as SLURM would on node 2 of 4, with srun running its command here, as a dry run
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "srun", 'while [[ "$1" == --* ]]; do shift; done; exec "$@"')
    stand_in(bin_dir, "scontrol", 'echo "$3" | tr , "\\n"')
    env = slurm_env(bin_dir, nodes, 2, "g1,g2,g3,g4", SLURM_GPUS_ON_NODE=str(gpus))
    done = subprocess.run(["bash", str(script), "launcher.dry_run=true"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    commands = torchrun_lines(done.stdout)
    assert len(commands) == nodes
    for command in commands:
        assert "--nnodes=4" in command and "--nproc-per-node=8" in command and "--rdzv-endpoint=g1:29500" in command
        assert "train.run_dir=runs/slurm-777" in command and "train.resume=auto" in command
        assert all(arg in command for arg in config)
    assert calls(bin_dir, "scontrol") == ["show hostnames g1,g2,g3,g4"]   # no requeue: the launcher exited 0


@pytest.mark.parametrize("script", ["slurm.sbatch", "emitted"])
@pytest.mark.parametrize("code,requeued", [(75, True), (0, False), (1, False)])
def test_batch_script_requeues_on_the_requeue_exit_code(tmp_path, script, code, requeued):
    if script == "emitted":
        text = launcher(["launcher.emit=slurm", "parallel.pp=2"], dict(os.environ)).stdout
        path = tmp_path / "job.sbatch"
        path.write_text(text)
    else:
        path = SCRIPTS / script
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "srun", f"exit {code}")
    stand_in(bin_dir, "scontrol", "exit 0")
    done = subprocess.run(["bash", str(path), "model=gpt_small", "train.steps=9"], cwd=tmp_path,
                          env=slurm_env(bin_dir, 2, 0, "n[1-2]"), capture_output=True, text=True, timeout=60)
    (srun,) = calls(bin_dir, "srun")
    assert srun.startswith("--ntasks-per-node=1 ") and " -m launcher " in srun
    assert srun.endswith("train.run_dir=runs/slurm-777 train.resume=auto model=gpt_small train.steps=9")
    assert calls(bin_dir, "scontrol") == (["requeue 777"] if requeued else [])
    assert done.returncode == (0 if requeued else code)


def test_sbatch_header_asks_for_requeue_and_an_early_signal():
    text = (SCRIPTS / "slurm.sbatch").read_text()
    for line in ("#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --signal=USR1@300"):
        assert line in text


def test_one_server_starts_a_process_per_gpu(tmp_path):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "nvidia-smi", 'printf "GPU 0: H100\\nGPU 1: H100\\nGPU 2: H100\\n"')
    stand_in(bin_dir, "torchrun", "exit 0")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(SCRIPTS / "one_server.sh"), "parallel.pp=3", "train.steps=5"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert calls(bin_dir, "torchrun") == ["--standalone --nproc-per-node=3 -m pipedream.train parallel.pp=3 "
                                          "train.steps=5"]


def test_servers_join_one_rendezvous(tmp_path):
    bin_dir = tmp_path / "bin"
    stand_in(bin_dir, "torchrun", "exit 0")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "NNODES": "2", "NODE_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "RUN_DIR": "runs/big", "NPROC": "4"}
    done = subprocess.run(["bash", str(SCRIPTS / "servers.sh"), "parallel.pp=8"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert calls(bin_dir, "torchrun") == ["--nnodes=2 --node-rank=1 --nproc-per-node=4 --rdzv-backend=c10d "
                                          "--rdzv-endpoint=10.0.0.1:29500 --rdzv-id=pipedream -m pipedream.train "
                                          "train.run_dir=runs/big parallel.pp=8"]
    del env["MASTER_ADDR"]
    done = subprocess.run(["bash", str(SCRIPTS / "servers.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "set MASTER_ADDR" in done.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.iterdir()))
def test_launch_scripts_are_valid_bash(script):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_slurm_and_preemption_modules_import_no_torch():
    script = ("import sys; sys.modules['torch'] = None\n"   # any 'import torch' now raises ImportError
              "import pipedream.lifecycle.preemption, launcher.slurm, launcher.sbatch, launcher.preempt, launcher.supervise")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
