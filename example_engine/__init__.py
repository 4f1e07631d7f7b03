"""Runs in the driver's process (``Engine``) and in one Ray actor per TP rank
(``EngineRank``): an example inference engine on raykv, a small TP=2 transformer (MHA,
MLA, hybrid with a Mamba-like layer, optional draft model) whose KV and state go device
-> raykv host pool (L2) -> Mooncake (L3) and back, as an SGLang HiCache engine's would."""

from raykv.example_engine.engine import Engine, Generation
from raykv.example_engine.model import ModelConfig

__all__ = ["Engine", "Generation", "ModelConfig"]
