"""Multi-model training (μ-two): K variants of one model trained in one job, their layers fused
(docs/multi_model.md). ``spec`` is torch-free; ``fused`` builds the fused model; what training it
changes in a rank is ``pipedream.runtime.fused_training``."""
