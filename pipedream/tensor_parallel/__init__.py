"""Tensor model parallelism (Megatron, dissertation ch. 4.2.3) as explicit layers over a
``TensorParallel`` context; see docs/tensor_parallel.md for why not DTensor."""
from .context import TensorParallel, divide, padded_size
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_logits
from .mappings import (copy_to_region, gather_chunks, gather_from_region, reduce_from_region, scatter_chunk,
                       scatter_to_region)
from .params import (ShardSpec, gather_shards, gather_tensor, grad_norm_squared, is_sharded, mark_replicated,
                     mark_sharded, shard_spec, shard_tensor)
from .random import RNGTracker
from .transformer import ParallelMLP, ParallelSelfAttention, parallelize_block

__all__ = ["TensorParallel", "divide", "padded_size", "vocab_parallel_cross_entropy", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_logits", "copy_to_region",
           "gather_chunks", "gather_from_region", "reduce_from_region", "scatter_chunk", "scatter_to_region",
           "ShardSpec", "gather_shards", "gather_tensor", "grad_norm_squared", "is_sharded", "mark_replicated",
           "mark_sharded", "shard_spec", "shard_tensor", "RNGTracker", "ParallelMLP", "ParallelSelfAttention",
           "parallelize_block"]
