"""Z-Image's facts that need no MLX: what the command line's listing and the embedded model's
generator read without loading the family (family.py imports them from here)."""

from __future__ import annotations

PIPELINE_CLASS = "ZImagePipeline"
# The variants' own settings (docs/contract.md §5.3); neither has fixed sigmas or a size rule.
SAMPLING = {
    "turbo": {"steps": 8, "cfg": 1.0, "shift": 3.0},
    "base": {"steps": 50, "cfg": 5.0, "shift": 6.0},
}
