"""The embedded default model: a real-format Qwen-Image 2.1 folder, generated without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gmlx_server.engine.embedded import STAMP_FILE, default_cache_dir
from gmlx_server.engine.families.qwen_image21 import embedded
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return embedded.ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _config(root: Path, component: str) -> dict:
    return json.loads((root / component / "config.json").read_text())


def test_folder_is_named_and_laid_out_as_diffusers(model_dir):
    assert model_dir.name == embedded.MODEL_NAME == "qwen-image21-random-tiny"
    expected = {
        "model_index.json",
        "scheduler/scheduler_config.json",
        "transformer/config.json",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors",
        "processor/tokenizer.json",
        "processor/tokenizer_config.json",
        "processor/chat_template.jinja",
        "processor/preprocessor_config.json",
        "processor/video_preprocessor_config.json",
        STAMP_FILE,
    }
    assert set(_files(model_dir)) == expected
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline"
    assert index["sample_sigmas"] == embedded.SAMPLE_SIGMAS
    # Tiny on disk.
    assert sum(len(data) for data in _files(model_dir).values()) < 12_000_000


def test_generation_needs_no_torch_diffusers_or_transformers(tmp_path):
    # Blocked in sys.modules, any import of them raises ImportError in the child.
    child = textwrap.dedent(
        """
        import sys
        for name in ("torch", "diffusers", "transformers"):
            sys.modules[name] = None
        from gmlx_server.engine.families.qwen_image21.embedded import ensure_embedded_model
        print(ensure_embedded_model(sys.argv[1]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == tmp_path / embedded.MODEL_NAME


def test_reused_when_current_and_regenerated_when_stale(tmp_path):
    first = embedded.ensure_embedded_model(tmp_path)
    marker = first / "marker"
    marker.write_text("kept while the stamp is current")
    assert embedded.ensure_embedded_model(tmp_path) == first
    assert marker.exists()

    stamp = json.loads((first / STAMP_FILE).read_text())
    (first / STAMP_FILE).write_text(json.dumps({**stamp, "fingerprint": "older"}))
    assert embedded.ensure_embedded_model(tmp_path) == first
    assert not marker.exists()
    assert json.loads((first / STAMP_FILE).read_text()) == stamp
    # Nothing temporary is left beside it.
    assert [p.name for p in tmp_path.iterdir()] == [embedded.MODEL_NAME]


def test_incomplete_folder_without_stamp_is_replaced(tmp_path):
    partial = tmp_path / embedded.MODEL_NAME
    (partial / "transformer").mkdir(parents=True)
    (partial / "transformer" / "config.json").write_text("{}")
    embedded.ensure_embedded_model(tmp_path)
    assert (partial / STAMP_FILE).is_file()
    assert json.loads((partial / "transformer" / "config.json").read_text())["num_layers"] > 0


def test_default_cache_dir_respects_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "gmlx-steps" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "gmlx-steps" / "models"


def test_configs_agree_with_each_other_and_the_tokenizer(model_dir):
    transformer = _config(model_dir, "transformer")
    vae = _config(model_dir, "vae")
    encoder = _config(model_dir, "text_encoder")
    text, vision = encoder["text_config"], encoder["vision_config"]
    # Text width = the DiT's context width = the vision tower's output width.
    assert text["hidden_size"] == transformer["context_in_dim"] == vision["out_hidden_size"]
    # Latent channels, their statistics, and the fixed factor 16.
    assert vae["z_dim"] == transformer["in_channels"] == transformer["out_channels"]
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == vae["z_dim"]
    assert min(vae["latents_std"]) > 0
    assert len(vae["dim_mult"]) == 5 and vae["in_channels"] == vae["out_channels"] == 4
    # RoPE: DiT axes sum to its head dim, all even; M-RoPE sections sum to half the text head.
    axes = transformer["axes_dims_rope"]
    assert sum(axes) == transformer["attention_head_dim"] and all(a % 2 == 0 for a in axes)
    assert sum(text["rope_parameters"]["mrope_section"]) * 2 == text["head_dim"]
    # One image-pad slot = a 32-pixel square = 2x2 latents.
    processor = json.loads((model_dir / "processor" / "preprocessor_config.json").read_text())
    assert processor["patch_size"] * processor["merge_size"] == 32 == vision["patch_size"] * 2
    # Token ids in the configs are the tokenizer's, and its added tokens keep Qwen's order.
    tokenizer = Tokenizer.from_file(str(model_dir / "processor" / "tokenizer.json"))
    assert encoder["image_token_id"] == tokenizer.token_to_id("<|image_pad|>")
    assert encoder["video_token_id"] == tokenizer.token_to_id("<|video_pad|>")
    assert encoder["vision_start_token_id"] == tokenizer.token_to_id("<|vision_start|>")
    assert encoder["vision_end_token_id"] == tokenizer.token_to_id("<|vision_end|>")
    assert text["vocab_size"] == tokenizer.get_vocab_size()
    first = tokenizer.token_to_id(embedded.SPECIAL_TOKENS[0])
    added = embedded.SPECIAL_TOKENS + embedded.PLAIN_ADDED_TOKENS
    assert [tokenizer.token_to_id(t) for t in added] == list(range(first, first + len(added)))
    assert first + len(added) == tokenizer.get_vocab_size()


def test_tokenizer_round_trips_text_and_keeps_special_tokens_whole(model_dir):
    tokenizer = Tokenizer.from_file(str(model_dir / "processor" / "tokenizer.json"))
    text = "<|im_start|>user\nA cat, 35mm — café 雪<|im_end|>\n"
    encoding = tokenizer.encode(text)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text
    assert encoding.ids[0] == tokenizer.token_to_id("<|im_start|>")
    assert tokenizer.token_to_id("<|im_end|>") in encoding.ids


# ---- the reference implementations read it as a real checkpoint ------------------------------


def test_components_load_in_the_reference_classes_without_missing_keys(model_dir):
    pytest.importorskip("torch")
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLForConditionalGeneration

    loaders = {
        "transformer": QwenImage21Transformer2DModel,
        "vae": AutoencoderKLQwenImage21,
        "text_encoder": Qwen3VLForConditionalGeneration,
    }
    for component, cls in loaders.items():
        _, info = cls.from_pretrained(model_dir / component, output_loading_info=True)
        problems = {key: value for key, value in info.items() if value}
        assert problems == {}, f"{component}: {problems}"


def test_diffusers_pipeline_runs_on_it(model_dir):
    torch = pytest.importorskip("torch")
    from diffusers import QwenImage21Pipeline

    # transformers 5.24 builds Qwen3VLProcessor only with its torchvision-gated video processor;
    # this helper builds it from the image processor and tokenizer alone.
    from tests.encoders.qwen3.reference import load_processor

    pipe = QwenImage21Pipeline.from_pretrained(
        model_dir, processor=load_processor(model_dir), dtype=torch.float32
    )
    assert pipe.config.sample_sigmas == embedded.SAMPLE_SIGMAS
    steps = []
    image = pipe(
        "a red fox in the snow",
        height=64,
        width=64,
        sigmas=[1.0, 0.5],  # two steps instead of the variant's eight
        output_type="np",
        generator=torch.Generator().manual_seed(0),
        callback_on_step_end=lambda pipe, i, t, kwargs: steps.append(i) or {},
    ).images
    assert steps == [0, 1]
    assert image.shape == (1, 64, 64, 4) and np.isfinite(image).all()
    assert image.std() > 0.01  # the decoder's output is not a constant

    # With a reference image: its vision slots must match its latents (the min-pixels choice).
    reference = (np.random.default_rng(0).random((80, 96, 3)) * 255).astype(np.uint8)
    latents = pipe(
        "make it blue",
        image=reference,
        height=64,
        width=64,
        sigmas=[1.0, 0.5],
        output_type="latent",
        output_resolution=64,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert latents.shape == (1, 16, 64) and torch.isfinite(latents).all()


def test_engine_loads_it_and_makes_an_image(model_dir):
    """The server's own loaders read the same folder."""
    from gmlx_server.engine.base import StepRow
    from gmlx_server.engine.families.qwen_image21 import family

    assert family.QWEN_IMAGE21.spec.identify(model_dir) == ("qwen_image21", "turbo")
    model = family.QWEN_IMAGE21.load(model_dir, embedded.MODEL_NAME)
    encoding = model.encode("a red fox", [], refs=False)
    assert (
        encoding.cond.shape[-1] == _config(model_dir, "text_encoder")["text_config"]["hidden_size"]
    )
    x = np.random.default_rng(0).standard_normal((1, 64, 4, 4)).astype(np.float32)
    row = StepRow(cond=encoding.cond, cond_key="fox")
    result = model.denoise_step(x, np.array([1.0], np.float32), [row])
    assert result.out.shape == x.shape and np.isfinite(result.out).all()
    image = model.vae_decode(x[0], alpha=True)
    assert image.shape[:2] == (64, 64) and np.isfinite(image).all()
