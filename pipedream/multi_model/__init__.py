"""Multi-model training (μ-two): K variants of one model trained in one job, their layers fused
(docs/multi_model.md). ``settings`` is torch-free; ``fused`` builds the fused model."""
