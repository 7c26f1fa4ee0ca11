"""Qwen3 and Qwen3-VL: the decoder (text.py), the vision tower (vision.py) and its image
processor (processor.py), the two composed (vl.py), and the Qwen tokenizer under a family's
prompt template (tokenizer.py)."""
