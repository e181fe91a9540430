"""The D-FINE architecture's settings: `DFineConfig`, in transformers' field names, read from a transformers
config.json by `DFineConfig.from_hf`. Its own module so that the backbone (sapiens2_app/detector/dfine_backbone.py) and the
detector model (sapiens2_app/detector/dfine.py) both import it and neither imports the other: dfine.py -> dfine_backbone.py ->
dfine_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class DFineConfig:
    """The architecture, in transformers' `DFineConfig` field names (defaults = transformers' defaults)."""

    # HGNetV2 backbone (transformers' `backbone_config`)
    stem_channels: list = field(default_factory=lambda: [3, 32, 48])
    stem_strides: list = field(default_factory=lambda: [2, 1, 1, 2, 1])
    stage_in_channels: list = field(default_factory=lambda: [48, 128, 512, 1024])
    stage_mid_channels: list = field(default_factory=lambda: [48, 96, 192, 384])
    stage_out_channels: list = field(default_factory=lambda: [128, 512, 1024, 2048])
    stage_num_blocks: list = field(default_factory=lambda: [1, 1, 3, 1])
    stage_downsample: list = field(default_factory=lambda: [False, True, True, True])
    stage_downsample_strides: list = field(default_factory=lambda: [2, 2, 2, 2])
    stage_light_block: list = field(default_factory=lambda: [False, False, True, True])
    stage_kernel_size: list = field(default_factory=lambda: [3, 3, 5, 5])
    stage_numb_of_layers: list = field(default_factory=lambda: [6, 6, 6, 6])
    use_learnable_affine_block: bool = False
    hidden_act: str = "relu"
    out_indices: list = field(default_factory=lambda: [2, 3, 4])  # 0 = stem, i = stage i
    # hybrid encoder
    encoder_hidden_dim: int = 256
    encoder_layers: int = 1
    encoder_ffn_dim: int = 1024
    encoder_attention_heads: int = 8
    encode_proj_layers: list = field(default_factory=lambda: [2])
    positional_encoding_temperature: int = 10000
    encoder_activation_function: str = "gelu"
    activation_function: str = "silu"
    hidden_expansion: float = 1.0
    depth_mult: float = 1.0
    layer_norm_eps: float = 1e-5
    batch_norm_eps: float = 1e-5
    # decoder
    d_model: int = 256
    num_queries: int = 300
    decoder_in_channels: list = field(default_factory=lambda: [256, 256, 256])
    decoder_ffn_dim: int = 1024
    num_feature_levels: int = 3
    decoder_n_points: list | int = 4
    decoder_layers: int = 6
    decoder_attention_heads: int = 8
    decoder_activation_function: str = "relu"
    decoder_offset_scale: float = 0.5
    max_num_bins: int = 32
    reg_scale: float = 4.0
    up: float = 0.5
    top_prob_values: int = 4
    lqe_hidden_dim: int = 64
    lqe_layers: int = 2
    num_labels: int = 80
    id2label: dict = field(default_factory=dict)

    @property
    def points_per_level(self) -> list[int]:
        n = self.decoder_n_points
        return list(n) if isinstance(n, (list, tuple)) else [n] * self.num_feature_levels

    @classmethod
    def from_hf(cls, hf: dict, source: str = "config.json") -> "DFineConfig":
        """From a transformers config.json; features this port leaves out are refused by name."""
        if hf.get("model_type", "d_fine") != "d_fine":
            raise ValueError(f"{source}: model_type {hf.get('model_type')!r}, expected 'd_fine' (a D-FINE detector)")
        unsupported = {  # field: (value this port implements, why the others are left out)
            "eval_idx": ((-1, hf.get("decoder_layers", 6) - 1), "the released models predict from the last layer"),
            "decoder_method": (("default",), "'discrete' sampling is a deployment variant"),
            "learn_initial_query": ((False,), "the released models select their queries from the encoder"),
            "normalize_before": ((False,), "the released encoders are post-norm"),
        }
        for key, (allowed, why) in unsupported.items():
            if key in hf and hf[key] not in allowed:
                raise ValueError(f"{source}: {key}={hf[key]!r} is not supported ({why})")
        levels = hf.get("num_feature_levels", 3)
        if levels != len(hf.get("decoder_in_channels", [256] * 3)):
            raise ValueError(f"{source}: num_feature_levels={levels} differs from the number of encoder outputs; "
                             f"extra downsampled levels are not supported")
        # NOTE: `eval_size` and `anchor_image_size` are not read: the anchors and the AIFI position embedding are
        # computed for the input's feature maps, as the original does. (transformers drops the position embedding
        # at inference when `eval_size` is set; the released configs leave both null.)
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in {**hf.get("backbone_config", {}), **hf}.items() if k in names}
        if "id2label" in values:
            values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
        values.setdefault("num_labels", len(values.get("id2label", {})) or 80)
        return cls(**values)
