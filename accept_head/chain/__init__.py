"""Chain speculative decoding: one lossless round (`speculative_generate`), stop policies and head-free baselines,
on-policy rollout labels and HF's own assisted generation measured alike."""
