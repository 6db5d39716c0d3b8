"""Model execution: architectures, attention backends, loaders, the runner and the sampler.

A map, one subpackage per concern (importing a subpackage imports nothing heavy; the modules
marked torch-free are imported by the serving frontend and must stay so):

- config.py: ModelConfig, the model's shape (torch-free; the engine's messages carry it).
- models/: the transformer definitions: llama.py, qwen2.py, qwen3.py, and layers.py (RMSNorm,
  RoPE, MLP, the linears and when they use the native kernels).
- runner/: executing a step. model_runner.py (ModelRunner: SchedulerOutput -> one forward pass
  -> ModelRunnerOutput), cuda_model_runner.py (CudaModelRunner), cuda_graphs.py, input_batch.py
  (per-request state, a step's inputs), kv_cache.py (blocks per byte budget, the zeroed cache),
  h2d.py (host-to-device copies). kvflow/engine/worker.py builds a runner; executor.py drives it.
- sample/: logits to tokens. sampler.py, logits_processors.py (biases, penalties), logprobs.py,
  grammar.py (the structured-output bitmask applied to the logits).
- attention/: paged attention. backend.py (AttentionMetadata, the AttentionBackend interface and
  the CPU TorchAttentionBackend), triton_backend.py and triton_attention.py (its kernels), and
  selector.py (device and backend from EngineArgs' strings; its check_* functions are
  torch-free).
- kernels/: the native CPU kernels: csrc/ (C++ sources) and cpu_ops.py, which builds, caches and
  loads them (`python -m kvflow.model.kernels.cpu_ops`).
- quantization/: quantized weights executed as stored: quant.py (qtypes, quantizers) and
  quant_weights.py (QuantTensor, the quantized linear and embedding).
- loader/: checkpoint.py (find and open a checkpoint, torch-free), model_loader.py (build_model,
  dtypes), gguf_loader.py and gguf_reader.py (llama.cpp GGUF files).
- distributed/: tensor parallelism: parallel.py (process groups, shards, collectives) and
  peer_sockets.py (direct-TCP all-reduce on CPU).
"""
