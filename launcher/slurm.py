"""Reads a SLURM allocation from the environment, so that ``python -m launcher`` started by ``srun``
(one task per node) needs no ``launcher.*`` keys: the node count (``SLURM_JOB_NUM_NODES``), this
node's rank (``SLURM_NODEID``) and the rendezvous host (the first of ``SLURM_JOB_NODELIST``) come from
SLURM. A ``launcher.*`` key given on the command line wins over what SLURM says."""
from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import open_dict

from pipedream.errors import ConfigError

from launcher.commands import world_size_of

DERIVED = {"nnodes": "SLURM_JOB_NUM_NODES", "node_rank": "SLURM_NODEID",
           "master_addr": "the first host of SLURM_JOB_NODELIST"}
BRACKETS = re.compile(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$")
COUNT = re.compile(r"^(\d+)(\(x\d+\))?$")


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list: ``gpu[01-03,07],cpu5`` -> gpu01 gpu02 gpu03 gpu07 cpu5 (zero
    padding kept; several bracket groups in one name, ``r[1-2]n[1-2]``, multiply out)."""
    hosts = [host for name in _split_outside_brackets(text) for host in _expand_name(name, text)]
    if not hosts:
        raise ValueError(f"no host names in {text!r}")
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    names, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in {text!r}")
        if char == "," and depth == 0:
            names.append(text[start:index])
            start = index + 1
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
    names.append(text[start:])
    return [name.strip() for name in names if name.strip()]


def _expand_name(name: str, whole: str) -> list[str]:
    match = BRACKETS.match(name)
    if match is None:
        if "[" in name or "]" in name:
            raise ValueError(f"bad host name {name!r} in {whole!r}")
        return [name]
    prefix, ranges, rest = match.groups()
    tails = _expand_name(rest, whole)
    hosts = []
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"bad range {part!r} in {whole!r}")
        for number in range(int(low), int(high if dash else low) + 1):
            hosts.extend(f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails)
    return hosts


def allocation_hosts(nodelist: str, environ: Mapping[str, str]) -> list[str]:
    """The allocation's host names: ``scontrol show hostnames`` where it is on PATH (it knows every
    syntax SLURM writes), else ``expand_nodelist``."""
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol:
        try:
            done = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                                  timeout=30, check=False)
            if done.returncode == 0 and done.stdout.split():
                return done.stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            pass
    try:
        return expand_nodelist(nodelist)
    except ValueError as error:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist} cannot be read ({error}): set launcher.master_addr "
                          f"to the first node's address") from None


def _count(text: str | None, name: str) -> int | None:
    """``8`` or ``8(x4)`` (SLURM's per-node counts) -> 8; several groups -> the largest."""
    if text is None or not text.strip():
        return None
    counts = []
    for part in text.split(","):
        match = COUNT.match(part.strip())
        if match is None:
            raise ConfigError(f"{name}={text} is not a SLURM count: unset it or fix the job's options")
        counts.append(int(match.group(1)))
    return max(counts)


@dataclass(frozen=True)
class SlurmAllocation:
    job_id: str
    nnodes: int
    node_rank: int | None      # None outside a job step (e.g. an salloc shell): every node's command is printed
    hosts: tuple[str, ...]
    gpus_per_node: int | None
    tasks_per_node: int | None


def read_allocation(environ: Mapping[str, str]) -> SlurmAllocation | None:
    """The allocation this process runs in, or None outside SLURM (no ``SLURM_JOB_ID``)."""
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError(f"SLURM_JOB_ID={job_id} but no SLURM_JOB_NODELIST: run the launcher inside the job "
                          f"(sbatch/srun), or unset SLURM_JOB_ID")
    hosts = tuple(allocation_hosts(nodelist, environ))
    nnodes = _count(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES"), "SLURM_JOB_NUM_NODES")
    if nnodes is not None and nnodes != len(hosts):
        raise ConfigError(f"SLURM_JOB_NUM_NODES={nnodes} but SLURM_JOB_NODELIST={nodelist} names {len(hosts)} "
                          f"hosts: run the launcher inside one job's environment")
    node_rank = _count(environ.get("SLURM_NODEID"), "SLURM_NODEID")
    if node_rank is not None and node_rank >= len(hosts):
        raise ConfigError(f"SLURM_NODEID={node_rank} is not below the job's {len(hosts)} nodes: "
                          f"run the launcher inside one job's environment")
    return SlurmAllocation(job_id, len(hosts), node_rank, hosts,
                           _count(environ.get("SLURM_GPUS_ON_NODE"), "SLURM_GPUS_ON_NODE"),
                           _count(environ.get("SLURM_NTASKS_PER_NODE"), "SLURM_NTASKS_PER_NODE"))


def explicit_launcher_keys(argv: list[str]) -> set[str]:
    """``launcher.*`` keys set on the command line (``launcher.x=``, ``+launcher.x=``, ``++launcher.x=``)."""
    keys = set()
    for arg in argv:
        key = arg.lstrip("+").partition("=")[0]
        if key.startswith("launcher."):
            keys.add(key.removeprefix("launcher."))
    return keys


def apply_allocation(cfg: Any, argv: list[str], environ: Mapping[str, str]) -> tuple[Any, list[str]]:
    """``cfg`` with the ``launcher.*`` values SLURM gives (where the command line set none), and one
    line per value saying where it came from (empty outside SLURM)."""
    allocation = read_allocation(environ)
    if allocation is None:
        return cfg, []
    explicit = explicit_launcher_keys(argv)
    derived = {"nnodes": allocation.nnodes, "node_rank": allocation.node_rank, "master_addr": allocation.hosts[0]}
    cfg = copy.deepcopy(cfg)
    notes = [f"slurm: job {allocation.job_id} on {allocation.nnodes} node(s): {' '.join(allocation.hosts)}"]
    with open_dict(cfg):
        for key, value in derived.items():
            if key in explicit:
                notes.append(f"launcher.{key}={cfg.launcher[key]} (command line; SLURM says {value})")
            elif value is not None:
                cfg.launcher[key] = value
                notes.append(f"launcher.{key}={value} ({DERIVED[key]})")
    notes.append(_check_capacity(cfg, allocation))
    if allocation.tasks_per_node and allocation.tasks_per_node > 1:
        print(f"launch: warning: SLURM_NTASKS_PER_NODE={allocation.tasks_per_node}: if srun started this launcher "
              f"that often per node, each starts its own torchrun; run it as one task per node "
              f"(srun --ntasks-per-node=1)", file=sys.stderr, flush=True)
    return cfg, notes


def _check_capacity(cfg: Any, allocation: SlurmAllocation) -> str:
    """Refuses a job that needs more processes per node than the node has GPUs."""
    nnodes = int(cfg.launcher.nnodes)
    world = world_size_of(cfg)
    if nnodes < 1 or world % nnodes:
        return f"processes: {world} in all"   # build_launch reports the bad node count
    per_node = world // nnodes
    gpus = allocation.gpus_per_node
    if gpus is None or str(cfg.cluster.device) == "cpu":
        return f"processes: {world} = {nnodes} node(s) x {per_node}"
    if per_node > gpus:
        raise ConfigError(f"the job needs {per_node} processes per node ({world} on {nnodes} node(s)) but SLURM "
                          f"gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE): request --gpus-per-node={per_node} "
                          f"or more nodes, or lower the parallel degrees")
    return f"processes: {world} = {nnodes} node(s) x {per_node} ({gpus} GPU(s) per node, SLURM_GPUS_ON_NODE)"
