"""Tensor model parallelism (Megatron, dissertation ch. 4.2.3) as explicit layers over a
``TensorParallel`` context; see docs/tensor_parallel.md for why not DTensor."""
from models.tensor_parallel.context import TensorParallel, divide, padded_size
from models.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from models.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_logits
from models.tensor_parallel.mappings import (copy_to_region, gather_chunks, gather_from_region, reduce_from_region, scatter_chunk,
                       scatter_to_region)
from models.tensor_parallel.params import (ShardSpec, gather_shards, gather_tensor, grad_norm_squared, is_sharded, mark_replicated,
                     mark_sharded, shard_spec, shard_tensor)
from models.tensor_parallel.random import RNGTracker
from models.tensor_parallel.transformer import ParallelMLP, ParallelSelfAttention, parallelize_block

__all__ = ["TensorParallel", "divide", "padded_size", "vocab_parallel_cross_entropy", "ColumnParallelLinear",
           "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_logits", "copy_to_region",
           "gather_chunks", "gather_from_region", "reduce_from_region", "scatter_chunk", "scatter_to_region",
           "ShardSpec", "gather_shards", "gather_tensor", "grad_norm_squared", "is_sharded", "mark_replicated",
           "mark_sharded", "shard_spec", "shard_tensor", "RNGTracker", "ParallelMLP", "ParallelSelfAttention",
           "parallelize_block"]
