"""Executing a step: ModelRunner, CudaModelRunner, CUDA graphs, the step's inputs."""
