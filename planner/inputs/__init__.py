"""What a search starts from: model specs, per-layer profiles (analytic, measured, graph.txt), the
hardware (device sheets, topologies, a measured cluster sheet) and ``search_inputs.Inputs``."""
