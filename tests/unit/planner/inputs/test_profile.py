"""Profiles: interpolation, JSON round trip, the three sources (analytic, measured, graph.txt)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pipedream.devices import DEVICES
from planner.errors import ProfileError
from planner.inputs.graph_txt import import_graph, profile_from_graph
from planner.inputs.model_specs import TransformerSpec, vgg16
from planner.inputs.profile import LayerProfile, Profile, analytic_profile, load_profile
from tests.support.planner_helpers import BRANCHY, CHAIN


def _layer(times):
    return LayerProfile("l", "layer", tuple(times), tuple(2 * t for t in times), 1.0, 2.0, 4.0, 3.0, 1.0)


def test_interpolation_between_and_beyond_points():
    prof = Profile("m", "d", "measured", "fp32", 1, (2, 4, 8), (_layer([2.0, 3.0, 5.0]),))
    f, b = prof.times_many([1, 2, 3, 4, 6, 8, 16])
    assert f[:, 0].tolist() == pytest.approx([1.0, 2.0, 2.5, 3.0, 4.0, 5.0, 9.0])
    assert b[:, 0].tolist() == pytest.approx([2.0, 4.0, 5.0, 6.0, 8.0, 10.0, 18.0])
    single = Profile("m", "d", "graph.txt", "fp32", 1, (4,), (_layer([2.0]),))
    assert single.times(8)[0][0] == pytest.approx(4.0)


def test_json_round_trip(tmp_path):
    spec = TransformerSpec("g", "gpt", 2, 64, 4, 16, 32, "bf16")
    prof = analytic_profile(spec, DEVICES["a100_80gb"], 2)
    path = tmp_path / "p.json"
    prof.save(path)
    back = load_profile(path)
    assert back == prof
    assert json.loads(path.read_text())["schema"] == "pipedream-profile/1"
    with pytest.raises(ProfileError, match="schema"):
        from planner.inputs.profile import profile_from_json
        profile_from_json({"schema": "other"})
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


def test_analytic_profile_scales_with_tensor_parallelism():
    spec = TransformerSpec("g", "gpt", 4, 4096, 32, 2048, 51200, "bf16")
    one, eight = (analytic_profile(spec, DEVICES["a100_80gb"], t) for t in (1, 8))
    blk1, blk8 = one.layers[1], eight.layers[1]
    assert blk8.parameter_bytes == pytest.approx(blk1.parameter_bytes / 8)
    assert blk8.forward_s[0] > blk1.forward_s[0] / 8  # smaller GEMMs run less efficiently
    # ~4x faster at t = 8 (h = 4096, b = 1) with the A100 efficiency fitted to Table 4.1's hardware
    # FLOPs (x_half = 1.2e10 FLOPs); it was 5x with the earlier x_half = 4e9
    assert blk8.forward_s[0] < blk1.forward_s[0] / 3.5
    assert blk1.tp_forward_bytes == 0 and blk8.tp_forward_bytes + blk8.tp_backward_bytes == pytest.approx(
        8 * 2048 * 4096 * 7 / 8 * 2)  # ch. 4.3.2: 8bsh(t-1)/t elements of 2 bytes
    assert one.flops_per_sample_recompute / one.flops_per_sample == pytest.approx(4 / 3, rel=0.05)
    # per-sample time falls as the micro-batch grows (arithmetic intensity, Figure 4.7)
    f, _ = one.times_many([1, 8])
    assert f[1, 1] / 8 < f[0, 1]


def test_cnn_analytic_profile_is_uneven():
    prof = analytic_profile(vgg16(), DEVICES["v100_16gb"])
    fwd, _ = prof.times(32)
    assert prof.num_layers == 16 and fwd.max() / fwd.min() > 10
    assert prof.layers[-3].parameter_bytes > 100e6 * 4  # fc1 holds most of VGG's weights


def test_graph_txt_chain_import():
    prof = profile_from_graph(CHAIN, micro_batch=4, name="tiny")
    assert [layer.name.split(":")[0] for layer in prof.layers] == ["node2", "node3", "node4"]
    assert prof.layers[0].forward_s == (0.002,) and prof.layers[2].backward_s == (0.003,)
    assert prof.layers[0].output_bytes == 200.0  # 800 bytes for 4 samples
    assert prof.layers[2].parameter_bytes == 72.0


# A hand-checkable DAG: A feeds B, C and D; C returns two tensors ([20; 5]: 25 bytes) read by
# __getitem__ nodes, of which only the first is used (the other, a sink, is pruned); D joins.
DAG = """node1 -- Input -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=64.0, parameter_size=0.000
node2 -- A -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=100.0, parameter_size=40.000
node4 -- C -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=[20.0; 5.0], parameter_size=[8.0; 4.0]
node3 -- B -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=10.0, parameter_size=0.000
node5 -- __getitem__(0) -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=20.0, parameter_size=0.000
node6 -- __getitem__(1) -- forward_compute_time=0.000, backward_compute_time=0.000, activation_size=5.0, parameter_size=0.000
node7 -- D -- forward_compute_time=1.000, backward_compute_time=2.000, activation_size=7.0, parameter_size=0.000
\tnode1 -- node2
\tnode2 -- node3
\tnode2 -- node4
\tnode4 -- node5
\tnode4 -- node6
\tnode3 -- node7
\tnode5 -- node7
\tnode2 -- node7
"""


def test_graph_txt_dag_cuts_count_every_live_tensor():
    prof = profile_from_graph(DAG, micro_batch=1)
    assert [layer.name for layer in prof.layers] == ["node2:A", "node3:B", "node4:C", "node5:__getitem__", "node7:D"]
    # after A: A; after B: A + B; after C: A + B + C's two tensors; after C[0]: A + B + C[0] (C is
    # read only by node5 and the pruned node6); the last layer: its own output
    assert [layer.output_bytes for layer in prof.layers] == [100.0, 110.0, 135.0, 130.0, 7.0]
    assert [layer.activation_bytes for layer in prof.layers] == [100.0, 10.0, 25.0, 20.0, 7.0]
    assert prof.layers[2].parameter_bytes == 12.0 and prof.num_parameters == (40 + 12) // 4


def test_graph_txt_branchy_graph_cuts_around_the_residual():
    prof = profile_from_graph(BRANCHY, micro_batch=2)
    assert [layer.output_bytes for layer in prof.layers] == [400.0, 800.0, 400.0]  # node2 stays live until the add


def test_graph_txt_cycle_is_one_line():
    cyclic = BRANCHY + "\tnode4 -- node2\n"
    with pytest.raises(ProfileError, match="cycle through node2") as err:
        profile_from_graph(cyclic, micro_batch=1)
    assert "\n" not in str(err.value)


# nodes without Input and pruned __getitem__ sinks. VGG-16: 13 convs + 13 ReLUs + 5 pools, Size,
# View, 3 Linear + 2 ReLU + 2 Dropout; AlexNet: 5 + 5 + 3, then the same 9; ResNet-50: stem 4,
# 16 blocks x 10 (3 convs, 3 BNs, 3 ReLUs, Add), 4 projections x 2, pool, Size, View, Linear;
# GNMT: encoder 2 + 3 x 3 + 2 Adds, decoder 6 + 3 x 5 + 2 Adds, classifier.
LAYERS = {"vgg16": 40, "alexnet": 22, "resnet50": 176, "gnmt": 37}


@pytest.mark.parametrize("model,layers", LAYERS.items())
def test_pipedream_layout_profiles_load(tmp_path, model, layers):
    from tests.support.graph_txt_profiles import write_profiles

    path = write_profiles(tmp_path)[model]
    assert path.relative_to(tmp_path).parts[0] == "profiler"
    prof = import_graph(path, micro_batch=32, name=model)
    assert prof.num_layers == layers
    assert all(layer.output_bytes > 0 for layer in prof.layers)
    assert not any(layer.name.split(":")[1].startswith("Input") for layer in prof.layers)


def test_resnet50_graph_counts_the_shortcut_inside_a_block(tmp_path):
    from tests.support.graph_txt_profiles import write_profiles

    prof = import_graph(write_profiles(tmp_path)["resnet50"], micro_batch=32)
    names = [layer.name.split(":")[1] for layer in prof.layers]
    pool = names.index("MaxPool2d")   # the stem's output feeds the first block's two branches
    stem_out = prof.layers[pool].output_bytes
    first_conv = prof.layers[pool + 1]
    assert first_conv.output_bytes == stem_out + first_conv.activation_bytes
    assert prof.num_parameters == 25_557_032   # the generator uses models.families.vision_facts' shapes


def test_graph_txt_garbage_line():
    with pytest.raises(ProfileError, match="line 1"):
        profile_from_graph("hello\n", 1)


def test_measured_profile_of_gpt_tiny():
    """Source (a): run models.build_model's layers on this CPU (tiny sizes, one repeat)."""
    pytest.importorskip("torch")
    from planner.calibrate.measure import measure_profile

    cfg = {"name": "gpt", "num_layers": 2, "hidden_size": 32, "num_heads": 2, "seq_len": 8, "vocab_size": 64,
           "tie_embeddings": True, "dropout": 0.0}
    prof = measure_profile(cfg, [1, 2], "cpu", warmup=1, repeats=1)
    assert [layer.kind for layer in prof.layers] == ["embedding", "block", "block", "head"]
    assert all(t > 0 for layer in prof.layers for t in layer.forward_s + layer.backward_s)
    blk = prof.layers[1]
    assert blk.output_bytes == 8 * 32 * 4  # s h fp32 per sample
    assert blk.parameter_bytes == (12 * 32 * 32 + 13 * 32) * 4  # eq. 4.3's per-layer term
    assert blk.activation_bytes > blk.activation_bytes_recompute == 8 * 32 * 4
    assert blk.flops >= 24 * 8 * 32 * 32  # 24 s h^2 forward (ch. 4.5.1)
    assert prof.num_parameters == (64 + 8) * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32
    assert np.isfinite(prof.times(4)[0]).all()
