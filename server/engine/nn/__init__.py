"""The small network pieces families share, written once: rotary embeddings (`rope`),
attention with the CPU backend's rewrites (`attention`, `cpu_ops`), activations and norms
(`activations`), compute dtypes and weight-tree helpers (`dtypes`). The LoRA-aware linear is
`engine/lora.py`'s `project`."""
