"""The pack's ComfyUI nodes (docs/contract.md §7.3), in ComfyUI's classic node form so that both
ComfyUI 0.3.64 and current releases load them. Imports ComfyUI lazily, inside the node
functions, so that importing this module needs only torch."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
from gmlx_contract import schedules

from .clip import GmlxCLIP
from .connection import MODEL_LIST, Connection, connect
from .errors import GmlxError
from .schedule import ScheduleError, cfg_of, default_steps, server_sigmas
from .settings import load_settings
from .vae import GmlxVAE

log = logging.getLogger("gmlx_comfy")

CATEGORY = "gmlx"
# docs/contract.md §2.6: reference images are encoded at 256² ... 1024² pixels, sides in 32s.
REF_MIN_AREA, REF_MAX_AREA, REF_MULTIPLE = 65_536, 1_048_576, 32
MAX_EDIT_IMAGES = 4


def _loader_inputs() -> dict:
    names = MODEL_LIST.names()
    default = load_settings().default_model
    if default in names:
        names = [default] + [n for n in names if n != default]
    return {
        "required": {
            "model_name": (names,),
            "server_url": (
                "STRING",
                {
                    "default": "",
                    "tooltip": "empty: GMLX_BASE_URL, the settings file, then discovery",
                },
            ),
            "start_server": ("BOOLEAN", {"default": True}),
        }
    }


def _image_side(default: int, minimum: int, tooltip: str | None = None) -> tuple:
    """An image width or height input, in pixels: a multiple of 16 up to 16384."""
    spec = {"default": default, "min": minimum, "max": 16384, "step": 16}
    return ("INT", spec if tooltip is None else {**spec, "tooltip": tooltip})


# What the gmlx Sigmas node's width and height are for.
SCHEDULE_SIDE_TOOLTIP = (
    "the image's {side} in pixels, read only by a model whose schedule depends on the image"
    " size (the node says so when it does); 0: not given"
)


def _connect(model_name: str, server_url: str, start_server: bool) -> tuple[Connection, dict]:
    """Handshake (each time a loader runs, never per step), check the model, read status."""
    conn = connect(server_url, start_server)
    conn.require_model(model_name, remember=not str(server_url or "").strip())
    # cancellable: the connection's client may be held by a call a cancelled prompt left
    status = conn.call(lambda: conn.client.status(model_name))
    return conn, status


class _ServerModelNode:
    """A node whose inputs pick a model on a server (`_loader_inputs`); `load` or `status` runs
    the handshake through `_connect`."""

    @classmethod
    def INPUT_TYPES(cls):
        return _loader_inputs()

    @classmethod
    def VALIDATE_INPUTS(cls, model_name=None, server_url=None):
        """In place of ComfyUI's check against `model_name`'s list, which is the list of the
        server the pack found: a loader that names another server (`server_url`) picks from
        that server's models, which the loader checks when it runs (`require_model`, naming
        what that server lists). An input fed by a link is None here: the loader checks it."""
        if model_name is None or server_url is None or str(server_url).strip():
            return True
        if model_name in MODEL_LIST.names():
            return True
        return (
            f"{model_name!r} is not among the models of the gmlx server the pack found; name"
            " the server that has it in server_url"
        )

    FUNCTION = "load"
    CATEGORY = CATEGORY


class GmlxModelLoader(_ServerModelNode):
    RETURN_TYPES = ("MODEL",)
    DESCRIPTION = "The server's DiT as a MODEL: every model call is one step on the server."

    def load(self, model_name, server_url, start_server):
        from .model import load_remote_model  # imports ComfyUI

        conn, _ = _connect(model_name, server_url, start_server)
        return (load_remote_model(conn, model_name),)


class GmlxCLIPLoader(_ServerModelNode):
    RETURN_TYPES = ("CLIP",)

    def load(self, model_name, server_url, start_server):
        conn, status = _connect(model_name, server_url, start_server)
        return (GmlxCLIP(conn, model_name, status),)


class GmlxVAELoader(_ServerModelNode):
    RETURN_TYPES = ("VAE",)

    def load(self, model_name, server_url, start_server):
        conn, status = _connect(model_name, server_url, start_server)
        return (GmlxVAE(conn, model_name, status),)


class GmlxServerStatus(_ServerModelNode):
    RETURN_TYPES = ("STRING",)
    FUNCTION = "status"
    OUTPUT_NODE = True

    @classmethod
    def IS_CHANGED(cls, **inputs):
        """Run at every prompt, never replayed from ComfyUI's cache: what the server holds
        (the model resident or not, its memory) changes while the inputs stay the same. NaN
        equals nothing, not even the last prompt's answer."""
        return float("nan")

    def status(self, model_name, server_url, start_server):
        conn, status = _connect(model_name, server_url, start_server)
        text = status_text(conn, status)
        return {"ui": {"text": [text]}, "result": (text,)}


def status_text(conn: Connection, status: dict) -> str:
    """The Server Status node's text, a line each: the server, the model and its weights, the
    variant's sampling settings, whether it takes reference images, the server's features."""
    caps = conn.capabilities
    contract = caps.get("contract") or {}
    lines = [
        f"server {conn.url}: gmlx {caps.get('gmlx_version', '?')}, contract "
        f"{contract.get('major')}.{contract.get('minor')}",
        f"model {status.get('model')}: {status.get('family')} {status.get('variant')}, "
        + residency_text(status),
        "sampling: " + sampling_text(status.get("sampling")),
        "reference images: " + ("taken" if status.get("edit_capable") else "not taken"),
        "features: " + (", ".join(caps.get("features") or []) or "none"),
    ]
    return "\n".join(lines)


def residency_text(status: dict) -> str:
    """`resident, holding 3.10 GB (weights: DiT 2.40 GB, text encoder ...)` or `not loaded
    (weights: ...)`, from the status `memory` (docs/contract.md §2.3)."""
    memory = status.get("memory") or {}
    parts = (("DiT", "dit_bytes"), ("text encoder", "encoder_bytes"), ("VAE", "vae_bytes"))
    weights = ", ".join(
        f"{name} {size_text(memory[key])}" for name, key in parts if memory.get(key)
    )
    state = "resident" if status.get("resident") else "not loaded"
    if status.get("resident") and memory.get("resident_bytes"):
        state += f", holding {size_text(memory['resident_bytes'])}"
    return f"{state} (weights: {weights})" if weights else state


def size_text(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


def sampling_text(sampling) -> str:
    """The variant's settings as the gmlx Sigmas node uses them (docs/contract.md §7.3)."""
    if not isinstance(sampling, dict):
        return "none of its own (ComfyUI's simple schedule)"
    words = [f"{sampling.get('steps')} steps", f"cfg {sampling.get('cfg')}"]
    if sampling.get("shift") is not None:
        words.append(f"shift {sampling['shift']}")
    if sampling.get("sigmas"):
        words.append(
            f"fixed sigmas of {len(sampling['sigmas']) - 1} steps (gmlx Sigmas gives them)"
        )
    elif sampling.get("schedule"):
        words.append("a schedule by image size (gmlx Sigmas, given the width and height)")
    if sampling.get("neg_skip"):
        skipped = ", ".join(str(block) for block in sampling["neg_skip"])
        words.append(f"the negative pass skips blocks {skipped}")
    return ", ".join(words)


def remote_status(model) -> dict:
    """The server status a gmlx MODEL was built from; refuses any other MODEL."""
    status = getattr(getattr(model.model, "diffusion_model", None), "status", None)
    if not isinstance(status, dict):
        raise GmlxError("gmlx: the gmlx Sigmas node needs a MODEL from the gmlx Model Loader")
    return status


class GmlxSigmas:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "steps": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 1000,
                        "tooltip": "0: the variant's own step count",
                    },
                ),
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
            },
            "optional": {
                "width": _image_side(0, 0, SCHEDULE_SIDE_TOOLTIP.format(side="width")),
                "height": _image_side(0, 0, SCHEDULE_SIDE_TOOLTIP.format(side="height")),
            },
        }

    RETURN_TYPES = ("SIGMAS", "FLOAT")
    RETURN_NAMES = ("sigmas", "cfg")
    FUNCTION = "sigmas"
    CATEGORY = CATEGORY

    def sigmas(self, model, steps, denoise, width=0, height=0):
        status = remote_status(model)
        sampling = status.get("sampling")
        try:
            sigmas = server_sigmas(
                sampling, status.get("latent") or {}, steps, denoise, width, height
            )
        except ScheduleError as err:
            raise GmlxError(str(err)) from err
        if sigmas is None:
            sigmas = simple_sigmas(model, default_steps(sampling, steps), denoise)
        else:
            sigmas = torch.from_numpy(np.array(sigmas, dtype=np.float32))
        return (sigmas, cfg_of(sampling))


def simple_sigmas(model, steps: int, denoise: float) -> torch.Tensor:
    """ComfyUI's own "simple" schedule, shortened for denoise as BasicScheduler does."""
    import comfy.samplers

    if denoise <= 0.0:
        return torch.FloatTensor([])
    model_sampling = model.get_model_object("model_sampling")
    sigmas = comfy.samplers.simple_scheduler(
        model_sampling, schedules.denoise_total(steps, denoise)
    )
    return schedules.keep_tail(sigmas, steps)


def reference_size(width: int, height: int) -> tuple[int, int]:
    """The size to send a reference image at, so the server encodes it without resizing and
    the VAE sees the same pixels: area within 256²...1024², sides in multiples of 32."""
    area = width * height
    scale = math.sqrt(min(max(area, REF_MIN_AREA), REF_MAX_AREA) / area)
    w = max(REF_MULTIPLE, round(width * scale / REF_MULTIPLE) * REF_MULTIPLE)
    h = max(REF_MULTIPLE, round(height * scale / REF_MULTIPLE) * REF_MULTIPLE)
    while w * h > REF_MAX_AREA:  # rounding up may overshoot: trim the longer side
        if w >= h:
            w -= REF_MULTIPLE
        else:
            h -= REF_MULTIPLE
    while w * h < REF_MIN_AREA:  # or undershoot: grow the shorter side
        if w <= h:
            w += REF_MULTIPLE
        else:
            h += REF_MULTIPLE
    return w, h


class GmlxTextEncodeEdit:
    """Prompt plus reference images for Qwen-Image 2.1 edits: the server's encoder reads the
    images, the VAE encodes the same pixels as reference latents."""

    @classmethod
    def INPUT_TYPES(cls):
        optional = {"vae": ("VAE",)}
        optional.update({f"image{i}": ("IMAGE",) for i in range(1, MAX_EDIT_IMAGES + 1)})
        return {
            "required": {
                "clip": ("CLIP",),
                "prompt": ("STRING", {"multiline": True, "dynamicPrompts": True}),
            },
            "optional": optional,
        }

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"
    CATEGORY = CATEGORY

    def encode(self, clip, prompt, vae=None, **images):
        if vae is None and any(image is not None for image in images.values()):
            raise GmlxError(
                "gmlx Text Encode (edit): the images need the vae input, the gmlx VAE Loader of"
                " the same model: the model sees the pictures as the reference latents the VAE"
                " makes, and the text encoder's reading of them alone is not an edit"
            )
        import comfy.utils

        resized = []
        for i in range(1, MAX_EDIT_IMAGES + 1):
            image = images.get(f"image{i}")
            if image is None:
                continue
            w, h = reference_size(image.shape[2], image.shape[1])
            samples = comfy.utils.common_upscale(image.movedim(-1, 1), w, h, "lanczos", "disabled")
            resized.append(samples.movedim(1, -1)[..., :3].clamp(0.0, 1.0))
        tokens = clip.tokenize(prompt, images=resized)
        conditioning = clip.encode_from_tokens_scheduled(tokens)
        if resized and vae is not None:
            refs = [vae.encode(image) for image in resized]
            conditioning = [
                [c, {**d, "reference_latents": list(d.get("reference_latents", [])) + refs}]
                for c, d in conditioning
            ]
        return (conditioning,)


def latent_size(width: int, height: int, stride: int) -> tuple[int, int, str | None]:
    """The pixel size an empty latent gives (sides floored to the stride), and the note that
    says so when it is not the size asked for."""
    w, h = (width // stride) * stride, (height // stride) * stride
    if w == 0 or h == 0:
        raise GmlxError(f"gmlx Empty Latent: {width}×{height} is under one {stride}-pixel cell")
    if (w, h) == (width, height):
        return w, h, None
    note = (
        f"gmlx Empty Latent: {width}×{height} rounded down to {w}×{h} "
        f"(the model's sides are multiples of {stride})"
    )
    return w, h, note


class GmlxEmptyLatent:
    """Zero latents of the server model's channels and stride (stock empty-latent nodes
    assume other formats, e.g. 4 or 16 channels at stride 8). A size off the sides the model
    takes (the stride times the DiT's patch) is floored, and the node says so (log line and node
    text)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "vae": ("VAE",),
                "width": _image_side(default=1024, minimum=16),
                "height": _image_side(default=1024, minimum=16),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": 16}),
            }
        }

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "empty"
    CATEGORY = CATEGORY

    def empty(self, vae, width, height, batch_size):
        if not isinstance(vae, GmlxVAE):
            raise GmlxError(
                "gmlx Empty Latent needs a VAE from the gmlx VAE Loader: it makes latents of the"
                " server model's channels and size"
            )
        stride = vae.spacial_compression_encode()
        w, h, note = latent_size(width, height, vae.size_multiple)
        shape = (batch_size, vae.latent_channels, h // stride, w // stride)
        latent = {"samples": torch.zeros(shape, dtype=torch.float32)}
        latent["downscale_ratio_spacial"] = stride  # how current ComfyUI reads the cell size
        if note is None:
            return (latent,)
        log.warning(note)
        return {"ui": {"text": [note]}, "result": (latent,)}


class GmlxVAEDecode:
    """RGB images and the VAE's alpha as a MASK, in ComfyUI's convention (LoadImage's):
    mask = 1 − alpha, so 1 marks what is transparent. A VAE without alpha gives a zero mask."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "vae": ("VAE",)}}

    RETURN_TYPES = ("IMAGE", "MASK")
    FUNCTION = "decode"
    CATEGORY = CATEGORY

    def decode(self, samples, vae):
        if not isinstance(vae, GmlxVAE):
            raise GmlxError("gmlx VAE Decode needs a VAE from the gmlx VAE Loader")
        images, alpha = vae.decode_with_alpha(samples["samples"])
        if alpha is None:
            return (images, torch.zeros(images.shape[:3], dtype=torch.float32))
        return (images, 1.0 - alpha)


NODE_CLASS_MAPPINGS = {
    "GmlxModelLoader": GmlxModelLoader,
    "GmlxCLIPLoader": GmlxCLIPLoader,
    "GmlxVAELoader": GmlxVAELoader,
    "GmlxServerStatus": GmlxServerStatus,
    "GmlxSigmas": GmlxSigmas,
    "GmlxTextEncodeEdit": GmlxTextEncodeEdit,
    "GmlxEmptyLatent": GmlxEmptyLatent,
    "GmlxVAEDecode": GmlxVAEDecode,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "GmlxModelLoader": "gmlx Model Loader",
    "GmlxCLIPLoader": "gmlx CLIP Loader",
    "GmlxVAELoader": "gmlx VAE Loader",
    "GmlxServerStatus": "gmlx Server Status",
    "GmlxSigmas": "gmlx Sigmas",
    "GmlxTextEncodeEdit": "gmlx Text Encode (Qwen-Image 2.1 edit)",
    "GmlxEmptyLatent": "gmlx Empty Latent",
    "GmlxVAEDecode": "gmlx VAE Decode (RGB + alpha mask)",
}
