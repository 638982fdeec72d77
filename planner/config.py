"""Config -> Inputs. Composes ``conf/planner.yaml`` with Hydra's Compose API (no chdir, no outputs/)
and turns Hydra's multi-line composition errors into one line."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

from models.registry import known_family
from pipedream.config.loading import compose_config, compose_plain, compose_plain_dicts, describe_composition_error

from pipedream.schedules import SCHEDULE_INFOS, planned_schedules
from planner.errors import PlannerError
from planner.inputs.cluster_sheet import measured_cluster, measured_profile, measured_runtime, measured_tp_profiles
from planner.inputs.hardware import Cluster, cluster_from_config
from planner.inputs.search_inputs import Inputs
from planner.inputs.model_specs import spec_from_config
from planner.inputs.profile import Profile, analytic_profile, load_profile

PLANNED_SCHEDULES = planned_schedules()


def compose(overrides: Sequence[str] = (), config_name: str = "planner", plain_dicts: bool = False) -> Any:
    """``conf/planner.yaml`` with ``overrides``; bad overrides become one-line PlannerErrors. Plain
    overrides are composed without importing Hydra (``compose_plain``, the same config).
    ``plain_dicts``: where the config needs nothing of OmegaConf's (no interpolation), the same values
    as nested dicts read like OmegaConf's (``PlainConfig``), composed without importing OmegaConf
    either: ``python -m planner``'s start-up."""
    if plain_dicts:
        fast = compose_plain_dicts(overrides, config_name)
        if fast is not None:
            cfg, choices = fast
            _label_model(cfg.get("model"), choices.get("model"))
            return cfg
    from omegaconf import open_dict

    plain = compose_plain(overrides, config_name)
    if plain is not None:
        cfg, choices = plain
    else:
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException as OmegaConfError

        from models.errors import ConfigError

        try:
            cfg = compose_config(overrides, config_name, return_hydra_config=True)
        except (HydraException, OmegaConfError) as err:   # unknown choice or key, bad override syntax
            raise PlannerError(describe_composition_error(err, overrides, config_name)) from None
        except ConfigError as err:   # a model whose own files cannot be read (model=hf)
            raise PlannerError(str(err)) from None
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
    if cfg.get("model") is not None:
        with open_dict(cfg):
            _label_model(cfg.model, choices.get("model"))
    return cfg


def _label_model(model: Any, choice: str | None) -> None:
    """The config's file name (gpt_tiny) labels a preset model."""
    if model is not None and choice and not model.get("preset") and not model.get("_target_"):
        model["preset"] = choice


def _plain(node: Any) -> Any:
    """A config node as plain containers, a copy (``PlainConfig``s are already plain)."""
    if isinstance(node, (dict, list)):
        return copy.deepcopy(node)
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True)


def build_profile(cfg: Any, spec, cluster) -> Profile:
    p = cfg.planner
    if p.get("graph"):
        from planner.inputs.graph_txt import import_graph

        path = Path(str(p.graph))   # PipeDream's layout names the model by the folder: profiles/<model>/graph.txt
        label = path.parent.name if path.name == "graph.txt" and path.parent.name else path.name
        return import_graph(path, int(p.graph_micro_batch), name=f"graph:{label}")
    if p.get("profile"):
        return load_profile(str(p.profile))
    measured = measured_profile(cluster, _plain(cfg.model))  # cluster=measured: this model calibrated
    if measured is not None:
        return measured
    return analytic_profile(spec, cluster.device, 1)


def cluster_for(cluster_cfg: Any) -> Cluster:
    """The cluster to plan on: this machine as ``python -m planner.calibrate`` measured it
    (``cluster.sheet=measured``) or a preset's topology and device sheet."""
    if cluster_cfg.get("sheet") == "measured":
        return measured_cluster(cluster_cfg)
    return cluster_from_config(cluster_cfg)


def inputs_from_config(cfg: Any) -> Inputs:
    cluster = cluster_for(_plain(cfg.cluster))
    model_cfg = dict(_plain(cfg.model))
    if cfg.planner.get("precision"):
        model_cfg["precision"] = cfg.planner.precision
    target = model_cfg.get("_target_")
    if target is not None and not (cfg.planner.get("profile") or cfg.planner.get("graph")
                                   or measured_profile(cluster, model_cfg) is not None):
        raise PlannerError(f"model._target_={target} has no analytic sizes: measure it first (python -m "
                           f"planner.profile model._target_={target} ... planner.profile_out=profile.json), then "
                           f"plan with planner.profile=profile.json; or calibrate this machine with it (python -m "
                           f"planner.calibrate model._target_={target} data._target_=...) and plan with "
                           f"cluster=measured")
    spec = None if target is not None else spec_from_config(model_cfg, cluster.device.default_precision)
    profile = build_profile(cfg, spec, cluster)
    batch = cfg.train.global_batch_size
    if not isinstance(batch, int) or batch < 1:
        raise PlannerError(f"train.global_batch_size = {batch!r} must be a positive integer")
    micro = cfg.train.get("micro_batch_size")
    if micro is not None and (not isinstance(micro, int) or micro < 1 or batch % micro):
        raise PlannerError(f"train.global_batch_size = {batch} is not a multiple of train.micro_batch_size = "
                           f"{micro}: choose a micro-batch among {[b for b in range(1, batch + 1) if batch % b == 0][:12]}"
                           f" or train.micro_batch_size=null")
    p = cfg.planner
    analytic = profile.source == "analytic"
    return Inputs(
        model=profile.model if profile.source == "graph.txt" or target else str(cfg.model.get("preset") or cfg.model.name),
        profile=profile, cluster=cluster,
        global_batch=batch, spec=spec if analytic else None, **_reserve(p, cfg.cluster),
        max_micro_batch=int(p.max_micro_batch), micro_batch=micro,
        schedules=_schedules(p.schedules), recompute=tuple(bool(r) for r in p.recompute),
        max_tp=p.get("max_tp") or cfg.cluster.get("max_tp"), replication=bool(p.replication), memory_constraint=bool(p.memory_constraint),
        top_k=int(p.top_k), pin_tp=p.get("tp"), pin_pp=p.get("pp"), pin_dp=p.get("dp"),
        **_pipedream_costs(p),
        device_budget=_budget(p.get("device_budget_bytes")), **_memory_savers(p, spec),
        **_context_parallel(p, model_cfg, spec if analytic else None), max_zero=_max_zero(p),
        **_calibrated(cfg, cluster, profile))


def _memory_savers(p: Any, spec: Any) -> dict[str, Any]:
    """planner.selective_recompute / sequence_parallel / distributed_optimizer / overlap_grad_reduce,
    each limited to what the runtime can run for this model."""
    flags = {key: p.get(key, False) for key in ("selective_recompute", "sequence_parallel", "distributed_optimizer",
                                                 "overlap_grad_reduce")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise PlannerError(f"planner.{key} = {value!r} must be true or false")
    family = known_family(spec.model_cfg.get("name")) if hasattr(spec, "model_cfg") else None
    bucket_mb = p.get("grad_bucket_mb", 25)
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
        raise PlannerError(f"planner.grad_bucket_mb = {bucket_mb!r} must be a positive number of MiB")
    layers = p.get("recompute_num_layers")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 0):
        raise PlannerError(f"planner.recompute_num_layers = {layers!r} must be an integer >= 0 (layers recomputed "
                           f"at the start of each chunk) or null for all")
    return {"selective_recompute": flags["selective_recompute"] and (family is None or family.attention_core),
            "recompute_layers": layers,
            "sequence_parallel": flags["sequence_parallel"] and family is not None and family.sequence_parallel,
            "distributed_optimizer": flags["distributed_optimizer"],
            "grad_bucket_bytes": float(bucket_mb) * 2**20 if flags["overlap_grad_reduce"] else None}


def _context_parallel(p: Any, model_cfg: Any, spec: Any) -> dict[str, Any]:
    """planner.context_parallel (search parallel.cp) and planner.cp (pin it): context parallelism runs
    for the families that have it, without dropout, on a sequence that splits into 2 c chunks."""
    allowed = p.get("context_parallel", False)
    if not isinstance(allowed, bool):
        raise PlannerError(f"planner.context_parallel = {allowed!r} must be true or false")
    pin = p.get("cp")
    if pin is not None and (isinstance(pin, bool) or not isinstance(pin, int) or pin < 1):
        raise PlannerError(f"planner.cp = {pin!r} must be a positive integer (or null to search)")
    family = known_family(spec.model_cfg.get("name")) if hasattr(spec, "model_cfg") else None
    dropout = float(model_cfg.get("dropout") or 0.0)
    seq = getattr(spec, "seq_len", None)
    why_not = ("the profile is not analytic" if spec is None else
               f"model {model_cfg.get('name')} has no context-parallel form" if family is None or not family.context_parallel
               else f"model.dropout = {dropout} (context parallelism needs 0)" if dropout else None)
    if pin is not None and pin > 1:
        if why_not:
            raise PlannerError(f"planner.cp={pin} cannot be planned: {why_not}; use planner.cp=null")
        if seq % (2 * pin):
            raise PlannerError(f"planner.cp={pin}: model.seq_len = {seq} does not split into 2 x {pin} equal chunks "
                               f"(the zigzag layout); choose a cp with seq_len divisible by 2 cp")
    return {"context_parallel": allowed and why_not is None, "pin_cp": pin}


def _max_zero(p: Any) -> int:
    level = p.get("max_zero", 3)
    if isinstance(level, bool) or level not in (0, 1, 2, 3):
        raise PlannerError(f"planner.max_zero = {level!r} must be 0, 1, 2 or 3 (the deepest ZeRO level searched; "
                           f"levels 2 and 3 are priced only where ZeRO-1 does not fit)")
    return int(level)


GPU_RESERVE = {"reserve_gib": 3.0, "reserve_fraction": 0.2}   # docs/planner.md, Memory reserve


def _reserve(p: Any, cluster_cfg: Any) -> dict[str, float]:
    """The memory reserve: ``planner.reserve_*`` where given, else the cluster preset's (a CPU's in the
    CPU presets), else a GPU's."""
    out = {}
    for key, gpu in GPU_RESERVE.items():
        value = p.get(key)
        value = cluster_cfg.get(key, gpu) if value is None else value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise PlannerError(f"planner.{key}={value!r} must be a number >= 0 (or null: the cluster's reserve)")
        out[key] = float(value)
    return out


def _budget(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise PlannerError(f"planner.device_budget_bytes={value!r} must be a positive number of bytes or null "
                           f"(the device's memory less the reserve)")
    return float(value)


def _calibrated(cfg: Any, cluster, profile: Profile) -> dict:
    """Planned from the sheet's profile (cluster=measured): the sheet's runtime costs and tensor-parallel
    profiles for the same model."""
    if profile.source != "measured" or cfg.planner.get("profile") or cfg.planner.get("graph"):
        return {}
    from planner.harmony.costs import alone_profile, measured_harmony, sheet_entry   # here: a preset's start-up skips it

    model_cfg = _plain(cfg.model)
    return {"runtime": measured_runtime(cluster, model_cfg), "tp_profiles": measured_tp_profiles(cluster, model_cfg),
            "harmony_costs": measured_harmony(cluster, model_cfg),
            "harmony_alone_profile": alone_profile(sheet_entry(cluster, model_cfg))}


def _schedules(values: Any) -> tuple[str, ...]:
    names = tuple(str(s) for s in values)
    for name in names:
        info = SCHEDULE_INFOS.get(name)
        if info is not None and info.not_planned:
            raise PlannerError(f"planner.schedules={list(names)}: {info.not_planned}")
    unknown = [s for s in names if s not in SCHEDULE_INFOS]
    if unknown:
        raise PlannerError(f"planner.schedules={list(names)}: the planner has no cost model for {', '.join(unknown)}; "
                           f"choose among {', '.join(PLANNED_SCHEDULES)}")
    return names


def _pipedream_costs(p: Any) -> dict[str, Any]:
    """planner.pipedream_costs, planner.fewer_devices (null: as the cost model's source does, the
    dissertation leaving idle devices out, the released optimizer using every device unless told
    --use_fewer_machines) and planner.activation_compression_ratio (released boundaries)."""
    costs = p.get("pipedream_costs", "paper")
    if costs not in ("paper", "released"):
        raise PlannerError(f"planner.pipedream_costs={costs!r} is unknown: choose paper (the dissertation's "
                           f"formulas) or released (PipeDream's released optimizer)")
    fewer = p.get("fewer_devices")
    if fewer is not None and not isinstance(fewer, bool):
        raise PlannerError(f"planner.fewer_devices={fewer!r} must be true, false or null (null: true with "
                           f"planner.pipedream_costs=paper, false with released, as each source does)")
    ratio = p.get("activation_compression_ratio", 1.0)
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0):
        raise PlannerError(f"planner.activation_compression_ratio={ratio!r} must be a positive number (1: "
                           f"activations sent as they are) or null (boundaries cost nothing, the released "
                           f"optimizer's default)")
    return {"pipedream_costs": str(costs), "fewer_devices": costs == "paper" if fewer is None else fewer,
            "activation_compression": None if ratio is None else float(ratio)}
