"""Context parallelism: every sample's sequence split over the ``cp`` ranks of a group, in the
load-balanced zigzag layout (``layout``), with the ring attention that keeps attention exact over
the split (``ring_attention``). ``ContextParallel`` is a rank's context, which ``models.build_model``
passes to the gpt, llama and hf families (with or without tensor and sequence parallelism, whose
group is another one) at ``parallel.cp`` > 1."""
from models.context_parallel.context import ContextParallel, global_positions
from models.context_parallel.layout import gather_zigzag, split_zigzag, unsplit_zigzag, zigzag_indices
from models.context_parallel.ring_attention import RingExchange, ring_attention

__all__ = ["ContextParallel", "global_positions", "zigzag_indices",
           "split_zigzag", "unsplit_zigzag", "gather_zigzag", "RingExchange", "ring_attention"]
