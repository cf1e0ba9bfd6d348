"""olmo-ds: OLMo-style LLM pretraining on DeepSpeed."""

__version__ = "0.1.0"
