"""The VAEs, one module each, shared by every family whose folder carries that VAE. A VAE
provides what engine/family.py's FamilyModel asks of it (encode, decode, out_channels,
peak_bytes, to_model_space, from_model_space)."""
