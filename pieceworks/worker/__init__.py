"""The worker: the model runner, its persistent step inputs, graph capture, decode tails, the
sampler and logprobs, the KV and state caches, and the executor with its worker processes."""
