"""The OLMo-2 / OLMo-3 model: config and presets, the module, attention backends, the fused loss."""

from olmo_ds.model.config import PRESETS, ModelConfig, YarnConfig, preset
from olmo_ds.model.model import KVCache, ModelOutput, OLMo, Scores, build_model

__all__ = ["PRESETS", "KVCache", "ModelConfig", "ModelOutput", "OLMo", "Scores", "YarnConfig", "build_model", "preset"]
