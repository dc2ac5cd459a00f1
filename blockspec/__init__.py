"""blockspec: an LLM inference engine built around block-diffusion speculative decoding."""

from blockspec.config import ConfigError, EngineConfig
from blockspec.llm import LLM
from blockspec.outputs import RequestOutput
from blockspec.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "ConfigError"]
__version__ = "0.1.0"
