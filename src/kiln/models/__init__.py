"""Model code shared by the trainer and the rollout engines: a Megatron-core GPTModel built from
a Hugging Face checkpoint of a family in the registry (`kiln.api.model_families`: Llama, Qwen2,
Qwen3, Qwen2-MoE, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3; optionally with DeepSeek sparse
attention), its weight mapping, and the process-group and CPU set-up Megatron needs.

- `arch`: `ArchSpec`, a checkpoint's shape read from config.json through its family entry;
- `megatron_model`: `build_gpt_model`, `forward_logits`, `token_logprobs`;
- `hf_io`: Hugging Face <-> Megatron weights by the family's name table (load, save, stream
  under HF names);
- `moe`: MoE layer settings, routing record and replay;
- `mla`: multi-latent attention settings (DeepSeek-V3);
- `dsa`: the lightning indexer and DSA attention layer, index recording and hashing, tiny DSA
  checkpoints;
- `parallel`, `cpu_shims`: torch.distributed/Megatron groups, and running Megatron without CUDA.
"""
