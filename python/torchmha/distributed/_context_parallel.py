class ContextParallelAttention: pass
