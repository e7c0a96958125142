# Regenerates tests/data_trl/grpo_config.json with the real TRL (pip install trl==1.16.0):
#   PYTHONPATH=<trl 1.16.0> .venv/bin/python tests/data_trl/make_grpo_config.py
from trl import GRPOConfig

KWARGS = {
    "output_dir": "trl-run", "use_cpu": True, "bf16": False, "per_device_train_batch_size": 4, "num_generations": 4,
    "steps_per_generation": 2, "gradient_accumulation_steps": 2, "max_steps": 100, "warmup_steps": 10,
    "learning_rate": 3e-6, "beta": 0.04, "loss_type": "grpo", "epsilon_high": 0.28, "temperature": 0.7, "top_k": 20,
    "scale_rewards": False, "mask_truncated_completions": True, "sapo_temperature_pos": 2.0,
    "off_policy_mask_threshold": 0.5, "vllm_importance_sampling_mode": "token_truncate",
    "vllm_importance_sampling_clip_max": 2.5, "max_completion_length": 256, "seed": 7,
}

if __name__ == "__main__":
    print(GRPOConfig(**KWARGS).to_json_string(), end="")
