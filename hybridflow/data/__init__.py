"""Datasets: verl-format RL prompts, SFT conversations, the resumable loader, a synthetic GSM8K writer."""

from hybridflow.data.dataset import RLDataset
from hybridflow.data.files import DataError
from hybridflow.data.loader import PromptLoader, build_prompt_loaders, collate_prompts
from hybridflow.data.sft import PackingCollator, SFTDataset, pack_lengths

__all__ = ["DataError", "PackingCollator", "PromptLoader", "RLDataset", "SFTDataset", "build_prompt_loaders",
           "collate_prompts", "pack_lengths"]
