"""Serving engines that continue from translated caches (`hf_mot.integrations.vllm`)."""
