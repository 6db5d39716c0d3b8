"""Model execution: architectures, attention backends, loaders, the runner and the sampler."""
