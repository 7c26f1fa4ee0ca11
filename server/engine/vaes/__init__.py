"""The VAEs, one module each, shared by every family whose folder carries that VAE. A VAE
provides what engine/family.py's FamilyModel asks of it (encode, decode, out_channels,
peak_bytes, to_model_space, from_model_space); `checkpoint.CheckpointVAE` is what those built
from a folder's checkpoint share. The package itself imports no MLX: `from_files` and
`ldm_names` (a VAE's config and names told from its file's header) serve the listing of
model files.
"""
