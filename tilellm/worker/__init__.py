"""The device side: model runner, KV pool, CUDA graphs, step inputs, sampler, tensor-parallel workers."""
