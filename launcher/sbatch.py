"""``python -m launcher launcher.emit=slurm ...``: an sbatch script that runs this config on a SLURM
cluster. Nodes x processes per node come from the config's world size (the plan or the degrees) and
``cluster.devices_per_node`` (or ``launcher.nnodes``). Inside the job, ``srun`` starts the launcher
once per node, which reads the allocation (``launcher/slurm.py``) and runs torchrun with the first node
as the rendezvous host; a preempted run exits with ``preemption.requeue_exit_code`` and the script
requeues the job, which resumes (``train.resume=auto`` in a run directory named after the job)."""
from __future__ import annotations

import math
import shlex
from typing import Any

from pipedream.errors import ConfigError
from pipedream.config.preemption import PreemptionSpec

from launcher.slurm import explicit_launcher_keys

# set by the script (run dir, resume) or derived from SLURM inside the job
NOT_PASSED = ("launcher.nnodes", "launcher.node_rank", "launcher.master_addr", "launcher.dry_run", "launcher.emit",
              "train.run_dir", "train.resume")


def node_layout(cfg: Any, argv: list[str], world: int) -> tuple[int, int]:
    """(nodes, processes per node) for ``world`` processes."""
    if "nnodes" in explicit_launcher_keys(argv):
        nnodes = int(cfg.launcher.nnodes)
    else:
        per_node = int(cfg.cluster.devices_per_node)
        if per_node < 1:
            raise ConfigError(f"cluster.devices_per_node={per_node} must be >= 1: set the GPUs of one node")
        nnodes = math.ceil(world / per_node)
    if nnodes < 1 or world % nnodes:
        raise ConfigError(f"the job needs {world} processes, which {nnodes} node(s) cannot share evenly: "
                          f"set launcher.nnodes to a divisor of {world}")
    return nnodes, world // nnodes


def passed_overrides(argv: list[str]) -> list[str]:
    return [arg for arg in argv if arg.lstrip("+").partition("=")[0] not in NOT_PASSED]


def sbatch_script(cfg: Any, argv: list[str], world: int) -> str:
    nnodes, per_node = node_layout(cfg, argv, world)
    preemption = PreemptionSpec.from_config(cfg)
    gpus = str(cfg.cluster.device) != "cpu"
    overrides = " ".join(shlex.quote(arg) for arg in passed_overrides(argv))
    lines = [
        "#!/bin/bash",
        f"# Written by: python -m launcher {shlex.join(argv)}",
        f"# world size {world} = {nnodes} node(s) x {per_node} process(es) per node",
        "# Submit: sbatch --time=HH:MM:SS [--partition=... --account=...] THIS_FILE [more hydra overrides]",
        "#SBATCH --job-name=pipedream",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_node}"] if gpus else []),
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ]
    if preemption.signal_name:
        lines.append(f"#SBATCH --signal={preemption.signal_name}@{preemption.signal_before_s}")
    lines += [
        "",
        'run_dir="${RUN_DIR:-runs/slurm-${SLURM_JOB_ID}}"   # the same folder after a requeue: the run resumes',
        "status=0",
        f'srun --ntasks-per-node=1 "${{PYTHON:-python}}" -m launcher {overrides} \\',
        '    "train.run_dir=${run_dir}" train.resume=auto "$@" || status=$?',
        f"if [ \"$status\" -eq {preemption.requeue_exit_code} ]; then",
        '    echo "preempted: checkpoint saved in ${run_dir}; requeueing job ${SLURM_JOB_ID}"',
        '    scontrol requeue "${SLURM_JOB_ID}"',
        "    exit 0",
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


def emit_script(cfg: Any, argv: list[str], world: int) -> str:
    """The script ``launcher.emit`` names (only ``slurm`` so far)."""
    kind = str(cfg.launcher.emit)
    if kind != "slurm":
        raise ConfigError(f"launcher.emit={kind} is not a script this launcher writes: use launcher.emit=slurm")
    return sbatch_script(cfg, argv, world)
