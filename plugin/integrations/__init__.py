"""Framework adapters (torchtitan, megatron-core). The core package never imports these."""
