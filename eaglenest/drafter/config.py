"""The drafter's configuration (docs/design.md: Serving format): a one-layer Llama over the target's
hidden size, plus EAGLE-3's fields. `serving_dict` is config.json as SGLang and vLLM read it;
`from_serving_dict` reads it back (the `eaglenest` block holds what engines ignore: the taps in HF
numbering, the target's depth, its rope parameters as given)."""

from transformers import LlamaConfig

from eaglenest.target.directory import head_dim
from eaglenest.target.taps import default_taps

# keys of config.json that describe the format, not the model: rebuilt by `serving_dict`
FORMAT_ONLY = ("architectures", "model_type", "rope_theta", "rope_scaling", "num_aux_hidden_states", "torch_dtype",
               "eaglenest", "eagle_config", "eagle_aux_hidden_state_layer_ids")  # fmt: skip


class DrafterConfig(LlamaConfig):
    """LlamaConfig (hidden_size, heads, rope, the TARGET vocabulary size ...) with
    draft_vocab_size, target_hidden_size, num_target_layers and taps (HF hidden_states indices)."""

    def __init__(self, draft_vocab_size: int = 32000, target_hidden_size: int | None = None,
                 num_target_layers: int = 0, taps=(), **kwargs):  # fmt: skip
        self.draft_vocab_size = draft_vocab_size
        self.target_hidden_size = target_hidden_size
        self.num_target_layers = num_target_layers
        self.taps = list(taps)
        super().__init__(**kwargs)

    @classmethod
    def from_target(cls, cfg: dict, draft_vocab_size: int, taps: list[int],
                    intermediate_size: int | None = None) -> "DrafterConfig":  # fmt: skip
        """The target's shapes (its config.json as a dict); `intermediate_size` widens (or narrows)
        the one MLP: engines read it from config.json, so any width serves."""
        cfg = cfg.get("text_config", cfg)
        rope = cfg.get("rope_parameters") or {
            "rope_type": "default",
            "rope_theta": cfg.get("rope_theta", 10000.0),
            **(cfg.get("rope_scaling") or {}),
        }
        heads = cfg["num_attention_heads"]
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=intermediate_size or cfg["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=head_dim(cfg),
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_parameters=dict(rope),
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            hidden_act=cfg.get("hidden_act", "silu"),
            num_hidden_layers=1,
            tie_word_embeddings=False,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=cfg["hidden_size"],
            num_target_layers=cfg["num_hidden_layers"],
            taps=taps,
        )

    def serving_dict(self) -> dict:
        """config.json as engines read it. Aux layer ids are written only for non-default taps, in
        each engine's own numbering: SGLang's nested id v = OUTPUT of layer v (tap - 1), vLLM's
        top-level id v = INPUT of layer v (= the tap)."""
        rope = dict(self.rope_parameters)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "rope_theta": rope.get("rope_theta", 10000.0),
            "rope_scaling": scaling if scaling.get("rope_type", "default") != "default" else None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": len(self.taps),
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "eaglenest": {
                "taps": self.taps,
                "num_target_layers": self.num_target_layers,
                "rope_parameters": rope,
                "tap_semantics": "HF hidden_states index (input of layer)",
            },
        }
        if self.taps != default_taps(self.num_target_layers):
            out["eagle_config"] = {
                "eagle_aux_hidden_state_layer_ids": [t - 1 for t in self.taps],
                "use_aux_hidden_state": True,
            }
            out["eagle_aux_hidden_state_layer_ids"] = list(self.taps)
        return out

    @classmethod
    def from_serving_dict(cls, d: dict) -> "DrafterConfig":
        e = d["eaglenest"]
        return cls(
            **{k: v for k, v in d.items() if k not in FORMAT_ONLY},
            rope_parameters=dict(e["rope_parameters"]),
            taps=e["taps"],
            num_target_layers=e["num_target_layers"],
        )
