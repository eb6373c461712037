"""The tiny Qwen2-MoE the MoE tests share (`kiln.models.tiny.make_tiny_checkpoint(**TINY_MOE)`):
2 layers, 8 experts top-2, a shared expert. Head size 32: vLLM's CPU attention has kernels for it."""

TINY_MOE = dict(arch="qwen2_moe", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                intermediate_size=128, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=64)
