"""Model code shared by the trainer and the rollout engines: a Megatron-core GPTModel built from
a Hugging Face Llama/Qwen2 checkpoint (optionally with DeepSeek sparse attention), its weight
mapping, and the process-group and CPU set-up Megatron needs.

- `megatron_model`: `ArchSpec`, `build_gpt_model`, `forward_logits`, `token_logprobs`;
- `hf_io`: Hugging Face <-> Megatron weights (load, save, iterate under HF names);
- `dsa`: the lightning indexer and DSA attention layer, index recording and hashing, tiny DSA
  checkpoints;
- `parallel`, `cpu_shims`: torch.distributed/Megatron groups, and running Megatron without CUDA.
"""
