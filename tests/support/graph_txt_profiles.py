"""PipeDream-style profiles (``profiles/<model>/graph.txt``, the layout of PipeDream's profiler)
generated here with the graph structure of PipeDream's published VGG-16, AlexNet, ResNet-50 and
GNMT profiles: residual adds, ``Size``/``View`` branches before the classifier, several inputs,
tuple outputs with list-valued sizes and ``__getitem__`` nodes. Sizes follow the models' shapes;
times are proportional to FLOPs (the importer's arithmetic, not a device, is under test)."""
from __future__ import annotations

from pathlib import Path

from models.families.vision_facts import vgg16_layers, resnet50_layers

BATCH = 32
FP32 = 4


class GraphWriter:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.edges: list[str] = []
        self.count = 0

    def node(self, desc: str, elements: float | list[float] = 0.0, params: int = 0, flops: float = 0.0,
             inputs: tuple[str, ...] = ()) -> str:
        self.count += 1
        name = f"node{self.count}"
        sizes = ([e * BATCH * FP32 for e in elements] if isinstance(elements, list) else elements * BATCH * FP32)
        act = f"[{'; '.join(f'{s:.1f}' for s in sizes)}]" if isinstance(sizes, list) else f"{sizes:.3f}"
        ms = flops * BATCH / 1e10
        self.lines.append(f"{name} -- {desc} -- forward_compute_time={ms:.3f}, backward_compute_time={2 * ms:.3f}, "
                          f"activation_size={act}, parameter_size={params * FP32:.3f}")
        self.edges += [f"\t{src} -- {name}" for src in inputs]
        return name

    def text(self) -> str:
        return "\n".join(self.lines + self.edges) + "\n"


def _classifier(g: GraphWriter, x: str, pooled: int, fcs: list[tuple[int, int]]) -> None:
    """``x.view(x.size(0), -1)`` then Linear/ReLU/Dropout: PipeDream traces the Size node as a branch."""
    size = g.node("Size(0)", 0.0, inputs=(x,))
    x = g.node("View(-1)", pooled, inputs=(x, size))
    for i, (fin, fout) in enumerate(fcs):
        x = g.node(f"Linear(in_features={fin}, out_features={fout}, bias=True)", fout, fin * fout + fout,
                   2 * fin * fout, inputs=(x,))
        if i < len(fcs) - 1:
            x = g.node("ReLU(inplace)", fout, inputs=(x,))
            x = g.node("Dropout(p=0.5)", fout, inputs=(x,))


def vgg16_graph() -> str:
    g = GraphWriter()
    x = g.node("Input", 3 * 224 * 224)
    layers = vgg16_layers()
    for layer in layers[:13]:
        conv = layer.cout * layer.in_hw ** 2
        x = g.node(f"Conv2d({layer.cin}, {layer.cout}, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))", conv,
                   layer.parameters, layer.forward_flops, inputs=(x,))
        x = g.node("ReLU(inplace)", conv, inputs=(x,))
        if layer.pool:
            x = g.node("MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)",
                       layer.output_elements, inputs=(x,))
    _classifier(g, x, 512 * 49, [(25088, 4096), (4096, 4096), (4096, 1000)])
    return g.text()


def alexnet_graph() -> str:
    g = GraphWriter()
    x = g.node("Input", 3 * 224 * 224)
    # (cin, cout, kernel, output side, max-pool after)
    for cin, cout, k, hw, pool in [(3, 64, 11, 55, True), (64, 192, 5, 27, True), (192, 384, 3, 13, False),
                                   (384, 256, 3, 13, False), (256, 256, 3, 13, True)]:
        x = g.node(f"Conv2d({cin}, {cout}, kernel_size=({k}, {k}))", cout * hw * hw, k * k * cin * cout + cout,
                   2 * k * k * cin * cout * hw * hw, inputs=(x,))
        x = g.node("ReLU(inplace)", cout * hw * hw, inputs=(x,))
        if pool:
            x = g.node("MaxPool2d(kernel_size=3, stride=2)", cout * ((hw - 3) // 2 + 1) ** 2, inputs=(x,))
    _classifier(g, x, 256 * 36, [(9216, 4096), (4096, 4096), (4096, 1000)])
    return g.text()


def resnet50_graph() -> str:
    """Convolution, BatchNorm and ReLU nodes of each bottleneck, the projection branch of the first
    block of each stage, and the residual Add."""
    g = GraphWriter()
    stem, *blocks, head = resnet50_layers()
    x = g.node("Input", 3 * 224 * 224)
    conv = stem.cout * stem.conv_hw ** 2
    x = g.node("Conv2d(3, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)", conv, 49 * 3 * 64,
               stem.forward_flops, inputs=(x,))
    x = g.node("BatchNorm2d(64)", conv, 128, inputs=(x,))
    x = g.node("ReLU(inplace)", conv, inputs=(x,))
    x = g.node("MaxPool2d(kernel_size=3, stride=2, padding=1)", stem.output_elements, inputs=(x,))
    for b in blocks:
        inner = [(b.cin, b.width, 1, b.in_hw), (b.width, b.width, 3, b.out_hw), (b.width, b.cout, 1, b.out_hw)]
        y = x
        for i, (cin, cout, k, hw) in enumerate(inner):
            y = g.node(f"Conv2d({cin}, {cout}, kernel_size=({k}, {k}), bias=False)", cout * hw * hw, k * k * cin * cout,
                       2 * k * k * cin * cout * hw * hw, inputs=(y,))
            y = g.node(f"BatchNorm2d({cout})", cout * hw * hw, 2 * cout, inputs=(y,))
            if i < 2:
                y = g.node("ReLU(inplace)", cout * hw * hw, inputs=(y,))
        shortcut = x
        if b.downsample:
            shortcut = g.node(f"Conv2d({b.cin}, {b.cout}, kernel_size=(1, 1), stride=({b.stride}, {b.stride}), "
                              f"bias=False)", b.output_elements, b.cin * b.cout,
                              2 * b.cin * b.output_elements, inputs=(x,))
            shortcut = g.node(f"BatchNorm2d({b.cout})", b.output_elements, 2 * b.cout, inputs=(shortcut,))
        added = g.node("Add(inplace)", b.output_elements, inputs=(y, shortcut))
        x = g.node("ReLU(inplace)", b.output_elements, inputs=(added,))
    x = g.node("AvgPool2d(kernel_size=7, stride=1, padding=0)", head.cin, inputs=(x,))
    _classifier(g, x, head.cin, [(head.cin, head.cout)])
    return g.text()


def gnmt_graph(hidden: int = 1024, vocab: int = 32320, seq: int = 48) -> str:
    """GNMT-4: the encoder (embedding, bidirectional LSTM, three LSTMs with residual adds), the
    decoder (embedding, recurrent attention, three LSTMs fed the attention context by Concat, with
    residual adds) and the classifier; three inputs (source, its lengths, target) and an initial
    ``hidden`` state. LSTMs return (output, (h, c)): list-valued sizes and ``__getitem__`` nodes."""
    g = GraphWriter()
    tokens, state = seq * hidden, hidden
    lstm = 4 * (2 * hidden * hidden + 2 * hidden)
    src = g.node("Input0")
    lengths = g.node("Input1")
    tgt = g.node("Input2")
    x = g.node(f"Embedding({vocab}, {hidden}, padding_idx=0)", tokens, vocab * hidden, inputs=(src,))
    x = g.node("EmuBidirLSTM", 2 * tokens, 2 * lstm + lstm, 2 * 3 * lstm * seq, inputs=(x, lengths))
    residual = None
    for layer in range(3):
        x = g.node("Dropout(p=0.2)", tokens * (2 if layer == 0 else 1), inputs=(x,))
        rnn = g.node(f"LSTM({2 * hidden if layer == 0 else hidden}, {hidden})", [tokens, state, state], lstm,
                     2 * lstm * seq, inputs=(x,))
        out = g.node("__getitem__(0)", tokens, inputs=(rnn,))
        g.node("__getitem__(1)", 2 * state, inputs=(rnn,))   # the final state: a sink nobody reads
        x = out if residual is None else g.node("Add", tokens, inputs=(out, residual))
        residual = x
    encoder = x
    hidden_state = g.node("hidden")
    y = g.node(f"Embedding({vocab}, {hidden}, padding_idx=0)", tokens, vocab * hidden, inputs=(tgt,))
    first = g.node("__getitem__(0)", 0.0, inputs=(hidden_state,))
    attn = g.node("RecurrentAttention", [tokens, state, state, tokens, seq * seq], lstm + 2 * hidden * hidden,
                  2 * (lstm + 2 * hidden * hidden) * seq, inputs=(y, first, encoder, lengths))
    y = g.node("__getitem__(0)", tokens, inputs=(attn,))
    g.node("__getitem__(1)", 2 * state, inputs=(attn,))
    context = g.node("__getitem__(2)", tokens, inputs=(attn,))
    residual = None
    for layer in range(3):
        y = g.node("Dropout(p=0.2)", tokens, inputs=(y,))
        cat = g.node("Concat(2)", 2 * tokens, inputs=(y, context))
        initial = g.node(f"__getitem__({layer + 1})", 0.0, inputs=(hidden_state,))
        rnn = g.node(f"LSTM({2 * hidden}, {hidden})", [tokens, state, state], lstm, 2 * lstm * seq,
                     inputs=(cat, initial))
        out = g.node("__getitem__(0)", tokens, inputs=(rnn,))
        g.node("__getitem__(1)", 2 * state, inputs=(rnn,))
        y = out if residual is None else g.node("Add", tokens, inputs=(out, residual))
        residual = y
    g.node(f"Classifier(Linear(in_features={hidden}, out_features={vocab}))", seq * vocab, hidden * vocab + vocab,
           2 * hidden * vocab * seq, inputs=(y,))
    return g.text()


PROFILES = {"image_classification/profiles/vgg16": vgg16_graph, "image_classification/profiles/alexnet": alexnet_graph,
            "image_classification/profiles/resnet50": resnet50_graph, "translation/profiles/gnmt": gnmt_graph}


def write_profiles(root: Path) -> dict[str, Path]:
    """PipeDream's profiler layout under ``root``: {model: path of its graph.txt}."""
    paths = {}
    for folder, build in PROFILES.items():
        path = root / "profiler" / folder / "graph.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(build())
        paths[folder.rsplit("/", 1)[1]] = path
    return paths


def chain_graph(layers: int = 98, width: int = 4096) -> str:
    """A straight chain of ``layers`` nodes after the input (``layers / 2`` Linear + ReLU pairs, every
    other Linear four times as wide): deep enough that PipeDream's DP and the memory check work over
    many split points."""
    g = GraphWriter()
    x = g.node("Input", width)
    for i in range(layers // 2):
        fout = 4 * width if i % 2 == 0 else width
        fin = width if i % 2 == 0 else 4 * width
        x = g.node(f"Linear(in_features={fin}, out_features={fout}, bias=True)", fout, fin * fout + fout,
                   2 * fin * fout, inputs=(x,))
        x = g.node("ReLU(inplace)", fout, inputs=(x,))
    if layers % 2:
        x = g.node("Dropout(p=0.1)", width, inputs=(x,))
    return g.text()
